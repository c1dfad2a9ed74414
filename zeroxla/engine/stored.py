"""One parameter's stored form <-> its logical values, as pure functions of its `LeafPlan`.

The plan says how a leaf is stored (`LeafPlan.param_spec` / `param_struct`): a float array
(padded and partitioned, or replicated; layers in their stage slots), a `MasterWithCopy` (a
float32 master partition beside a 16-bit compute copy), or, for a frozen partitioned leaf under
ZeRO++'s quantized_nontrainable_weights, a `StoredCodes` of each device's shard. The plan names
only the codes' bits and group size; quantizing and dequantizing them is done here, with the
kernels (`zeroxla.pallas_kernels`), once at init (`logical_to_storage`) and wherever the logical
values are read back (`storage_to_logical`: `gather_params`, checkpoints, inference).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.pallas_kernels import QuantizedArray, dequantize, quantize
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.stored_forms import MasterWithCopy, StoredCodes


def quantize_partitioned(leaf: LeafPlan, x: jax.Array) -> StoredCodes:
    """Padded layout -> stored codes: each device's shard is quantized on its own, so a device
    holds exactly the codes and scales of its shard."""
    rows = leaf.shards_of(x).reshape(leaf.layers * leaf.data_size, leaf.chunk)
    # Runs once, at init: the jnp path, which vmaps over rows on every backend.
    q = jax.vmap(lambda c: quantize(c, bits=leaf.storage_bits,
                                    group_size=leaf.storage_group_size, impl="jnp"))(rows)
    lead = (leaf.layers,) if leaf.stacked else ()
    groups = leaf.data_size * leaf.storage_groups
    return StoredCodes(data=q.data.reshape(*lead, groups, q.data.shape[-1]),  # [L?, N*G, packed]
                       scales=q.scales.reshape(*lead, groups))                # [L?, N*G]


def dequantize_partitioned(leaf: LeafPlan, codes: StoredCodes) -> jax.Array:
    """Stored codes (global) -> float32 padded layout."""
    rows = leaf.layers * leaf.data_size
    per_device = QuantizedArray(
        data=codes.data.reshape(rows, leaf.storage_groups, -1),
        scales=codes.scales.reshape(rows, leaf.storage_groups), offsets=None,
        shape=(rows, leaf.chunk), bits=leaf.storage_bits, group_size=leaf.storage_group_size)
    flat = dequantize(per_device)                                          # [L*N, chunk]
    lead = (leaf.layers,) if leaf.stacked else ()
    return leaf.from_shards(flat.reshape(*lead, leaf.data_size, leaf.chunk))


def storage_to_logical(leaf: LeafPlan, stored: Any) -> jax.Array:
    """`state.params[leaf.path]` (global, any storage) -> master dtype, the logical `shape`."""
    if leaf.params_quantized:
        stored = dequantize_partitioned(leaf, stored)
    if leaf.has_compute_copy:
        stored = stored.master           # the float32 master, never its 16-bit copy
    return leaf.unpad(stored) if leaf.master_partitioned else leaf.stage_unpad(stored)


def logical_to_storage(leaf: LeafPlan, x: jax.Array) -> Any:
    """Inverse of `storage_to_logical` (up to quantization for quantized storage)."""
    x = jnp.asarray(x, leaf.master_dtype)
    if leaf.has_compute_copy:
        copy = leaf.pad(x) if leaf.params_partitioned else leaf.stage_pad(x)
        return MasterWithCopy(master=leaf.pad(x), compute=copy.astype(leaf.compute_copy_dtype))
    if not leaf.params_partitioned:
        return leaf.stage_pad(x)
    padded = leaf.pad(x)
    return quantize_partitioned(leaf, padded) if leaf.params_quantized else padded


__all__ = ["dequantize_partitioned", "logical_to_storage", "quantize_partitioned",
           "storage_to_logical"]
