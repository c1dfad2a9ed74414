"""The Hybrid Engine's reshard of a state trained with expert parallelism.

The byte-floor reshard (`reshard`) reads each ZeRO partition where it lies on the inference
mesh, which needs every leaf split over the data devices alone in their flat order. Under
expert parallelism an expert leaf is split two ways at once (its experts over the "expert"
axis, each expert's partition over the expert-data group), so here every leaf takes the
general route instead: one program computes each leaf's logical value and places it in the
tensor-parallel layout, XLA moving the bytes. Inference places the experts as it always does
(whole on every device: tensor-parallel generation leaves `experts` unsplit), so the decode is
the one an unsplit training run's engine compiles. When only the trainable leaves changed
(LoRA adapters over a frozen base found bitwise unchanged, `adapter_switch`), `trainable()`
reshards those alone.

The tensor-major inference mesh (`layout.inference_mesh`) orders the training devices another
way, and one program's inputs and outputs share one device order. So the program writes each
leaf in its target sharding restated over the training order (the same mesh axes transposed:
every device receives the slice it holds in the target), and the outputs are relabelled onto
the inference mesh without a copy (`reshard.relabel`). A `jax.device_put` across the two
orders would run a gather program per leaf after the logical values' program instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from zeroxla.engine.layout import ZeroLayout
from zeroxla.inference.layout import TensorParallelLayout
from zeroxla.inference.reshard import check_storage, relabel


def in_device_order(sharding: NamedSharding, devices: Sequence[jax.Device]) -> NamedSharding:
    """`sharding` restated over a mesh whose flat device order is `devices`: its mesh's axes
    transposed, names kept, so a device has the same coordinate on every named axis and holds
    the same slice as under `sharding`. ValueError when no order of the axes lists `devices`
    (the two are then not one device set in two regroupings)."""
    grid, names, types = (np.asarray(sharding.mesh.devices), sharding.mesh.axis_names,
                          sharding.mesh.axis_types)
    for order in itertools.permutations(range(grid.ndim)):
        moved = np.transpose(grid, order)
        if list(moved.flat) == list(devices):
            mesh = Mesh(moved, tuple(names[a] for a in order),
                        axis_types=tuple(types[a] for a in order))
            return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    raise ValueError(f"the inference mesh {sharding.mesh} is no regrouping of the training "
                     f"devices' order {[d.id for d in devices]}")


class ExpertReshard:
    """`reshard(params)`: `state.params` (or the `paths` of it) -> {path: array of `dtype`
    (the engine's `rollout_dtype`) in the tensor-parallel layout}, through the logical values
    (module docstring), cast before they move, in one program."""

    def __init__(self, zero_layout: ZeroLayout, layout: TensorParallelLayout,
                 paths: Collection[str] | None = None, dtype: Any = jnp.float32):
        self._zero_layout, self._layout, self._dtype = zero_layout, layout, dtype
        mesh = zero_layout.mesh
        devices = list(np.asarray(mesh.devices).flat)
        leaves = [leaf for leaf in zero_layout.plan.leaves if paths is None or leaf.path in paths]
        targets = layout.param_shardings()
        self._targets = {leaf.path: targets[leaf.path] for leaf in leaves}
        written = {leaf.path: in_device_order(targets[leaf.path], devices) for leaf in leaves}
        self._program = jax.jit(lambda params: {   # {path: [leaf.shape]} in `written`
            leaf.path: leaf.unpad(leaf.compute_input(params[leaf.path])).astype(dtype)
            for leaf in leaves}, out_shardings=written)

    def __call__(self, params: dict[str, Any]) -> dict[str, jax.Array]:
        return {path: relabel(value, self._targets[path])
                for path, value in self._program(params).items()}

    def trainable(self) -> "ExpertReshard":
        """The same reshard of the trainable leaves alone (the adapter-only switch)."""
        paths = [leaf.path for leaf in self._zero_layout.plan.trainable_leaves]
        return ExpertReshard(self._zero_layout, self._layout, paths, self._dtype)


def expert_reshard(zero_layout: ZeroLayout, layout: TensorParallelLayout,
                   dtype: Any = jnp.float32) -> ExpertReshard | None:
    """The reshard of a layout with an expert axis of more than one device; None otherwise:
    the byte-floor reshard applies, and a storage it cannot read is refused now, naming the
    parameter (`reshard.check_storage`), when the engine is built rather than at its first
    generation (a train job's closing sample comes after the training)."""
    if zero_layout.axes.expert_size > 1:
        return ExpertReshard(zero_layout, layout, dtype=dtype)
    check_storage(zero_layout.state_shardings.params, layout)
    return None


__all__ = ["expert_reshard", "in_device_order"]
