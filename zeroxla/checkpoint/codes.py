"""Frozen int8/int4 codes in checkpoints: saved as codes, restored exactly or re-blocked.

With `quantized_nontrainable_weights` a frozen partitioned leaf lives in the state as codes of
each device's shard, in groups (`zeroxla.engine.plan`, `LeafPlan.quantize_partitioned`). A
checkpoint stores those codes and their steps (`frozen_codes/<path>/data`, `.../scales`) with
the group layout they were cut in (`layout_record`), never floats: dequantizing on save and
requantizing on restore is not idempotent (DeepSpeed's step is absmax/128 with codes clipped to
127, so requantizing a dequantized group shrinks its step and moves its codes on every resume).

Restoring a leaf:

* same group layout (same data size, shard dim, padding, group size and bits): the stored
  arrays are the state's, bit for bit (`same_groups`);
* another layout (another data size, so other shards and groups): `reblock`. Each element's
  (code, step) is read out of the stored layout into the logical shape (`element_codes`), then
  cut into the target's groups. A target group whose elements all carry one stored step keeps
  their codes and that step: exact. A group mixing steps cannot hold its values in one step; it
  is requantized from the exact stored values with step absmax / (2^(bits-1) - 1), so each value
  moves by at most half that step. Every target group then has one step, so re-blocking onto the
  same layout again copies it: codes never drift, whatever the number of resumes;
* a float target (the leaf trainable, or stored in float32, there): the stored values,
  `code * step` in float32, the same product `dequantize` computes;
* a checkpoint holding floats for a quantized target (format 1, or saved without
  `quantized_nontrainable_weights`): quantized once by the step's own quantizer, as at init.

`dequantize_numpy` gives a leaf's logical float values from its stored codes on the host, for
readers without devices (export, `load_params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.engine.leaf_plan import LeafPlan
from zeroxla.pallas_kernels import QuantizedArray

CODES_PREFIX = "frozen_codes/"
FIELDS = ("data", "scales")
# A group whose values' absmax is below this requantizes to step 1 and codes 0 (the quantizer's
# rule for a constant group, `pallas_kernels._common.MIN_RANGE`).
MIN_RANGE = 1e-30
_RECORD_KEYS = ("shape", "stacked", "data_size", "shard_dim", "padded_size", "bits",
                "group_size")


def array_name(path: str, field: str) -> str:
    """The checkpoint array holding `field` ('data' or 'scales') of frozen leaf `path`."""
    return f"{CODES_PREFIX}{path}/{field}"


def layout_record(leaf: LeafPlan) -> dict[str, Any]:
    """What decides a quantized leaf's group layout, as stored in the checkpoint's JSON."""
    return {"shape": list(leaf.shape), "stacked": leaf.stacked, "data_size": leaf.data_size,
            "shard_dim": leaf.shard_dim, "padded_size": leaf.padded_size,
            "bits": leaf.storage_bits, "group_size": leaf.storage_group_size}


def leaf_of_record(path: str, record: Mapping[str, Any],
                   like: LeafPlan | None = None) -> LeafPlan:
    """The stored group layout as a (quantized, frozen, partitioned) `LeafPlan`; `like` supplies
    the fields that do not decide the layout (mesh axis names, logical axes)."""
    missing = [k for k in _RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"frozen codes of {path!r}: layout record lacks {missing}; it has "
                         f"{sorted(record)}")
    shape = tuple(int(n) for n in record["shape"])
    fields = dict(shape=shape, stacked=bool(record["stacked"]),
                  data_size=int(record["data_size"]), shard_dim=int(record["shard_dim"]),
                  padded_size=int(record["padded_size"]), storage_bits=int(record["bits"]),
                  storage_group_size=int(record["group_size"]), persistent=False,
                  params_partitioned=True, optimizer_partitioned=False, trainable=False)
    if like is None:
        return LeafPlan(path=path, logical_axes=(None,) * len(shape),
                        data_axes=("node", "local"), **fields)
    return dataclasses.replace(like, **fields)


def same_groups(stored: LeafPlan, target: LeafPlan) -> bool:
    """True when the stored codes are exactly the target's storage (no re-blocking)."""
    return target.params_quantized and all(
        getattr(stored, f) == getattr(target, f)
        for f in ("shape", "stacked", "data_size", "shard_dim", "padded_size", "storage_bits",
                  "storage_group_size"))


def _storage(leaf: LeafPlan, data: jax.Array, scales: jax.Array) -> QuantizedArray:
    shape = (leaf.layers, leaf.chunk) if leaf.stacked else (leaf.chunk,)
    return QuantizedArray(data=data, scales=scales, offsets=None, shape=shape,
                          bits=leaf.storage_bits, group_size=leaf.storage_group_size)


def _unpack(data: Any, bits: int, xp: Any) -> Any:
    """[..., packed] int8 -> [..., group_size] int32 codes (int4: low nibble = first half)."""
    b = data.astype(xp.int32)
    if bits == 8:
        return b
    return xp.concatenate([(b << 28) >> 28, b >> 4], axis=-1)


def element_codes(leaf: LeafPlan, data: jax.Array, scales: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Stored codes in `leaf`'s group layout -> (codes int32, steps float32), both of the leaf's
    logical shape: each element's code and its group's step."""
    rows, groups, gs = leaf.layers * leaf.data_size, leaf.storage_groups, leaf.storage_group_size
    codes = _unpack(data.reshape(rows, groups, -1), leaf.storage_bits, jnp)    # [R, G, gs]
    steps = jnp.broadcast_to(scales.reshape(rows, groups, 1), codes.shape)     # [R, G, gs]
    lead = (leaf.layers,) if leaf.stacked else ()

    def logical(x):   # [R, G, gs] -> the row's first `chunk` elements -> the logical shape
        x = x.reshape(*lead, leaf.data_size, groups * gs)[..., :leaf.chunk]
        return leaf.unpad(leaf.from_shards(x))
    return logical(codes), logical(steps)


def reblock(leaf: LeafPlan, codes: jax.Array, steps: jax.Array) -> QuantizedArray:
    """Logical (codes, steps) -> `leaf`'s stored codes (see the module docstring): a group with
    one step keeps codes and step, a group mixing steps is requantized from code * step."""
    rows, groups, gs = leaf.layers * leaf.data_size, leaf.storage_groups, leaf.storage_group_size
    qmax = 2 ** (leaf.storage_bits - 1) - 1

    def grouped(x):   # logical -> [R, G, gs]: the target's shards, each row edge-padded to
        x = leaf.shards_of(leaf.pad(x)).reshape(rows, leaf.chunk)      # whole groups, as
        return jnp.pad(x, [(0, 0), (0, groups * gs - leaf.chunk)],     # `quantize` pads them
                       mode="edge").reshape(rows, groups, gs)
    c, s = grouped(codes), grouped(steps)
    real = grouped(jnp.ones(codes.shape, bool))          # False on the layout's zero padding
    finite = jnp.all(jnp.isfinite(s) | ~real, axis=-1)                 # [R, G]
    lo = jnp.min(jnp.where(real, s, jnp.inf), axis=-1)
    hi = jnp.max(jnp.where(real, s, -jnp.inf), axis=-1)
    any_real = jnp.any(real, axis=-1)
    one_step = any_real & (lo == hi)
    values = jnp.where(real, c.astype(jnp.float32) * s, 0.0)          # exact stored values
    absmax = jnp.max(jnp.abs(values), axis=-1)
    step = jnp.where(absmax > MIN_RANGE, absmax / qmax, 1.0)
    requantized = jnp.clip(jnp.round(values / step[..., None]), -qmax, qmax).astype(jnp.int32)
    new_codes = jnp.where((finite & one_step)[..., None], c,
                          jnp.where((finite & any_real)[..., None], requantized, 0))
    new_steps = jnp.where(~finite, jnp.nan, jnp.where(one_step, lo, jnp.where(any_real, step,
                                                                              1.0)))
    if leaf.storage_bits == 4:
        half = gs // 2
        new_codes = (new_codes[..., :half] & 0xF) | (new_codes[..., half:] << 4)
    lead = (leaf.layers,) if leaf.stacked else ()
    return _storage(leaf, new_codes.astype(jnp.int8).reshape(*lead, leaf.data_size * groups, -1),
                    new_steps.astype(jnp.float32).reshape(*lead, leaf.data_size * groups))


def restore_codes(stored: LeafPlan, target: LeafPlan, data: jax.Array, scales: jax.Array,
                  sharding: Any) -> QuantizedArray:
    """The target's storage of a frozen leaf read as `stored`'s codes: the arrays themselves on
    the same group layout, else `reblock`ed (jitted into `sharding`, a QuantizedArray of
    shardings)."""
    if same_groups(stored, target):
        return _storage(target, data, scales)
    convert = jax.jit(lambda d, s: reblock(target, *element_codes(stored, d, s)),
                      out_shardings=sharding)
    return convert(data, scales)


def restore_values(stored: LeafPlan, data: jax.Array, scales: jax.Array, sharding: Any,
                   dtype: Any = jnp.float32) -> jax.Array:
    """The stored values (code * step in float32, then `dtype`) at the leaf's logical shape,
    in `sharding`."""
    def values(d, s):
        codes, steps = element_codes(stored, d, s)
        return (codes.astype(jnp.float32) * steps).astype(dtype)
    return jax.jit(values, out_shardings=sharding)(data, scales)


def dequantize_numpy(leaf: LeafPlan, data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Host-side stored values: `data` [L?, N*G, packed], `scales` [L?, N*G] (or one layer of a
    stacked leaf: [N*G, packed], [N*G]) -> float32 of the logical shape (or of one layer)."""
    n, groups, gs = leaf.data_size, leaf.storage_groups, leaf.storage_group_size
    lead = data.shape[:-2]
    codes = _unpack(data.reshape(-1, n, groups, data.shape[-1]), leaf.storage_bits, np)
    values = codes.astype(np.float32) * scales.reshape(-1, n, groups, 1).astype(np.float32)
    rows = values.reshape(-1, n, groups * gs)[..., :leaf.chunk]               # [R, N, chunk]
    pieces = rows.reshape(-1, n, *leaf.shard_shape)
    axis = 1 + leaf.unit_shard_dim
    padded = np.concatenate([pieces[:, d] for d in range(n)], axis=axis)      # [R, *unit_padded]
    unit = np.take(padded, np.arange(leaf.shape[leaf.shard_dim]), axis=axis)
    return unit.reshape(*lead, *leaf.unit_shape)


__all__ = ["CODES_PREFIX", "FIELDS", "array_name", "dequantize_numpy", "element_codes",
           "layout_record", "leaf_of_record", "reblock", "restore_codes", "restore_values",
           "same_groups"]
