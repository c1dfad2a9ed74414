"""A computation in host memory inside a jitted program (`jax.experimental.compute_on`), on
each JAX version: `host_computation(fn)`.

Both versions run `fn` as one host computation: a call carrying XLA's `_xla_compute_type =
"host"` attribute, whose equations are traced under the `device_host` compute type (each array
op carries the attribute too), reading its operands where they are and typing its results for
host memory (`jax.memory.Space.Host`, the `pinned_host` memory kind). They spell it apart:

    jax 0.10        `compute_on("device_host")` is a context manager: a `jax.jit` call made
                    under it is the host computation, its results typed as JAX's rules make
                    them (a result of host-typed operands is host-typed)
    jax 0.11.1 on   `compute_on(fn, compute_type="device_host", out_memory_spaces=...)` is a
                    function transformation (0.10's `compute_on2`, renamed), the one host
                    computation; `out_memory_spaces` (a memory space per result, or one for a
                    tree prefix of them) says where each result is put: here `Host` for all,
                    as 0.10 types them from `zeroxla.engine.host_update`'s host-typed operands

The spelling is read from `compute_on`'s own signature (`out_memory_spaces` among its
parameters), not from (major, minor): the change came in a patch release, 0.11.1 (0.11.0 still
has the context manager and `compute_on2`; read from the released wheels). Choosing by minor
version sent 0.11.1 and 0.11.2 down the context-manager side, which failed on an H200 with jax
0.11.2 (2026-11-27: "compute_on() missing 2 required keyword-only arguments").

Neither version lifts the limit that a value made inside the computation (a constant, zeros, a
result of scalars alone) is typed for device memory beside host-typed operands, and that a
primitive or a `lax.cond` refuses the mix (`zeroxla.engine.host_update`'s device fallback,
measured the same for `optax.clip_by_global_norm`, `MultiSteps`, `apply_if_finite`,
`lamb`/`lars`, `adafactor`, `adagrad` and `zero_nans` on jax 0.10.2 and 0.12.0.1).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.compute_on import compute_on

HOST_COMPUTE = "device_host"          # compute_on's compute type for the host


def is_transformation(compute_on_fn: Callable[..., Any]) -> bool:
    """Whether `compute_on_fn` is spelled as a function transformation (it takes
    `out_memory_spaces`: jax 0.11.1 on) rather than as a context manager (jax 0.10, 0.11.0)."""
    return "out_memory_spaces" in inspect.signature(compute_on_fn).parameters


def _host_call_under_context(fn: Callable[..., Any]) -> Callable[..., Any]:
    """jax 0.10 - 0.11.0: `fn` jitted and called under the `compute_on` context manager."""
    def run(*args: Any) -> Any:
        with compute_on(HOST_COMPUTE):
            return jax.jit(fn)(*args)
    return run


def _host_call_transformed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """jax 0.11.1 on: `compute_on` as a transformation of `fn`, every result in host memory."""
    return compute_on(fn, compute_type=HOST_COMPUTE,
                      out_memory_spaces=jax.memory.Space.Host)


def host_computation(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (positional arguments, any pytrees, `None` leaves allowed) as one computation on
    the host inside the enclosing `jax.jit`: its operands should already be typed for host
    memory (`jax.device_put(x, jax.memory.Space.Host)` outside it), its results are typed for
    host memory; the caller puts them where they are stored."""
    if is_transformation(compute_on):
        return _host_call_transformed(fn)
    return _host_call_under_context(fn)


__all__ = ["HOST_COMPUTE", "host_computation", "is_transformation"]
