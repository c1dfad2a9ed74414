"""Group quantization in float64 numpy: DeepSpeed's formulas written out, no zeroxla arithmetic.

The expected values of the quantization tests (kernels, collectives) come from here, so that a
test compares the code under test with something it does not share code with. The scheme is
DeepSpeed's group quantizer (`csrc/includes/quantization_utils.h`), as zeroxla documents it in
`pallas_kernels/_common.py`:

- symmetric:  scale = 2^bits / (2 * absmax)
- asymmetric: scale = 2^bits / (max - min),  offset = (max + min) / 2
- code = clamp(round_half_to_even((x - offset) * scale), -2^(bits-1), 2^(bits-1) - 1)
- stored step = 1 / scale; x ~= code * step (+ offset)
- a group whose range (absmax, or max - min) is at most MIN_RANGE gets scale 1;
  a group holding a NaN or +-inf gets codes 0 and step (and offset) NaN.

Rows are split into groups of `group_size` consecutive elements, the last group padded by
repeating the row's last element. int4 codes are packed two a byte: byte k of a group holds
code k in its low nibble and code k + group_size / 2 in its high nibble.

float64 against float32: zeroxla computes `(x - offset) * scale` in float32, a few float32
roundings away from the float64 value here. Where that value lies within those roundings of a
.5 boundary (`Quantized64.near_tie`), float32 may round to the neighbouring code; everywhere else
the codes must be equal. `assert_codes_match` checks exactly that; `codes_at_near_ties` takes the
device's code at those near ties and float64's everywhere else (a float64 model of what the
device computes with).
"""

from __future__ import annotations

import dataclasses

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)   # 2^-23
MIN_RANGE = 1e-30                         # zeroxla's "(nearly) no range" threshold


@dataclasses.dataclass(frozen=True)
class Quantized64:
    """Codes [*lead, G, group_size] int64, steps (and offsets) [*lead, G] float64, and where a
    float32 computation may legitimately round to the neighbouring code (`near_tie`)."""

    codes: np.ndarray
    steps: np.ndarray
    offsets: np.ndarray | None
    near_tie: np.ndarray
    shape: tuple[int, ...]      # the logical shape: shape[:len(lead)] == lead
    bits: int
    group_size: int

    @property
    def lead(self) -> tuple[int, ...]:
        return self.codes.shape[:-2]

    def values(self) -> np.ndarray:
        """The dequantized array (float64, `shape`), padding dropped."""
        return unpad_groups(dequantize_groups64(self.codes, self.steps, self.offsets),
                            self.shape, len(self.lead))


def group_rows(x: np.ndarray, group_size: int) -> np.ndarray:
    """[*lead, n] -> [*lead, G, group_size] float64, each row padded by repeating its last
    element (G = ceil(n / group_size); an empty row counts as one zero)."""
    a = np.asarray(x, np.float64)
    if a.shape[-1] == 0:
        a = np.zeros((*a.shape[:-1], 1))
    pad = [(0, 0)] * (a.ndim - 1) + [(0, -a.shape[-1] % group_size)]
    a = np.pad(a, pad, mode="edge")
    return a.reshape(*a.shape[:-1], -1, group_size)


def quantize_groups64(g: np.ndarray, bits: int, symmetric: bool, slack: float = 4.0):
    """g [..., G, gs] -> (codes int64, steps, offsets or None, near_tie), per the formulas above.

    `near_tie` marks codes whose unrounded value lies within `slack` float32 roundings (of the
    value and of the offset) of a rounding boundary; raise `slack` when g itself carries float32
    error (a sum of N terms: about N)."""
    g = np.asarray(g, np.float64)
    levels = 2.0 ** bits
    q_min, q_max = -levels / 2, levels / 2 - 1
    finite = np.isfinite(g).all(axis=-1)                     # [..., G]
    safe = np.where(finite[..., None], g, 0.0)
    if symmetric:
        absmax = np.abs(safe).max(axis=-1)
        scale = np.where(absmax > MIN_RANGE, levels / (2.0 * np.maximum(absmax, MIN_RANGE)), 1.0)
        offset = np.zeros_like(scale)
    else:
        hi, lo = safe.max(axis=-1), safe.min(axis=-1)
        spread = hi - lo
        scale = np.where(spread > MIN_RANGE, levels / np.maximum(spread, MIN_RANGE), 1.0)
        offset = (hi + lo) / 2
    v = (safe - offset[..., None]) * scale[..., None]        # the unrounded code
    codes = np.clip(np.round(v), q_min, q_max)               # np.round: half to even
    codes = np.where(finite[..., None], codes, 0).astype(np.int64)
    # float32 error of v, in code units: the product and scale roundings (~|v| eps) and the
    # offset's and the subtraction's (~|offset| * scale eps).
    error = slack * EPS32 * (np.abs(v) + np.abs(offset * scale)[..., None] + 1.0)
    boundary = np.floor(v) + 0.5             # the rounding boundary nearest v
    near_tie = (finite[..., None] & (np.abs(v - boundary) <= error)
                & (boundary > q_min) & (boundary < q_max))   # between two unclamped codes
    steps = np.where(finite, 1.0 / scale, np.nan)
    offsets = None if symmetric else np.where(finite, offset, np.nan)
    return codes, steps, offsets, near_tie


def quantize64(x, bits: int, group_size: int, symmetric: bool = True,
               slack: float = 4.0) -> Quantized64:
    """Flat group quantization of x (any shape): codes [G, group_size]."""
    a = np.asarray(x, np.float64)
    codes, steps, offsets, near = quantize_groups64(group_rows(a.reshape(-1), group_size),
                                                    bits, symmetric, slack)
    return Quantized64(codes, steps, offsets, near, tuple(a.shape), bits, group_size)


def quantize_rows64(rows, bits: int, group_size: int, symmetric: bool = True,
                    slack: float = 4.0) -> Quantized64:
    """Each row of rows [*lead, n] quantized on its own: codes [*lead, G, group_size]."""
    a = np.asarray(rows, np.float64)
    codes, steps, offsets, near = quantize_groups64(group_rows(a, group_size), bits, symmetric,
                                                    slack)
    return Quantized64(codes, steps, offsets, near, tuple(a.shape), bits, group_size)


def swizzled_quantize64(x, bits: int, group_size: int, nodes: int, devices_per_node: int,
                        symmetric: bool = True) -> Quantized64:
    """qgZ's layout (ZeRO++ §3.3): x split into nodes * devices_per_node partitions, partition
    (n, l) quantized on its own and stored at [l, n]: codes [devices_per_node, nodes, G, gs]."""
    parts = np.asarray(x, np.float64).reshape(nodes, devices_per_node, -1)
    return quantize_rows64(np.swapaxes(parts, 0, 1), bits, group_size, symmetric)


def dequantize_groups64(codes, steps, offsets=None) -> np.ndarray:
    """codes [..., G, gs] * steps [..., G] (+ offsets): float64 [..., G, gs]."""
    values = np.asarray(codes, np.float64) * np.asarray(steps, np.float64)[..., None]
    if offsets is not None:
        values = values + np.asarray(offsets, np.float64)[..., None]
    return values


def unpad_groups(values: np.ndarray, shape: tuple[int, ...], lead_ndim: int) -> np.ndarray:
    """[*lead, G, gs] -> `shape`, each row's padding dropped (rows: everything after lead)."""
    lead = values.shape[:-2]
    row = int(np.prod(shape[lead_ndim:], dtype=np.int64))
    return values.reshape(*lead, -1)[..., :row].reshape(shape)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., G, gs] -> the stored bytes [..., G, gs * bits / 8] int8."""
    c = np.asarray(codes, np.int64)
    if bits == 8:
        return c.astype(np.int8)
    half = c.shape[-1] // 2
    return ((c[..., :half] & 0xF) | ((c[..., half:] & 0xF) << 4)).astype(np.uint8).view(np.int8)


def unpack_codes(data, bits: int) -> np.ndarray:
    """Stored bytes [..., G, packed] int8 -> codes [..., G, gs] int64 (sign-extended nibbles)."""
    b = np.asarray(data).astype(np.int64)
    if bits == 8:
        return b
    low = ((b & 0xF) ^ 0x8) - 0x8
    return np.concatenate([low, b >> 4], axis=-1)


def assert_codes_match(got_codes, expected: Quantized64) -> int:
    """Codes equal to `expected`'s everywhere except at its near ties, which may be one off.
    Returns how many near ties there were (usually none: a tie needs a float32 coincidence)."""
    got = np.asarray(got_codes)
    assert got.shape == expected.codes.shape, (got.shape, expected.codes.shape)
    diff = np.abs(got - expected.codes)
    bad = (diff > 1) | ((diff == 1) & ~expected.near_tie)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} codes differ from float64 numpy; first at "
        f"{np.argwhere(bad)[0].tolist()}: got {got[bad][0]}, expected {expected.codes[bad][0]}")
    return int(expected.near_tie.sum())


def assert_steps_match(got_steps, got_offsets, expected: Quantized64, rtol: float = 4 * EPS32):
    """Steps (and offsets) within float32 rounding of float64 (NaN where expected is NaN).
    A step is 1 / (2^b / range) computed in float32: two roundings, so rtol 2^-21 by default."""
    np.testing.assert_allclose(np.asarray(got_steps, np.float64), expected.steps, rtol=rtol,
                               equal_nan=True)
    if expected.offsets is None:
        assert got_offsets is None
    else:
        # (max + min) / 2 in float32: roundings relative to max(|max|, |min|), at most
        # |offset| + range / 2 = |offset| + step * 2^(bits-1).
        got = np.asarray(got_offsets, np.float64)
        bound = rtol * (np.abs(expected.offsets) + expected.steps * 2.0 ** (expected.bits - 1))
        both_nan = np.isnan(got) & np.isnan(expected.offsets)
        close = np.abs(got - expected.offsets) <= bound
        assert np.all(both_nan | close), (
            f"offsets differ from float64 numpy at {np.argwhere(~(both_nan | close))[:5].tolist()}")


def shard_index(shape: tuple[int, ...], shard_dim: int, padded: int, parts: int,
                stacked: bool) -> np.ndarray:
    """The partitioned layout in numpy: [L? * parts, chunk] int64, the flat logical index of
    the element each device's shard holds in each slot (-1: padding). The array is padded with
    zeros along `shard_dim` to `padded` elements, split into `parts` pieces along it, and each
    piece flattened row-major (per layer when `stacked`: dim 0 the layers)."""
    index = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    pad = [(0, 0)] * len(shape)
    pad[shard_dim] = (0, padded - shape[shard_dim])
    index = np.pad(index, pad, constant_values=-1)
    pieces = np.stack(np.split(index, parts, axis=shard_dim), axis=1 if stacked else 0)
    return pieces.reshape(-1, pieces[0, 0].size if stacked else pieces[0].size)


def quantize_shards64(x, index: np.ndarray, bits: int, group_size: int) -> Quantized64:
    """Each device's shard of x (`index`: `shard_index`'s) quantized on its own, padding
    slots zero: codes [L? * parts, G, group_size]."""
    flat = np.asarray(x, np.float64).reshape(-1)
    rows = np.where(index >= 0, flat[np.maximum(index, 0)], 0.0)
    return quantize_rows64(rows, bits, group_size)


def from_shards64(rows: np.ndarray, index: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `quantize_shards64`'s layout: rows [L? * parts, chunk] -> `shape`."""
    out = np.empty(int(np.prod(shape, dtype=np.int64)), np.float64)
    out[index[index >= 0]] = np.asarray(rows, np.float64)[index >= 0]
    return out.reshape(shape)


def codes_at_near_ties(got_codes, expected: Quantized64) -> tuple[Quantized64, int]:
    """(`expected` with the device's code wherever float32 may round the other way, how many
    of those codes differ from float64's rounding). Every other code must equal float64's
    exactly and a near tie's be at most one off (`assert_codes_match`): the float64 reference
    of what the device computes with, whichever way float32 broke each near tie."""
    assert_codes_match(got_codes, expected)
    got = np.asarray(got_codes, np.int64)
    taken = int((expected.near_tie & (got != expected.codes)).sum())
    return dataclasses.replace(expected, codes=np.where(expected.near_tie, got,
                                                        expected.codes)), taken


def to_quantized_array(q: Quantized64):
    """`q` in zeroxla's storage format (a `QuantizedArray`: packed int8 codes, float32 steps)."""
    import jax.numpy as jnp
    from zeroxla.pallas_kernels import QuantizedArray

    return QuantizedArray(
        data=jnp.asarray(pack_codes(q.codes, q.bits)),
        scales=jnp.asarray(q.steps, jnp.float32),
        offsets=None if q.offsets is None else jnp.asarray(q.offsets, jnp.float32),
        shape=q.shape, bits=q.bits, group_size=q.group_size)
