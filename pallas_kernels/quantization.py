"""Block (group-wise) quantization: `quantize` / `dequantize`, the qwZ kernels (ZeRO++ §3.1).

ZeRO++ §3.1 quantizes weights to int8 before the ZeRO-3 all-gather, one scale per block of
`group_size` elements instead of one per tensor, because a single outlier would otherwise stretch
the scale of the whole tensor. Numerics are DeepSpeed's (see `_common`); DeepSpeed's kernels are
`csrc/quantization/quantize.cu` and `dequantize.cu`.

Any size works: the flattened input is padded to whole groups by repeating its last element
(DeepSpeed#4386 crashed on sizes that were not a multiple of 8).

Each op has a Pallas kernel and a pure-jnp `*_reference`. `impl="auto"` runs the kernel on GPU
and the reference on CPU (where it is the fast path); `"pallas"` forces the kernel (interpreted
off GPU), `"jnp"` the reference.

GPU: the kernels are written for the Pallas Triton lowering (pinned with Triton compiler
params): power-of-two blocks ([block_groups, group_size], both powers of two), only static
slices of refs, no `round` primitive (`round_half_to_even` uses floor), and grids that exactly
cover the padded arrays (the lowering does not mask partial blocks). That they lower to Triton
IR is tested without a GPU (tests/pallas_kernels/test_triton_lowering.py); Triton compilation
and GPU results and speed are not verified here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import (
    DEFAULT_TILES,
    MIN_RANGE,
    Impl,
    QuantizedArray,
    QuantTiles,
    block_groups_padded,
    check_quant_args,
    dequantize_parts,
    out_struct,
    pad_edge,
    quantize_parts,
    resolve_interpret,
    split_parts,
    store_parts,
    use_pallas,
)


# ---------------------------------------------------------------------------------------------
# quantize


def _quantize_kernel(x_ref, q_ref, step_ref, *offset_ref, bits, symmetric):
    # x_ref: [bg, gs]; q_ref: [bg, gs // (8 // bits)] int8; step_ref, offset_ref: [bg]
    codes, step, offset = quantize_parts(split_parts(x_ref, bits), bits, symmetric)
    q_ref[...] = codes
    step_ref[...] = step
    if not symmetric:
        offset_ref[0][...] = offset


def quantize_rows_pallas(x: jax.Array, *, bits: int, symmetric: bool, block_groups: int,
                         swap_lead: bool, interpret: bool, tiles: QuantTiles):
    """Runs the quantize kernel over x [A, B, G, gs]; G must be a multiple of `block_groups`.

    Returns (data, steps, offsets) with leading dims [A, B], or [B, A] when `swap_lead`: the
    output BlockSpec then writes row (a, b) to (b, a), which is how `swizzled_quantize` reorders
    partitions at no extra cost.
    """
    a_size, b_size, groups, gs = x.shape
    bg = block_groups
    packed = gs // (8 // bits)
    lead = (b_size, a_size) if swap_lead else (a_size, b_size)

    def out_block(a, b, t):
        return (b, a, t) if swap_lead else (a, b, t)

    out_shape = [out_struct((*lead, groups, packed), jnp.int8, x),
                 out_struct((*lead, groups), jnp.float32, x)]
    out_specs = [pl.BlockSpec((None, None, bg, packed), lambda a, b, t: (*out_block(a, b, t), 0)),
                 pl.BlockSpec((None, None, bg), out_block)]
    if not symmetric:
        out_shape.append(out_struct((*lead, groups), jnp.float32, x))
        out_specs.append(pl.BlockSpec((None, None, bg), out_block))
    outs = pl.pallas_call(
        functools.partial(_quantize_kernel, bits=bits, symmetric=symmetric),
        out_shape=out_shape,
        grid=(a_size, b_size, groups // bg),
        in_specs=[pl.BlockSpec((None, None, bg, gs), lambda a, b, t: (a, b, t, 0))],
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=None if interpret else tiles.compiler_params(),
        name=f"quantize_int{bits}",
    )(x)
    return outs[0], outs[1], (None if symmetric else outs[2])


def quantize(x: jax.Array, *, bits: int = 8, group_size: int, symmetric: bool = True,
             impl: Impl = "auto", interpret: bool | None = None,
             tiles: QuantTiles = DEFAULT_TILES) -> QuantizedArray:
    """Group-quantizes `x` (any shape, any float dtype) to int8 or packed int4.

    Returns a `QuantizedArray` with data [G, group_size // (8 // bits)], scales (and offsets)
    [G], G = ceil(x.size / group_size); `dequantize` gives back float32 of x.shape.
    """
    pallas = use_pallas(impl, group_size)
    check_quant_args(bits, group_size, pallas=pallas)
    if not pallas:
        return quantize_reference(x, bits=bits, group_size=group_size, symmetric=symmetric)
    return _quantize_pallas(x, bits=bits, group_size=group_size, symmetric=symmetric,
                            interpret=resolve_interpret(interpret), tiles=tiles)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "interpret",
                                             "tiles"))
def _quantize_pallas(x, *, bits, group_size, symmetric, interpret, tiles) -> QuantizedArray:
    n = max(x.size, 1)
    groups = math.ceil(n / group_size)
    bg = block_groups_padded(tiles, group_size, groups)
    padded_groups = math.ceil(groups / bg) * bg
    flat = pad_edge(x.reshape(-1) if x.size else jnp.zeros((1,), x.dtype),
                    padded_groups * group_size)
    data, steps, offsets = quantize_rows_pallas(
        flat.reshape(1, 1, padded_groups, group_size), bits=bits, symmetric=symmetric,
        block_groups=bg, swap_lead=False, interpret=interpret, tiles=tiles)
    return QuantizedArray(data=data[0, 0, :groups], scales=steps[0, 0, :groups],
                          offsets=None if offsets is None else offsets[0, 0, :groups],
                          shape=tuple(x.shape), bits=bits, group_size=group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def quantize_reference(x: jax.Array, *, bits: int = 8, group_size: int,
                       symmetric: bool = True) -> QuantizedArray:
    """Pure-jnp `quantize`: DeepSpeed's formulas on [G, group_size] groups."""
    check_quant_args(bits, group_size, pallas=False)
    n = max(x.size, 1)
    groups = math.ceil(n / group_size)
    flat = x.reshape(-1) if x.size else jnp.zeros((1,), x.dtype)
    data, steps, offsets = quantize_groups_reference(
        pad_edge(flat, groups * group_size).reshape(groups, group_size).astype(jnp.float32),
        bits=bits, symmetric=symmetric)
    return QuantizedArray(data=data, scales=steps, offsets=offsets, shape=tuple(x.shape),
                          bits=bits, group_size=group_size)


def quantize_groups_reference(g: jax.Array, *, bits: int, symmetric: bool):
    """g [..., G, gs] float32 -> (data [..., G, packed] int8, steps [..., G], offsets or None).

    A group holding a NaN or +-inf gets codes 0 and step (and offset) NaN: it dequantizes to NaN.
    """
    levels = 2.0 ** bits
    finite = jnp.all(jnp.isfinite(g), axis=-1)  # [..., G]
    if symmetric:
        absmax = jnp.max(jnp.abs(g), axis=-1)
        ok = absmax > MIN_RANGE
        scale = jnp.where(ok, levels / (2.0 * jnp.where(ok, absmax, 1.0)), 1.0)
        offset = None
        centred = g
    else:
        hi, lo = jnp.max(g, axis=-1), jnp.min(g, axis=-1)
        ok = hi - lo > MIN_RANGE
        scale = jnp.where(ok, levels / jnp.where(ok, hi - lo, 1.0), 1.0)
        offset = jnp.where(finite, (hi + lo) * 0.5, jnp.nan)
        centred = g - offset[..., None]
    codes = jnp.where(finite[..., None], jnp.round(centred * scale[..., None]), 0.0)
    codes = jnp.clip(codes, -levels / 2, levels / 2 - 1).astype(jnp.int32)
    if bits == 4:  # low nibble: first half of the group, high nibble: second half
        half = g.shape[-1] // 2
        codes = (codes[..., :half] & 0xF) | (codes[..., half:] << 4)
    return codes.astype(jnp.int8), jnp.where(finite, 1.0 / scale, jnp.nan), offset


# ---------------------------------------------------------------------------------------------
# dequantize


def _dequantize_kernel(q_ref, step_ref, *refs, bits, symmetric):
    # q_ref: [bg, packed] int8; step_ref (, offset_ref): [bg]; out_ref: [bg, gs] float32
    offset_ref, out_ref = (None, refs[0]) if symmetric else refs
    offset = None if symmetric else offset_ref[...]
    store_parts(out_ref, dequantize_parts(q_ref[...], step_ref[...], offset, bits))


def dequantize_rows_pallas(data: jax.Array, steps: jax.Array, offsets: jax.Array | None, *,
                           bits: int, group_size: int, block_groups: int, interpret: bool,
                           tiles: QuantTiles) -> jax.Array:
    """data [R, G, packed] (G a multiple of `block_groups`) -> float32 [R, G, group_size]."""
    rows, groups, packed = data.shape
    bg = block_groups
    symmetric = offsets is None
    param_spec = pl.BlockSpec((None, bg), lambda r, t: (r, t))
    operands = (data, steps) if symmetric else (data, steps, offsets)
    return pl.pallas_call(
        functools.partial(_dequantize_kernel, bits=bits, symmetric=symmetric),
        out_shape=out_struct((rows, groups, group_size), jnp.float32, data),
        grid=(rows, groups // bg),
        in_specs=[pl.BlockSpec((None, bg, packed), lambda r, t: (r, t, 0))]
        + [param_spec] * (len(operands) - 1),
        out_specs=pl.BlockSpec((None, bg, group_size), lambda r, t: (r, t, 0)),
        interpret=interpret,
        compiler_params=None if interpret else tiles.compiler_params(),
        name=f"dequantize_int{bits}",
    )(*operands)


def dequantize(q: QuantizedArray, *, impl: Impl = "auto", interpret: bool | None = None,
               tiles: QuantTiles = DEFAULT_TILES) -> jax.Array:
    """float32 array of shape `q.shape`: code * step (+ offset) per group, padding dropped."""
    pallas = use_pallas(impl, q.group_size)
    check_quant_args(q.bits, q.group_size, pallas=pallas)
    if not pallas:
        return dequantize_reference(q)
    return _dequantize_pallas(q, interpret=resolve_interpret(interpret), tiles=tiles)


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def _dequantize_pallas(q: QuantizedArray, *, interpret: bool, tiles: QuantTiles) -> jax.Array:
    lead, groups = q.lead, q.groups
    rows = math.prod(lead)
    bg = block_groups_padded(tiles, q.group_size, groups)
    padded = math.ceil(groups / bg) * bg

    def rows_of(a):  # [*lead, G, ...] -> [R, G_padded, ...], zero groups appended
        a = a.reshape(rows, groups, *a.shape[len(lead) + 1:])
        return jnp.pad(a, [(0, 0), (0, padded - groups)] + [(0, 0)] * (a.ndim - 2))

    values = dequantize_rows_pallas(
        rows_of(q.data), rows_of(q.scales), None if q.symmetric else rows_of(q.offsets),
        bits=q.bits, group_size=q.group_size, block_groups=bg, interpret=interpret, tiles=tiles)
    return unpad_rows(values.reshape(rows, padded * q.group_size), q.shape, len(lead))


@jax.jit
def dequantize_reference(q: QuantizedArray) -> jax.Array:
    """Pure-jnp `dequantize`."""
    values = dequantize_groups_reference(q)  # [*lead, G, gs]
    return unpad_rows(values.reshape(math.prod(q.lead), q.groups * q.group_size), q.shape,
                      len(q.lead))


def dequantize_groups_reference(q: QuantizedArray) -> jax.Array:
    """Pure-jnp dequantization keeping the group layout: float32 [*lead, G, group_size]. Every
    code is multiplied by its group's step, so a NaN step (a non-finite group) gives NaN."""
    b = q.data.astype(jnp.int32)
    if q.bits == 4:  # sign-extend the low nibble (first half), then the high one (second half)
        codes = jnp.concatenate([(b << 28) >> 28, b >> 4], axis=-1)
    else:
        codes = b
    values = codes.astype(jnp.float32) * q.scales[..., None]
    return values if q.symmetric else values + q.offsets[..., None]


def unpad_rows(values: jax.Array, shape: tuple[int, ...], lead_ndim: int) -> jax.Array:
    """values [R, padded row] -> `shape`, dropping each row's padding (rows: shape[:lead_ndim])."""
    return values[:, :math.prod(shape[lead_ndim:])].reshape(shape)
