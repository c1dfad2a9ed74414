"""The Hybrid Engine's reshard of a state trained with expert parallelism.

The byte-floor reshard (`reshard`) reads each ZeRO partition where it lies on the inference
mesh, which needs every leaf split over the data devices alone in their flat order. Under
expert parallelism an expert leaf is split two ways at once (its experts over the "expert"
axis, each expert's partition over the expert-data group), so here every leaf takes the
general route instead: its logical value, spread over the training mesh
(`engine.logical.logical_sharding`), then `jax.device_put` into the tensor-parallel layout,
XLA moving the bytes. Inference places the experts as it always does (whole on every device:
tensor-parallel generation leaves `experts` unsplit), so the decode is the one an unsplit
training run's engine compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.logical import logical_sharding
from zeroxla.inference.layout import TensorParallelLayout


def expert_reshard(zero_layout: ZeroLayout, layout: TensorParallelLayout
                   ) -> Callable[[dict[str, Any]], dict[str, jax.Array]] | None:
    """`state.params` -> {path: float32 array in `layout`} for a layout with an expert axis
    of more than one device; None otherwise (the byte-floor reshard applies)."""
    if zero_layout.axes.expert_size == 1:
        return None
    plan, mesh = zero_layout.plan, zero_layout.mesh
    spread = {leaf.path: logical_sharding(mesh, leaf.shape, leaf.stacked, leaf.shard_dim)
              for leaf in plan.leaves}
    logical = jax.jit(lambda params: {
        leaf.path: leaf.unpad(leaf.compute_input(params[leaf.path])).astype(jnp.float32)
        for leaf in plan.leaves}, out_shardings=spread)
    targets = layout.param_shardings()

    def reshard(params: dict[str, Any]) -> dict[str, jax.Array]:
        return jax.device_put(logical(params), targets)
    return reshard


__all__ = ["expert_reshard"]
