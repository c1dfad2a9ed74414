"""Frozen int8/int4 codes in checkpoints: stored in a layout-independent form, restored onto any
mesh bit for bit.

With `quantized_nontrainable_weights` a frozen partitioned leaf lives in the state as codes of
each device's shard (a `StoredCodes`, `zeroxla.engine.stored.quantize_partitioned`), in groups
the plan cuts on the logical tensor (`zeroxla.sharding.plan.frozen_code_groups`): `g`
consecutive elements of a unit (one layer of a stacked leaf) flattened row-major, every shard
on every mesh a whole number of them. A checkpoint stores those groups in their logical order,
as the float leaves are stored at their logical shape: `frozen_codes/<path>/data`
`[L?, G, g * bits / 8]` int8 and `.../scales` `[L?, G]` float32, G = unit elements / g
(`to_logical`; `layout_record` in the JSON). Never floats: dequantizing on save and
requantizing on restore is not idempotent (DeepSpeed's step is absmax/128 with codes clipped to
127, so requantizing a dequantized group shrinks its step and moves its codes on every resume).

Restoring a leaf: each element's (code, step) is read out of the stored groups at the logical
shape (`element_codes`), then

* a quantized target with the same bits and group size, on any mesh (data size, shard dim,
  padding): each target group is one stored group, so `reblock` copies codes and steps, bit
  for bit;
* a quantized target with other groups or fewer bits (another `weight_quantization_group_size`
  or `weight_quantization_bits`): `reblock` keeps every group lying in one stored group whose
  codes fit the target's bits, and requantizes the others from the exact stored values with
  step absmax / (2^(bits-1) - 1) (each value moves by at most half that step), once: restoring
  that onto the same layout again copies it;
* a float target (the leaf trainable, or stored in float32, there): the stored values,
  `code * step` in float32, the same product `dequantize` computes;
* a checkpoint holding floats for a quantized target (format 1, or saved without
  `quantized_nontrainable_weights`): quantized once by the step's own quantizer, as at init.

Format-2 checkpoints stored each device's codes in its shard layout (their `layout_record`
names the data size, shard dim and padding, `leaf_of_record`); they read through the same
`element_codes`.

`dequantize_numpy` gives a leaf's logical float values from its stored codes on the host, whole
or one layer, for readers without devices (export, `load_params`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.stored_forms import StoredCodes

CODES_PREFIX = "frozen_codes/"
FIELDS = ("data", "scales")
LOGICAL = "logical"            # `layout_record`'s "layout" since format 3
# A group whose values' absmax is below this requantizes to step 1 and codes 0 (the quantizer's
# rule for a constant group, `pallas_kernels._common.MIN_RANGE`).
MIN_RANGE = 1e-30
_LOGICAL_KEYS = ("shape", "stacked", "bits", "group_size")
_SHARD_KEYS = ("shape", "stacked", "data_size", "shard_dim", "padded_size", "bits", "group_size")


@dataclasses.dataclass(frozen=True)
class LogicalCodes:
    """A frozen leaf's codes as a checkpoint stores them: groups of `group_size` consecutive
    elements of each unit (the leaf, or one layer of a stacked leaf) flattened row-major."""

    path: str
    shape: tuple[int, ...]
    stacked: bool
    bits: int
    group_size: int

    @property
    def lead(self) -> tuple[int, ...]:
        return self.shape[:1] if self.stacked else ()

    @property
    def unit_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def groups(self) -> int:
        """Groups of one unit (G)."""
        return math.prod(self.unit_shape) // self.group_size

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The stored arrays' shapes: data [L?, G, packed], scales [L?, G]."""
        return {"data": (*self.lead, self.groups, self.group_size * self.bits // 8),
                "scales": (*self.lead, self.groups)}

    @classmethod
    def of(cls, leaf: LeafPlan) -> "LogicalCodes":
        """How the codes of a quantized leaf of the state are stored (`to_logical`)."""
        return cls(path=leaf.path, shape=leaf.shape, stacked=leaf.stacked,
                   bits=leaf.storage_bits, group_size=leaf.storage_group_size)


Stored = LogicalCodes | LeafPlan        # format 3 | format 2 (each device's shard layout)


def array_name(path: str, field: str) -> str:
    """The checkpoint array holding `field` ('data' or 'scales') of frozen leaf `path`."""
    return f"{CODES_PREFIX}{path}/{field}"


def layout_record(leaf: LeafPlan) -> dict[str, Any]:
    """How a quantized leaf's codes are stored (`LogicalCodes.of`), as the checkpoint's JSON
    records it."""
    stored = LogicalCodes.of(leaf)
    return {"layout": LOGICAL, "shape": list(stored.shape), "stacked": stored.stacked,
            "bits": stored.bits, "group_size": stored.group_size}


def _check_keys(path: str, record: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"frozen codes of {path!r}: layout record lacks {missing}; it has "
                         f"{sorted(record)}")


def stored_layout(path: str, record: Mapping[str, Any], like: LeafPlan | None = None) -> Stored:
    """The stored form a checkpoint's `layout_record` describes: `LogicalCodes`, or for a
    format-2 record the `LeafPlan` of the shard layout the codes were saved in."""
    if record.get("layout") != LOGICAL:
        return leaf_of_record(path, record, like)
    _check_keys(path, record, _LOGICAL_KEYS)
    shape = tuple(int(n) for n in record["shape"])
    stored = LogicalCodes(path=path, shape=shape, stacked=bool(record["stacked"]),
                          bits=int(record["bits"]), group_size=int(record["group_size"]))
    if stored.groups * stored.group_size != math.prod(stored.unit_shape):
        raise ValueError(f"frozen codes of {path!r}: group_size={stored.group_size} does not "
                         f"divide a unit of shape {stored.unit_shape}")
    return stored


def leaf_of_record(path: str, record: Mapping[str, Any],
                   like: LeafPlan | None = None) -> LeafPlan:
    """A format-2 record's shard layout as a (quantized, frozen, partitioned) `LeafPlan`; `like`
    supplies the fields that do not decide the layout (mesh axis names, logical axes)."""
    _check_keys(path, record, _SHARD_KEYS)
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


def _bits(stored: Stored) -> int:
    return stored.bits if isinstance(stored, LogicalCodes) else stored.storage_bits


def _unpack(data: Any, bits: int, xp: Any) -> Any:
    """[..., packed] int8 -> [..., group_size] int32 codes (int4: low nibble = first half)."""
    b = data.astype(xp.int32)
    if bits == 8:
        return b
    return xp.concatenate([(b << 28) >> 28, b >> 4], axis=-1)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """Inverse of `_unpack`: [..., group_size] int32 codes -> [..., packed] int8."""
    if bits == 4:
        half = codes.shape[-1] // 2
        codes = (codes[..., :half] & 0xF) | (codes[..., half:] << 4)
    return codes.astype(jnp.int8)


def _shard_element_codes(leaf: LeafPlan, data: jax.Array, scales: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """Codes in `leaf`'s shard layout (the state's, or a format-2 checkpoint's) -> (codes int32,
    steps float32), both of the leaf's logical shape: each element's code and its group's step."""
    rows, groups, gs = leaf.layers * leaf.data_size, leaf.storage_groups, leaf.storage_group_size
    codes = _unpack(data.reshape(rows, groups, -1), leaf.storage_bits, jnp)    # [R, G, gs]
    steps = jnp.broadcast_to(scales.reshape(rows, groups, 1), codes.shape)     # [R, G, gs]
    lead = (leaf.layers,) if leaf.stacked else ()

    def logical(x):   # [R, G, gs] -> the row's first `chunk` elements -> the logical shape
        x = x.reshape(*lead, leaf.data_size, groups * gs)[..., :leaf.chunk]
        return leaf.unpad(leaf.from_shards(x))
    return logical(codes), logical(steps)


def element_codes(stored: Stored, data: jax.Array, scales: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Stored codes -> (codes int32, steps float32), both of the leaf's logical shape."""
    if isinstance(stored, LeafPlan):
        return _shard_element_codes(stored, data, scales)
    codes = _unpack(data, stored.bits, jnp)                                   # [L?, G, g]
    steps = jnp.broadcast_to(scales[..., None], codes.shape)
    return codes.reshape(stored.shape), steps.reshape(stored.shape)


def to_logical(leaf: LeafPlan, q: StoredCodes) -> tuple[jax.Array, jax.Array]:
    """The state's codes of `leaf` (any mesh) -> the stored form (`LogicalCodes`): data
    [L?, G, packed] and scales [L?, G]. Moves codes and steps, computes nothing."""
    codes, steps = _shard_element_codes(leaf, q.data, q.scales)
    lead = (leaf.layers,) if leaf.stacked else ()
    grouped = (*lead, -1, leaf.storage_group_size)
    # A group lies in one shard group (`frozen_code_groups`): its first element's step is its.
    return (_pack(codes.reshape(grouped), leaf.storage_bits),
            steps.reshape(grouped)[..., 0])


def reblock(leaf: LeafPlan, codes: jax.Array, steps: jax.Array, *,
            source_bits: int) -> StoredCodes:
    """Logical (codes, steps) of `source_bits`-bit codes -> `leaf`'s stored codes (see the
    module docstring): a group with one step keeps its codes and step when they fit the leaf's
    bits; any other group is requantized from code * step."""
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
    one_step = any_real & (lo == hi) & (source_bits <= leaf.storage_bits)
    values = jnp.where(real, c.astype(jnp.float32) * s, 0.0)          # exact stored values
    absmax = jnp.max(jnp.abs(values), axis=-1)
    step = jnp.where(absmax > MIN_RANGE, absmax / qmax, 1.0)
    requantized = jnp.clip(jnp.round(values / step[..., None]), -qmax, qmax).astype(jnp.int32)
    new_codes = jnp.where((finite & one_step)[..., None], c,
                          jnp.where((finite & any_real)[..., None], requantized, 0))
    new_steps = jnp.where(~finite, jnp.nan, jnp.where(one_step, lo, jnp.where(any_real, step,
                                                                              1.0)))
    lead = (leaf.layers,) if leaf.stacked else ()
    return StoredCodes(
        data=_pack(new_codes, leaf.storage_bits).reshape(*lead, leaf.data_size * groups, -1),
        scales=new_steps.astype(jnp.float32).reshape(*lead, leaf.data_size * groups))


def _reblocked(stored: Stored, target: LeafPlan, data: jax.Array, scales: jax.Array
               ) -> StoredCodes:
    return reblock(target, *element_codes(stored, data, scales), source_bits=_bits(stored))


def restore_codes(stored: Stored, target: LeafPlan, data: jax.Array, scales: jax.Array,
                  sharding: Any) -> StoredCodes:
    """The target's storage of a frozen leaf read from `stored` codes, `reblock`ed (jitted into
    `sharding`, a StoredCodes of shardings; compiled once per layout pair)."""
    return jax.jit(_reblocked, static_argnums=(0, 1), out_shardings=sharding)(
        stored, target, data, scales)


def _values(stored: Stored, dtype: Any, data: jax.Array, scales: jax.Array) -> jax.Array:
    codes, steps = element_codes(stored, data, scales)
    return (codes.astype(jnp.float32) * steps).astype(dtype)


def restore_values(stored: Stored, data: jax.Array, scales: jax.Array, sharding: Any,
                   dtype: Any = jnp.float32) -> jax.Array:
    """The stored values (code * step in float32, then `dtype`) at the leaf's logical shape,
    in `sharding`."""
    return jax.jit(_values, static_argnums=(0, 1), out_shardings=sharding)(
        stored, np.dtype(dtype), data, scales)


def dequantize_numpy(stored: Stored, data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Host-side stored values, float32 of the logical shape, or of one layer when `data` and
    `scales` are one layer of a stacked leaf."""
    if isinstance(stored, LogicalCodes):            # data [L?, G, packed], scales [L?, G]
        values = (_unpack(data, stored.bits, np).astype(np.float32)
                  * scales[..., None].astype(np.float32))
        return values.reshape(*data.shape[:-2], *stored.unit_shape)
    return _dequantize_shards_numpy(stored, data, scales)


def _dequantize_shards_numpy(leaf: LeafPlan, data: np.ndarray, scales: np.ndarray
                             ) -> np.ndarray:
    """Format 2: `data` [L?, N*G, packed], `scales` [L?, N*G] (or one layer: [N*G, packed],
    [N*G]) in `leaf`'s shard layout."""
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


__all__ = ["CODES_PREFIX", "FIELDS", "LogicalCodes", "array_name", "dequantize_numpy",
           "element_codes", "layout_record", "leaf_of_record", "reblock", "restore_codes",
           "restore_values", "stored_layout", "to_logical"]
