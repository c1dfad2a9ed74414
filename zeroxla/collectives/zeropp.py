"""ZeRO++ (Wang et al. 2023): the ZeRO-3 collectives with less cross-node traffic.

`ZeroPPCollectives` has the three methods of `ZeroCollectives` and changes what they send:

* qwZ (`quantized_weights`, §3.1): the forward all-gather moves block-quantized int8 (or int4)
  codes plus float32 scales and dequantizes after the gather.
* hpZ (`hpz_partition_size` = k, a divisor of the devices per node, §3.2): the forward gather
  runs over all data devices and keeps, as the layer's residual, a *secondary partition*
  sharded over groups of k consecutive local devices; the backward re-gather is an all-gather
  within the group, so it never leaves the node. Cost: each device holds 1/k of every layer from
  forward to backward (`memory_report` shows it).
* qgZ (`quantized_gradients`, §3.3): the gradient reduce-scatter becomes the hierarchical int4
  all-to-all of `quantized_reduce_scatter`, landing in the same primary-partition layout as
  `psum_scatter`; gradients too small for it fall back to `psum_scatter`.
* `quantized_nontrainable_weights`: a frozen leaf's partition is stored as codes (quantized once
  at init, `LeafPlan.params_quantized`), so its forward and backward gathers move those codes
  (`gather_quantized`) and never quantize again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.zero import (
    BWD_GATHER,
    FWD_GATHER,
    GRAD_REDUCE,
    ZeroCollectives,
    all_gather_flat,
)
from zeroxla.engine.config import ZeroConfig
from zeroxla.engine.mesh import DATA_AXES, LOCAL_AXIS
from zeroxla.engine.plan import LeafPlan
from zeroxla.collectives.quantized import (
    QGZ_BITS,
    gather_quantized,
    quantized_all_gather,
    quantized_reduce_scatter,
    uses_quantized_reduce_scatter,
)


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
    def from_config(cls, config: ZeroConfig) -> "ZeroPPCollectives":
        return cls(compute_dtype=config.dtype, quantized_weights=config.quantized_weights,
                   weight_bits=config.weight_quantization_bits,
                   weight_group_size=config.weight_quantization_group_size,
                   hpz_partition_size=config.hpz_partition_size,
                   quantized_gradients=config.quantized_gradients,
                   gradient_group_size=config.gradient_quantization_group_size)

    def forward_gather(self, shard: Any, leaf: LeafPlan) -> tuple[jax.Array, Any]:
        if not leaf.params_partitioned:
            return shard.astype(self.compute_dtype), None
        with jax.named_scope(FWD_GATHER):
            flat = self._gather_flat(shard, leaf, quantize=self.quantized_weights)
        secondary = self._secondary_partition(flat) if self.hpz else None
        return leaf.unit_from_flat(flat), secondary

    def backward_gather(self, shard: Any, saved: Any, leaf: LeafPlan) -> jax.Array:
        if not leaf.params_partitioned:
            return shard.astype(self.compute_dtype)
        with jax.named_scope(BWD_GATHER):
            if self.hpz:                                                   # intra-node only
                flat = all_gather_flat(saved, LOCAL_AXIS, groups=self._secondary_groups())
            else:   # qwZ quantizes the forward gather only (ZeRO++ §3.1)
                flat = self._gather_flat(shard, leaf, quantize=False)
        return leaf.unit_from_flat(flat)

    def _gather_flat(self, shard: Any, leaf: LeafPlan, *, quantize: bool) -> jax.Array:
        """One unit's partitions from all data devices -> flat [N*chunk] in the compute dtype.

        Codes kept in storage are gathered as they are; a float shard is quantized first when
        `quantize` (qwZ), else gathered in the compute dtype.
        """
        if leaf.params_quantized:
            return gather_quantized(leaf.unit_codes(shard), axis_names=DATA_AXES,
                                    dtype=self.compute_dtype, impl=self.impl)
        if quantize:
            return quantized_all_gather(shard, axis_names=DATA_AXES, bits=self.weight_bits,
                                        group_size=self.weight_group_size,
                                        dtype=self.compute_dtype, impl=self.impl)
        return all_gather_flat(shard.astype(self.compute_dtype), DATA_AXES)

    def reduce_scatter(self, grad: jax.Array, leaf: LeafPlan) -> jax.Array:
        if not (self.quantized_gradients and leaf.params_partitioned):
            return super().reduce_scatter(grad, leaf)
        with jax.named_scope(GRAD_REDUCE):
            flat = leaf.unit_to_flat(grad.astype(jnp.float32))             # [N*chunk]
            return quantized_reduce_scatter(flat, bits=QGZ_BITS,
                                            group_size=self.gradient_group_size,
                                            impl=self.impl).astype(jnp.float32)

    def describe(self, leaf: LeafPlan) -> tuple[str, str, str]:
        forward, backward, gradient = super().describe(leaf)
        if leaf.params_quantized:
            forward = backward = (f"stored int{leaf.storage_bits} codes all-gather over "
                                  f"node+local (groups of {leaf.storage_group_size})")
        elif self.quantized_weights:
            forward = (f"qwZ int{self.weight_bits} all-gather over node+local "
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
        return (self.quantized_gradients and leaf.params_partitioned and leaf.trainable
                and uses_quantized_reduce_scatter(leaf.padded_numel, devices=leaf.data_size,
                                                  group_size=self.gradient_group_size))

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    def _secondary_groups(self) -> list[list[int]] | None:
        """Local-axis index groups of the secondary partition: k consecutive local devices (None:
        the whole node)."""
        k, local = self.hpz_partition_size, lax.axis_size(LOCAL_AXIS)
        return None if k == local else [list(range(g, g + k)) for g in range(0, local, k)]

    def _secondary_partition(self, flat: jax.Array) -> jax.Array:
        """This device's 1/k slice of a gathered flat unit: member j of each group of k local
        devices keeps slice j (every group, on every node, holds the whole unit)."""
        size = flat.shape[0] // self.hpz_partition_size
        member = lax.axis_index(LOCAL_AXIS) % self.hpz_partition_size
        return lax.dynamic_slice_in_dim(flat, member * size, size)
