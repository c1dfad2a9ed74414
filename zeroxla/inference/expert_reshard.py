"""The Hybrid Engine's reshard of a state trained with expert parallelism.

The byte-floor reshard (`reshard`) reads each ZeRO partition where it lies on the inference
mesh, which needs every leaf split over the data devices alone in their flat order. Under
expert parallelism an expert leaf is split two ways at once (its experts over the "expert"
axis, each expert's partition over the expert-data group), so here every leaf takes the
general route instead: its logical value, spread over the training mesh
(`engine.logical.logical_sharding`), then `jax.device_put` into the tensor-parallel layout,
XLA moving the bytes. Inference places the experts as it always does (whole on every device:
tensor-parallel generation leaves `experts` unsplit), so the decode is the one an unsplit
training run's engine compiles. When only the trainable leaves changed (LoRA adapters over a
frozen base found bitwise unchanged, `adapter_switch`), `trainable()` reshards those alone.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.logical import logical_sharding
from zeroxla.inference.layout import TensorParallelLayout
from zeroxla.inference.reshard import check_storage


class ExpertReshard:
    """`reshard(params)`: `state.params` (or the `paths` of it) -> {path: array of `dtype`
    (the engine's `rollout_dtype`) in the tensor-parallel layout}, through the logical values
    (module docstring), cast before they move."""

    def __init__(self, zero_layout: ZeroLayout, layout: TensorParallelLayout,
                 paths: Collection[str] | None = None, dtype: Any = jnp.float32):
        self._zero_layout, self._layout, self._dtype = zero_layout, layout, dtype
        mesh = zero_layout.mesh
        leaves = [leaf for leaf in zero_layout.plan.leaves if paths is None or leaf.path in paths]
        spread = {leaf.path: logical_sharding(mesh, leaf.shape, leaf.stacked, leaf.shard_dim)
                  for leaf in leaves}
        self._logical = jax.jit(lambda params: {
            leaf.path: leaf.unpad(leaf.compute_input(params[leaf.path])).astype(dtype)
            for leaf in leaves}, out_shardings=spread)
        targets = layout.param_shardings()
        self._targets = {leaf.path: targets[leaf.path] for leaf in leaves}

    def __call__(self, params: dict[str, Any]) -> dict[str, jax.Array]:
        return jax.device_put(self._logical(params), self._targets)

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


__all__ = ["expert_reshard"]
