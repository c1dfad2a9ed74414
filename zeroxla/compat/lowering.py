"""Lowering a jitted function for CUDA on a host that has no GPU (a CPU machine, CI).

`jitted.trace(*args).lower(lowering_platforms=("cuda",))` builds the program a GPU would run
without one: the StableHLO of the whole step (its collectives, memory placements, barriers) and
each Pallas kernel's Triton IR (only Triton -> PTX needs the GPU). The Triton lowering needs the
target GPU's compute capability: jax 0.10 falls back to 9.0 (Hopper) when no GPU is attached;
jax 0.12 refuses ("No supported GPU devices found") unless the trace and the lowering run under
an abstract mesh that names an `AbstractDevice`.

`lower_for_cuda` traces and lowers under an empty abstract mesh whose device is an
`NVIDIA H100` (compute capability 9.0): 0.12 reads the capability from it, 0.10 ignores it and
takes its own fallback, the same 9.0, so both versions build the same program from one code path
(no version branch). The mesh has no axes, so it leaves the function's own shardings (a 2 x 4
`Mesh` of CPU devices in the tests) as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

# Compute capability 9.0: jax 0.10's own no-GPU fallback, so both versions target the same GPU.
CUDA_DEVICE_KIND = "NVIDIA H100"


@contextlib.contextmanager
def abstract_cuda_device(device_kind: str = CUDA_DEVICE_KIND) -> Iterator[None]:
    """Within it, jit traces and lowers as for a CUDA GPU of `device_kind` (a `device_kind` as
    `jax.Device.device_kind` spells it, e.g. "NVIDIA A100"), whether or not one is attached.
    Both the trace and the lowering must run inside (jax 0.12 keys its GPU lookup on the trace)."""
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        yield


def lower_for_cuda(jitted: Callable[..., Any], *args: Any,
                   device_kind: str = CUDA_DEVICE_KIND, **kwargs: Any) -> jax.stages.Lowered:
    """`jitted` (a `jax.jit` function) traced with `args` / `kwargs` (arrays or
    `jax.ShapeDtypeStruct`s) and lowered for CUDA on any host: `.as_text()` is the StableHLO a
    GPU would compile, Pallas kernels as Triton custom calls. Nothing runs."""
    with abstract_cuda_device(device_kind):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


__all__ = ["CUDA_DEVICE_KIND", "abstract_cuda_device", "lower_for_cuda"]
