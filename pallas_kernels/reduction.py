"""Dequantize-reduce: sum N quantized tensors in float32 and requantize the sum (ZeRO++ §3.3).

Between the two all-to-all hops of qgZ each device holds N quantized contributions for the same
slice of the gradient (one from each local peer). It dequantizes them, sums in float32 and
requantizes the partial sum before sending it across nodes, so the slow inter-node hop also
carries int4 (DeepSpeed `csrc/quantization/quant_reduce.cu`, `quantized_reduction`). After the
second hop, `dequant_sum` gives the final float32 sum.

The N contributions are stacked along a leading axis -- what `lax.all_to_all` hands back. Group
size and group boundaries are those of the inputs: group g of the output is the sum of group g of
each input, quantized with its own scale. A NaN step in any input's group g (a NaN or +-inf before
quantization), or a float32 overflow of the sum, makes output group g NaN, so an fp16 overflow on
one device reaches every device's overflow check.

GPU: one program reads [N, block_groups, packed] and loops over N with static indices, so N
need not be a power of two; every load and store is a power-of-two block, as the Triton lowering
requires (see `quantization.py` for what is and is not verified without a GPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import (
    DEFAULT_TILES,
    Impl,
    QuantizedArray,
    QuantTiles,
    block_groups_padded,
    check_quant_args,
    dequantize_parts,
    out_struct,
    quantize_parts,
    resolve_interpret,
    store_parts,
    use_pallas,
)
from .quantization import (
    dequantize_groups_reference,
    quantize_groups_reference,
    unpad_rows,
)


def _dequant_reduce_kernel(q_ref, step_ref, *refs, bits, symmetric, requantize):
    # q_ref: [N, bg, packed] int8; step_ref (, offset_ref): [N, bg]
    # outputs: requantize -> codes [bg, packed], step [bg] (, offset [bg]); else sum [bg, gs]
    offset_ref, outs = (None, refs) if symmetric else (refs[0], refs[1:])
    total = None
    for j in range(q_ref.shape[0]):
        offset = None if symmetric else offset_ref[j]
        parts = dequantize_parts(q_ref[j], step_ref[j], offset, bits)
        total = parts if total is None else tuple(t + p for t, p in zip(total, parts))
    if not requantize:
        store_parts(outs[0], total)
        return
    codes, step, offset = quantize_parts(total, bits, symmetric)
    outs[0][...] = codes
    outs[1][...] = step
    if not symmetric:
        outs[2][...] = offset


def _reduce_pallas_call(q: QuantizedArray, *, requantize: bool, interpret: bool,
                        tiles: QuantTiles):
    """Returns (data, steps, offsets) [*lead[1:], G, ...] or the float32 sum [*lead[1:], G, gs]."""
    n, *rest = q.lead
    rows, groups, gs = math.prod(rest), q.groups, q.group_size
    packed = q.data.shape[-1]
    bg = block_groups_padded(tiles, gs, groups)
    padded = math.ceil(groups / bg) * bg

    def rows_of(a):  # [N, *rest, G, ...] -> [N, R, G_padded, ...]; zero groups sum to zero
        a = a.reshape(n, rows, groups, *a.shape[len(q.lead) + 1:])
        return jnp.pad(a, [(0, 0), (0, 0), (0, padded - groups)] + [(0, 0)] * (a.ndim - 3))

    operands = [rows_of(q.data), rows_of(q.scales)]
    in_specs = [pl.BlockSpec((n, None, bg, packed), lambda r, t: (0, r, t, 0)),
                pl.BlockSpec((n, None, bg), lambda r, t: (0, r, t))]
    if not q.symmetric:
        operands.append(rows_of(q.offsets))
        in_specs.append(in_specs[1])
    param_spec = pl.BlockSpec((None, bg), lambda r, t: (r, t))
    if requantize:
        out_shape = [out_struct((rows, padded, packed), jnp.int8, q.data),
                     out_struct((rows, padded), jnp.float32, q.data)]
        out_specs = [pl.BlockSpec((None, bg, packed), lambda r, t: (r, t, 0)), param_spec]
        if not q.symmetric:
            out_shape.append(out_struct((rows, padded), jnp.float32, q.data))
            out_specs.append(param_spec)
    else:
        out_shape = [out_struct((rows, padded, gs), jnp.float32, q.data)]
        out_specs = [pl.BlockSpec((None, bg, gs), lambda r, t: (r, t, 0))]
    outs = pl.pallas_call(
        functools.partial(_dequant_reduce_kernel, bits=q.bits, symmetric=q.symmetric,
                          requantize=requantize),
        out_shape=out_shape,
        grid=(rows, padded // bg),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=None if interpret else tiles.compiler_params(),
        name=f"dequant_reduce_int{q.bits}" if requantize else f"dequant_sum_int{q.bits}",
    )(*operands)
    return [o[:, :groups].reshape(*rest, groups, *o.shape[2:]) for o in outs]


def _check_stacked(q: QuantizedArray, pallas: bool) -> None:
    check_quant_args(q.bits, q.group_size, pallas=pallas)
    if not q.lead:
        raise ValueError("dequant_reduce needs the N quantized tensors stacked on a leading "
                         f"axis (data [N, ..., G, packed]); got data {q.data.shape}")


def dequant_reduce(q: QuantizedArray, *, impl: Impl = "auto", interpret: bool | None = None,
                   tiles: QuantTiles = DEFAULT_TILES) -> QuantizedArray:
    """Sums the N tensors stacked on q's leading axis and requantizes the sum.

    q: data [N, *lead, G, packed], scales [N, *lead, G], shape (N, *s). Returns a QuantizedArray
    of shape s with the same bits, group size and symmetry.
    """
    pallas = use_pallas(impl, q.group_size)
    _check_stacked(q, pallas)
    if not pallas:
        return dequant_reduce_reference(q)
    return _dequant_reduce_pallas(q, interpret=resolve_interpret(interpret), tiles=tiles)


def dequant_sum(q: QuantizedArray, *, impl: Impl = "auto", interpret: bool | None = None,
                tiles: QuantTiles = DEFAULT_TILES) -> jax.Array:
    """float32 sum of the N tensors stacked on q's leading axis: shape q.shape[1:]."""
    pallas = use_pallas(impl, q.group_size)
    _check_stacked(q, pallas)
    if not pallas:
        return dequant_sum_reference(q)
    return _dequant_sum_pallas(q, interpret=resolve_interpret(interpret), tiles=tiles)


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def _dequant_reduce_pallas(q, *, interpret, tiles) -> QuantizedArray:
    data, steps, *offsets = _reduce_pallas_call(q, requantize=True, interpret=interpret,
                                                   tiles=tiles)
    return QuantizedArray(data=data, scales=steps, offsets=offsets[0] if offsets else None,
                          shape=q.shape[1:], bits=q.bits, group_size=q.group_size)


@functools.partial(jax.jit, static_argnames=("interpret", "tiles"))
def _dequant_sum_pallas(q, *, interpret, tiles) -> jax.Array:
    (total,) = _reduce_pallas_call(q, requantize=False, interpret=interpret, tiles=tiles)
    return _unpad_sum(total, q)


@jax.jit
def dequant_reduce_reference(q: QuantizedArray) -> QuantizedArray:
    """Pure-jnp `dequant_reduce`."""
    _check_stacked(q, False)
    total = jnp.sum(dequantize_groups_reference(q), axis=0)  # [*lead[1:], G, gs]
    data, steps, offsets = quantize_groups_reference(total, bits=q.bits,
                                                     symmetric=q.symmetric)
    return QuantizedArray(data=data, scales=steps, offsets=offsets, shape=q.shape[1:],
                          bits=q.bits, group_size=q.group_size)


@jax.jit
def dequant_sum_reference(q: QuantizedArray) -> jax.Array:
    """Pure-jnp `dequant_sum`."""
    _check_stacked(q, False)
    return _unpad_sum(jnp.sum(dequantize_groups_reference(q), axis=0), q)


def _unpad_sum(total: jax.Array, q: QuantizedArray) -> jax.Array:
    """total [*lead[1:], G, gs] -> q.shape[1:], dropping each row's padding."""
    rows = math.prod(q.lead[1:])
    return unpad_rows(total.reshape(rows, q.groups * q.group_size), q.shape[1:], len(q.lead) - 1)
