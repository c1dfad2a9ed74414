"""The stored forms of a parameter that are pytrees rather than one array: a float32 master
beside its 16-bit compute copy (`MasterWithCopy`) and a frozen leaf's block-quantized codes
(`StoredCodes`). Which leaf is stored which way is its `LeafPlan`'s (`zeroxla.sharding.plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class MasterWithCopy:
    """Under 16-bit compute, the storage of a replicated leaf whose optimizer state is
    partitioned (stages 1-2; stage 3's persistent leaves), DeepSpeed's bf16/fp16 optimizers':
    `master`, the float32 master weights, partitioned (global `padded_shape`, sharded like the
    optimizer state), and `compute`, their rounding to the compute dtype, replicated over the
    data axes. Only `master` is updated by the optimizer and saved in checkpoints; `compute` is
    re-gathered from it in 16 bits after every update and rebuilt from it on restore, so it is
    always `master` cast to the compute dtype."""

    master: Any
    compute: Any


jax.tree_util.register_dataclass(MasterWithCopy, ["master", "compute"], [])


@dataclasses.dataclass(frozen=True)
class StoredCodes:
    """The storage of a frozen partitioned leaf under ZeRO++'s quantized_nontrainable_weights
    (`LeafPlan.params_quantized`): block-quantized codes of each device's shard, quantized once
    at init. Global: `data` [L?, N*G, group_size * bits / 8] int8 and `scales` [L?, N*G]
    float32 (the dequantization step of each group); one device holds its own G groups. The
    bits, group size and what the codes stand for are the `LeafPlan`'s (`storage_bits`,
    `storage_group_size`, `chunk`)."""

    data: Any
    scales: Any


jax.tree_util.register_dataclass(StoredCodes, ["data", "scales"], [])
