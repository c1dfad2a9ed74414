"""ZeRO's collectives on one parameter leaf, called inside `jax.shard_map` over the mesh.

`ZeroCollectives` is the plain ZeRO-3 set: gather a unit's shards with `all_gather` along the
leaf's shard dim (in the compute dtype, so a bf16 run communicates bf16), re-gather it in
backward, reduce its gradient with `psum_scatter`. ZeRO++ swaps these for quantized /
hierarchical versions with the same three methods. The axes come from the mesh's roles
(`MeshAxes`): ZeRO runs over the data axes whatever else the mesh has.

Each collective sits under a `jax.named_scope` whose name reaches the compiled HLO's op_name
metadata, so `comm_report` can say which phase it belongs to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.wire import all_gather_dim, reduce_scatter_dim
from zeroxla.engine.mesh import MeshAxes
from zeroxla.engine.plan import LeafPlan

FWD_GATHER = "zero_fwd_gather"
BWD_GATHER = "zero_bwd_gather"
GRAD_REDUCE = "zero_grad_reduce"
PARAM_UPDATE = "zero_param_update"


@dataclasses.dataclass(frozen=True)
class ZeroCollectives:
    """Gather/scatter of one unit (one layer, or one whole non-stacked parameter).

    `forward_gather(shard, leaf) -> (full, saved)`: `saved` is what backward needs besides the
    shard (nothing here; hpZ keeps its secondary partition there).
    `backward_gather(shard, saved, leaf) -> full`.
    `reduce_scatter(grad, leaf) -> grad shard`, float32, summed over the data devices. Persistent
    (replicated) leaves pass through unreduced; the step all-reduces them once at the end.
    Frozen leaves have no gradient, so `reduce_scatter` is never called for them.
    """

    axes: MeshAxes
    compute_dtype: Any = jnp.float32

    def forward_gather(self, shard: jax.Array, leaf: LeafPlan) -> tuple[jax.Array, Any]:
        if not leaf.params_partitioned:
            return shard.astype(self.compute_dtype), None
        with jax.named_scope(FWD_GATHER):
            return self._gather(shard, leaf), None

    def backward_gather(self, shard: jax.Array, saved: Any, leaf: LeafPlan) -> jax.Array:
        del saved
        if not leaf.params_partitioned:
            return shard.astype(self.compute_dtype)
        with jax.named_scope(BWD_GATHER):
            return self._gather(shard, leaf)

    def reduce_scatter(self, grad: jax.Array, leaf: LeafPlan) -> jax.Array:
        if not leaf.params_partitioned:
            return grad.astype(jnp.float32)
        with jax.named_scope(GRAD_REDUCE):
            padded = leaf.unit_pad(grad.astype(self.compute_dtype))      # unit_padded_shape
            return reduce_scatter_dim(padded, self.axes.data, leaf.unit_shard_dim)  # shard f32

    def describe(self, leaf: LeafPlan) -> tuple[str, str, str]:
        """(forward gather, backward gather, gradient reduction) of a partitioned leaf, in words."""
        dtype = jnp.dtype(self.compute_dtype).name
        over = "+".join(self.axes.data)
        return (f"all-gather {dtype} over {over}", f"all-gather {dtype} over {over}",
                f"reduce-scatter {dtype} over {over}" if leaf.trainable else "none (frozen)")

    def _gather(self, shard: jax.Array, leaf: LeafPlan) -> jax.Array:
        full = all_gather_dim(shard.astype(self.compute_dtype), self.axes.data,
                              leaf.unit_shard_dim)                        # unit_padded_shape
        return leaf.unit_unpad(full)                                      # unit shape


def data_index(axes: MeshAxes) -> jax.Array:
    """This device's linear index over ("node", "local"), the order of tiled gathers."""
    return lax.axis_index(axes.data)


def scatter_full_gradient(grad: jax.Array, leaf: LeafPlan, axes: MeshAxes) -> jax.Array:
    """Stage 2: a full local gradient -> this device's reduced shard (`psum_scatter`)."""
    with jax.named_scope(GRAD_REDUCE):
        return lax.psum_scatter(leaf.pad(grad), axes.data, scatter_dimension=leaf.shard_dim,
                                tiled=True)


def all_reduce(tree: Any, axes: MeshAxes) -> Any:
    """Sum over the data devices (stage 0-1 gradients, persistent parameters' gradients)."""
    with jax.named_scope(GRAD_REDUCE):
        return lax.psum(tree, axes.data)
