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
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.dot_layout import Permuted, as_array, reduce_scatter_permuted
from zeroxla.collectives.wire import (all_gather_dim, all_gather_flat, is_16bit_float,
                                      reduce_scatter_dim, reduce_scatter_flat)
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.leaf_plan import LeafPlan

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

    def gathers(self, leaf: LeafPlan) -> bool:
        """Whether `leaf`'s units go through these collectives (are wrapped by the step)."""
        return leaf.params_partitioned

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

    @property
    def permuted_gradients(self) -> bool:
        """Whether backward hands `reduce_scatter` weight gradients in their dot's dim order
        (`dot_layout.Permuted`). Not under float16 compute: XLA:CPU runs no float16 dot in its
        dot library, so there is nothing to keep there: float16 keeps autodiff's program."""
        return jnp.dtype(self.compute_dtype) != jnp.float16

    def reduce_scatter(self, grad: jax.Array | Permuted, leaf: LeafPlan) -> jax.Array:
        """One unit's gradient (logical unit shape; or `Permuted`, in its dot's dim order)
        -> this device's summed shard (a persistent leaf's: the whole gradient, unsummed)."""
        if not leaf.params_partitioned:
            grad = as_array(grad)
            return grad.astype(jnp.promote_types(grad.dtype, jnp.float32))
        return self._reduce_scatter_unit(grad, leaf)

    def _reduce_scatter_unit(self, grad: jax.Array | Permuted, leaf: LeafPlan) -> jax.Array:
        """One unit's gradient -> this device's summed shard, sent in the compute dtype
        (float32 or wider on arrival, `reduce_scatter_dim`)."""
        with jax.named_scope(GRAD_REDUCE):
            if isinstance(grad, Permuted):
                return reduce_scatter_permuted(
                    Permuted(grad.natural.astype(self.compute_dtype), grad.permutation),
                    leaf.unit_shard_dim, leaf.shard_padding,
                    lambda x, d: reduce_scatter_dim(x, leaf.data_axes, d))
            padded = leaf.unit_pad(grad.astype(self.compute_dtype))      # unit_padded_shape
            return reduce_scatter_dim(padded, leaf.data_axes, leaf.unit_shard_dim)  # shard f32

    def describe(self, leaf: LeafPlan) -> tuple[str, str, str]:
        """(forward gather, backward gather, gradient reduction) of a partitioned leaf, in words."""
        dtype = jnp.dtype(self.compute_dtype).name
        over = "+".join(leaf.data_axes)
        return (f"all-gather {dtype} over {over}", f"all-gather {dtype} over {over}",
                f"reduce-scatter {dtype} over {over}" if leaf.trainable else "none (frozen)")

    def _gather(self, shard: jax.Array, leaf: LeafPlan) -> jax.Array:
        full = all_gather_dim(shard.astype(self.compute_dtype), leaf.data_axes,
                              leaf.unit_shard_dim)                        # unit_padded_shape
        return leaf.unit_unpad(full)                                      # unit shape


@dataclasses.dataclass(frozen=True)
class GradientSink:
    """ZeRO-2's form of a parameter inside the gradient pass: the replicated `value` (compute
    dtype) and `sink`, master-dtype zeros shaped like this device's gradient partition (`[L?,
    *shard_shape]`). The step differentiates the sinks, not the values: a unit's cotangent
    reaches its sink already reduce-scattered (`Zero2Collectives.reduce_scatter`), so only the
    partition of a gradient outlives the backward of the unit that produced it."""

    value: jax.Array
    sink: jax.Array


jax.tree_util.register_dataclass(GradientSink, ["value", "sink"], [])


def sink_zeros(leaf: LeafPlan, compute_dtype: Any) -> jax.Array:
    """Master-dtype zeros shaped like this device's gradient partition of `leaf`
    (`[L?, *shard_shape]`): what a gradient sink is (ZeRO-2's `GradientSink`, stage 3's
    `engine.offload.PartitionSink`)."""
    master = jnp.promote_types(compute_dtype, jnp.float32)          # float64 runs: float64
    return jnp.zeros(((leaf.layers,) if leaf.stacked else ()) + leaf.shard_shape, master)


@dataclasses.dataclass(frozen=True)
class Zero2Collectives(ZeroCollectives):
    """ZeRO-2 (DeepSpeed's stage 2) through the units ZeRO-3 uses: parameters are replicated,
    so a unit's "gather" is the identity on its `GradientSink`'s value (no communication), and
    its gradient is reduce-scattered, in the compute dtype, as soon as backward produces it
    (DeepSpeed's per-bucket `reduce_scatter` during backward). Leaves whose optimizer state is
    not partitioned (scalars) pass through and are all-reduced once at the end."""

    def gathers(self, leaf: LeafPlan) -> bool:
        return leaf.optimizer_partitioned

    def sink(self, leaf: LeafPlan) -> jax.Array:
        """The zeros whose cotangent is this device's reduced gradient partition of `leaf`."""
        return sink_zeros(leaf, self.compute_dtype)

    def forward_gather(self, shard: Any, leaf: LeafPlan) -> tuple[jax.Array, Any]:
        value = shard.value if isinstance(shard, GradientSink) else shard
        return value.astype(self.compute_dtype), None

    def backward_gather(self, shard: Any, saved: Any, leaf: LeafPlan) -> jax.Array:
        return self.forward_gather(shard, leaf)[0]

    def reduce_scatter(self, grad: jax.Array | Permuted, leaf: LeafPlan) -> Any:
        if not leaf.optimizer_partitioned:
            grad = as_array(grad)
            return grad.astype(jnp.promote_types(grad.dtype, jnp.float32))
        part = self._reduce_scatter_unit(grad, leaf)                      # f32 shard
        return GradientSink(value=None, sink=part)        # the cotangent of a GradientSink

    def describe(self, leaf: LeafPlan) -> tuple[str, str, str]:
        dtype = jnp.dtype(self.compute_dtype).name
        over = "+".join(leaf.data_axes)
        return ("none (replicated)", "none (replicated)",
                f"reduce-scatter {dtype} over {over}, per unit in backward")


def data_index(axes: MeshAxes) -> jax.Array:
    """This device's linear index over ("node", "local"), the order of tiled gathers."""
    return lax.axis_index(axes.data)


def scatter_full_gradient(grad: jax.Array, leaf: LeafPlan, axes: MeshAxes) -> jax.Array:
    """A full local gradient -> this device's reduced shard (`psum_scatter`), in one piece
    (the pipeline executor's stage 2; the step's stage 2 scatters per unit, `Zero2Collectives`)."""
    with jax.named_scope(GRAD_REDUCE):
        return lax.psum_scatter(leaf.pad(grad), leaf.data_axes, scatter_dimension=leaf.shard_dim,
                                tiled=True)


def all_reduce(tree: Any, axes: MeshAxes | tuple[str, ...], wire_dtype: Any = jnp.float32) -> Any:
    """Sum over the data devices (stage 0-1 gradients, persistent parameters' gradients).

    With a 16-bit `wire_dtype` (bf16/fp16 compute) each leaf travels in 16 bits, as DeepSpeed's
    gradient all-reduce in the training dtype: a reduce-scatter then an all-gather (the ring
    all-reduce's two halves, the same bytes as a 16-bit all-reduce), each in the wire format
    `zeroxla.collectives.wire` chooses per backend, and both carrying values divided by the
    device count (DeepSpeed's pre-division), so that a loss-scaled fp16 sum never leaves fp16's
    range where its terms do not. Returns float32 (the master dtype). `axes`: the mesh's roles
    (its data axes), or the axis names themselves (an expert leaf's expert-data group)."""
    names = axes.data if isinstance(axes, MeshAxes) else tuple(axes)
    with jax.named_scope(GRAD_REDUCE):
        if not is_16bit_float(wire_dtype):
            return lax.psum(tree, names)
        return jax.tree.map(lambda g: _all_reduce_16bit(g, names, wire_dtype), tree)


def _all_reduce_16bit(g: jax.Array, names: tuple[str, ...], wire_dtype: Any) -> jax.Array:
    """One leaf's sum over the data devices, sent in `wire_dtype`: [size] padded to a multiple
    of N, reduce-scattered (pre-divided by N, summed in float32 where the backend allows,
    `reduce_scatter_flat`), then the mean rounded to 16 bits, all-gathered and multiplied by N
    in float32."""
    n = math.prod(lax.axis_size(a) for a in names)                # the group's devices
    flat = g.reshape(-1)
    flat = jnp.pad(flat, (0, -flat.size % n)).astype(wire_dtype)                # [N * c]
    part = reduce_scatter_flat(flat, names)                                     # f32 sum [c]
    mean = all_gather_flat((part / n).astype(wire_dtype), names)                # [N * c]
    return (mean.astype(jnp.float32) * n)[:g.size].astype(g.dtype).reshape(g.shape)
