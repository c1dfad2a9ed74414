"""ZeRO's collectives on one parameter leaf, called inside `jax.shard_map` over the data axes.

`ZeroCollectives` is the plain ZeRO-3 set: gather a layer's partition with `all_gather` (in the
compute dtype, so a bf16 run communicates bf16), re-gather it in backward, reduce its gradient
with `psum_scatter`. ZeRO++ swaps these for quantized / hierarchical versions with the same
three methods.

Wire format: 16-bit floats are gathered as their raw bits (uint16) and reduce-scattered as an
all-to-all of raw bits followed by a float32 sum on the receiver. The bytes on the wire are those
of a bf16/fp16 all-gather or reduce-scatter, the sum is more accurate, and no backend can widen
the collective (XLA:CPU turns bf16 collectives into f32 ones, which would double the traffic and
misstate what a GPU run sends). float32 uses `all_gather` / `psum_scatter` as they are.

Each collective sits under a `jax.named_scope` whose name reaches the compiled
HLO's op_name metadata, so `comm_report` can say which phase it belongs to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.engine.mesh import DATA_AXES
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
            flat = leaf.unit_to_flat(grad.astype(self.compute_dtype))          # [N*chunk]
            return reduce_scatter_flat(flat, DATA_AXES)                        # [chunk] f32

    def describe(self, leaf: LeafPlan) -> tuple[str, str, str]:
        """(forward gather, backward gather, gradient reduction) of a partitioned leaf, in words."""
        dtype = jnp.dtype(self.compute_dtype).name
        return (f"all-gather {dtype} over node+local", f"all-gather {dtype} over node+local",
                f"reduce-scatter {dtype} over node+local" if leaf.trainable else "none (frozen)")

    def _gather(self, shard: jax.Array, leaf: LeafPlan) -> jax.Array:
        flat = all_gather_flat(shard.astype(self.compute_dtype), DATA_AXES)   # [N*chunk]
        return leaf.unit_from_flat(flat)                                      # unit shape


def _is_16bit_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def all_gather_flat(x: jax.Array, axes: Any, groups: list[list[int]] | None = None) -> jax.Array:
    """Tiled all-gather of a 1-D array over `axes` (within `groups` of axis indices, if given);
    16-bit floats travel as raw bits."""
    def gather(a):
        return lax.all_gather(a, axes, axis=0, tiled=True, axis_index_groups=groups)
    if not _is_16bit_float(x.dtype):
        return gather(x)
    return lax.bitcast_convert_type(gather(lax.bitcast_convert_type(x, jnp.uint16)), x.dtype)


def reduce_scatter_flat(x: jax.Array, axes: Any) -> jax.Array:
    """Sum of a 1-D array [G*c] over the G devices of `axes`, scattered: chunk i to device i.

    float32: `psum_scatter`. 16-bit: each device sends chunk j's raw bits to device j
    (all-to-all, the same bytes as a 16-bit reduce-scatter) and sums what it receives in
    float32. Returns float32 [c].
    """
    if not _is_16bit_float(x.dtype):
        return lax.psum_scatter(x.astype(jnp.float32), axes, scatter_dimension=0, tiled=True)
    groups = lax.axis_size(axes)
    bits = lax.bitcast_convert_type(x, jnp.uint16).reshape(groups, -1)        # [G, c]
    received = lax.all_to_all(bits, axes, split_axis=0, concat_axis=0, tiled=True)
    return lax.bitcast_convert_type(received, x.dtype).astype(jnp.float32).sum(axis=0)


def data_index() -> jax.Array:
    """This device's linear index over ("node", "local"), the order of tiled gathers."""
    return lax.axis_index(DATA_AXES)


def local_partition(x: jax.Array, leaf: LeafPlan) -> jax.Array:
    """This device's chunk of a replicated full leaf (stages 1-2: the optimizer's slice)."""
    flat = leaf.to_partitioned(x)                                             # [L?, N*chunk]
    start = data_index() * leaf.chunk
    return lax.dynamic_slice_in_dim(flat, start, leaf.chunk, axis=flat.ndim - 1)


def gather_partition(shard: jax.Array, leaf: LeafPlan) -> jax.Array:
    """Inverse of `local_partition`: all devices' chunks -> the replicated full leaf."""
    with jax.named_scope(PARAM_UPDATE):
        flat = lax.all_gather(shard, DATA_AXES, axis=shard.ndim - 1, tiled=True)
    return leaf.from_partitioned(flat)


def scatter_full_gradient(grad: jax.Array, leaf: LeafPlan) -> jax.Array:
    """Stage 2: a full local gradient -> this device's reduced chunk (`psum_scatter`)."""
    with jax.named_scope(GRAD_REDUCE):
        flat = leaf.to_partitioned(grad)
        return lax.psum_scatter(flat, DATA_AXES, scatter_dimension=flat.ndim - 1, tiled=True)


def all_reduce(tree: Any) -> Any:
    """Sum over the data devices (stage 0-1 gradients, persistent parameters' gradients)."""
    with jax.named_scope(GRAD_REDUCE):
        return lax.psum(tree, DATA_AXES)
