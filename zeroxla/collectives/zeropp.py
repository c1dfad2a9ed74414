"""ZeRO++ (Wang et al. 2023): the ZeRO-3 collectives with less cross-node traffic.

`ZeroPPCollectives` has the three methods of `ZeroCollectives` and changes what they send:

* qwZ (`quantized_weights`, §3.1): the forward all-gather moves block-quantized int8 (or int4)
  codes of each device's shard plus float32 scales, and dequantizes after the gather.
* hpZ (`hpz_partition_size` = k, a divisor of the devices per node, §3.2): the forward gather
  runs over all data devices and keeps, as the layer's residual, a *secondary partition*
  sharded over groups of k consecutive local devices; the backward re-gather is an all-gather
  within the group, so it never leaves the node. Cost: each device holds 1/k of every layer from
  forward to backward (`memory_report` shows it).
* qgZ (`quantized_gradients`, §3.3): the gradient reduce-scatter becomes the hierarchical int4
  all-to-all of `quantized_reduce_scatter`, landing in the same shard layout as `psum_scatter`;
  gradients too small for it fall back to `psum_scatter`.
* `quantized_nontrainable_weights`: a frozen leaf's shard is stored as codes (quantized once
  at init, `LeafPlan.params_quantized`, a `StoredCodes`), so its forward and backward gathers
  move those codes (`gather_quantized`) and never quantize again.

Under expert parallelism an expert leaf (`LeafPlan.expert_split`) takes the plain ZeRO-3
collectives over its expert-data group: exact, and never crossing the expert axis, while
every dense leaf takes ZeRO++'s (DeepSpeed's ZeRO++ likewise leaves the expert parameters'
partitions to their own expert-data groups). `describe` says which leaf takes which.

The quantized collectives work on flat vectors: a unit's shards become rows `[N, chunk]` (row d
is device d's shard, `unit_rows`) and back (`rows_to_unit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.quantized import (
    QGZ_BITS,
    gather_quantized,
    quantized_all_gather,
    quantized_reduce_scatter,
    uses_quantized_reduce_scatter,
)
from zeroxla.collectives.dot_layout import Permuted, as_array
from zeroxla.collectives.wire import all_gather_dim
from zeroxla.collectives.zero import BWD_GATHER, FWD_GATHER, GRAD_REDUCE, ZeroCollectives
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.stored_forms import StoredCodes
from zeroxla.pallas_kernels import QuantizedArray


def unit_rows(padded_unit: jax.Array, leaf: LeafPlan) -> jax.Array:
    """A padded unit -> `[N, chunk]`, row d = device d's shard in its own row-major order."""
    pieces = jnp.stack(jnp.split(padded_unit, leaf.data_size, axis=leaf.unit_shard_dim))
    return pieces.reshape(leaf.data_size, leaf.chunk)


def rows_to_unit(rows: jax.Array, leaf: LeafPlan) -> jax.Array:
    """Inverse of `unit_rows`: `[N, chunk]` (or flat `[N * chunk]`) -> the padded unit."""
    pieces = rows.reshape(leaf.data_size, *leaf.shard_shape)
    return jnp.concatenate(list(pieces), axis=leaf.unit_shard_dim)


def unit_codes(shard: StoredCodes, leaf: LeafPlan) -> QuantizedArray:
    """One device's stored codes of one unit (one layer, sliced by the scan, or the whole leaf)
    -> a one-row `QuantizedArray` of `chunk` elements, in the bits and groups the plan names."""
    return QuantizedArray(data=shard.data, scales=shard.scales, offsets=None,
                          shape=(leaf.chunk,), bits=leaf.storage_bits,
                          group_size=leaf.storage_group_size)


@dataclasses.dataclass(frozen=True)
class ZeroPPCollectives(ZeroCollectives):
    quantized_weights: bool = False
    weight_bits: int = 8
    weight_group_size: int = 2048
    hpz_partition_size: int = 1          # 1: hpZ off
    quantized_gradients: bool = False
    gradient_group_size: int = 2048
    impl: str = "auto"

    @classmethod
    def from_config(cls, config: ZeroConfig, axes: MeshAxes) -> "ZeroPPCollectives":
        return cls(axes=axes, compute_dtype=config.dtype,
                   quantized_weights=config.quantized_weights,
                   weight_bits=config.weight_quantization_bits,
                   weight_group_size=config.weight_quantization_group_size,
                   hpz_partition_size=config.hpz_partition_size,
                   quantized_gradients=config.quantized_gradients,
                   gradient_group_size=config.gradient_quantization_group_size)

    def forward_gather(self, shard: Any, leaf: LeafPlan) -> tuple[jax.Array, Any]:
        if not leaf.params_partitioned or leaf.expert_split:
            return super().forward_gather(shard, leaf)
        with jax.named_scope(FWD_GATHER):
            padded = self._gather_padded(shard, leaf, quantize=self.quantized_weights)
        secondary = self._secondary_partition(padded, leaf) if self.hpz else None
        return leaf.unit_unpad(padded), secondary

    def backward_gather(self, shard: Any, saved: Any, leaf: LeafPlan) -> jax.Array:
        if not leaf.params_partitioned or leaf.expert_split:
            return super().backward_gather(shard, saved, leaf)
        with jax.named_scope(BWD_GATHER):
            if self.hpz:                                                   # intra-node only
                padded = all_gather_dim(saved, self.axes.local, leaf.unit_shard_dim,
                                        groups=self._secondary_groups())
            else:   # qwZ quantizes the forward gather only (ZeRO++ §3.1)
                padded = self._gather_padded(shard, leaf, quantize=False)
        return leaf.unit_unpad(padded)

    def _gather_padded(self, shard: Any, leaf: LeafPlan, *, quantize: bool) -> jax.Array:
        """One unit's shards from all data devices -> the padded unit in the compute dtype.

        Codes kept in storage are gathered as they are; a float shard is quantized first when
        `quantize` (qwZ), else gathered in the compute dtype.
        """
        if leaf.params_quantized:
            flat = gather_quantized(unit_codes(shard, leaf), axis_names=self.axes.data,
                                    dtype=self.compute_dtype, impl=self.impl)   # [N*chunk]
            return rows_to_unit(flat, leaf)
        if quantize:
            flat = quantized_all_gather(shard, axis_names=self.axes.data, bits=self.weight_bits,
                                        group_size=self.weight_group_size,
                                        dtype=self.compute_dtype, impl=self.impl)
            return rows_to_unit(flat, leaf)
        return all_gather_dim(shard.astype(self.compute_dtype), self.axes.data,
                              leaf.unit_shard_dim)

    def reduce_scatter(self, grad: jax.Array | Permuted, leaf: LeafPlan) -> jax.Array:
        if not (self.quantized_gradients and leaf.params_partitioned) or leaf.expert_split:
            return super().reduce_scatter(grad, leaf)
        grad = as_array(grad)                       # qgZ's rows are in the weight's order
        with jax.named_scope(GRAD_REDUCE):
            rows = unit_rows(leaf.unit_pad(grad.astype(jnp.float32)), leaf)   # [N, chunk]
            reduced = quantized_reduce_scatter(
                rows.reshape(-1), bits=QGZ_BITS, group_size=self.gradient_group_size,
                impl=self.impl, node_axis=self.axes.node, local_axis=self.axes.local)
            return reduced.astype(jnp.float32).reshape(leaf.shard_shape)

    def describe(self, leaf: LeafPlan) -> tuple[str, str, str]:
        forward, backward, gradient = super().describe(leaf)
        if leaf.expert_split:
            return forward, backward, gradient
        over = "+".join(self.axes.data)
        if leaf.params_quantized:
            forward = backward = (f"stored int{leaf.storage_bits} codes all-gather over "
                                  f"{over} (groups of {leaf.storage_group_size})")
        elif self.quantized_weights:
            forward = (f"qwZ int{self.weight_bits} all-gather over {over} "
                       f"(groups of {self.weight_group_size})")
        if self.hpz:
            backward = (f"hpZ all-gather over {self.hpz_partition_size} local devices "
                        "(secondary partition)")
        if self.quantized_gradients and leaf.trainable:
            gradient = ("qgZ int4 two-hop all-to-all" if self.gradient_is_quantized(leaf) else
                        "reduce-scatter (too small for qgZ)")
        return forward, backward, gradient

    def gradient_is_quantized(self, leaf: LeafPlan) -> bool:
        """Whether qgZ quantizes this leaf's gradient (else it falls back to psum_scatter)."""
        padded_numel = leaf.padded_numel
        return (self.quantized_gradients and leaf.params_partitioned and leaf.trainable
                and not leaf.expert_split
                and uses_quantized_reduce_scatter(padded_numel, devices=leaf.data_size,
                                                  group_size=self.gradient_group_size))

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    def _secondary_groups(self) -> list[list[int]] | None:
        """Local-axis index groups of the secondary partition: k consecutive local devices (None:
        the whole node)."""
        k, local = self.hpz_partition_size, self.axes.local_size
        return None if k == local else [list(range(g, g + k)) for g in range(0, local, k)]

    def _secondary_partition(self, padded: jax.Array, leaf: LeafPlan) -> jax.Array:
        """This device's 1/k slice of a gathered padded unit along the shard dim: member j of
        each group of k local devices keeps slice j (every group, on every node, holds the whole
        unit)."""
        size = padded.shape[leaf.unit_shard_dim] // self.hpz_partition_size
        member = lax.axis_index(self.axes.local) % self.hpz_partition_size
        return lax.dynamic_slice_in_dim(padded, member * size, size, axis=leaf.unit_shard_dim)
