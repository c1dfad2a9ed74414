"""MXFP4 (OCP Microscaling Formats v1.0, FP4 E2M1 elements with one E8M0 scale per 32), the
format gpt-oss' released checkpoints store their experts' weights in, decoded exactly.

A weight W [E, in, out] (transformers' `gate_up_proj` [E, D, 2F], `down_proj` [E, F, D]) is
stored transposed and grouped along `in`: `<name>_blocks` uint8 [E, out, G, 16], two elements
per byte, the element 2j in the low nibble and 2j + 1 in the high one, and `<name>_scales`
uint8 [E, out, G], the group's power of two 2^(s - 127); in = 32 G. An element's 4 bits are a
sign, two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
(`FP4_E2M1`; transformers' `integrations/mxfp4.FP4_VALUES`). Each value times its scale is a
float32 exactly (a 2-bit mantissa times a power of two) unless it overflows; a scale of 255
is NaN in the format. Both are refused naming the tensor, so a decode is exact or refused.
"""

from __future__ import annotations

import numpy as np

GROUP = 32                        # elements per scale
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127
SCALE_NAN = 255
BLOCKS, SCALES = "_blocks", "_scales"


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight's shape [E, in, out] of blocks [E, out, G, 16]."""
    *lead, out, groups, half = blocks_shape
    return (*lead, groups * 2 * half, out)


def decode(blocks: np.ndarray, scales: np.ndarray, name: str,
           dtype: np.dtype = np.float32) -> np.ndarray:
    """The weight `name` [E, in, out] in `dtype` (float32 or float64: each exact) from its
    MXFP4 `blocks` uint8 [E, out, G, 16] and `scales` uint8 [E, out, G]; ValueError naming
    `name` for a shape, dtype or scale that does not decode exactly."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{name}{BLOCKS} {blocks.dtype} and {name}{SCALES} {scales.dtype} "
                         "must be uint8 (MXFP4: packed E2M1 pairs, E8M0 exponents)")
    if blocks.ndim < 2 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != GROUP:
        raise ValueError(f"{name}{BLOCKS} {blocks.shape} and {name}{SCALES} {scales.shape} do "
                         f"not fit MXFP4: blocks [..., G, {GROUP // 2}], scales [..., G]")
    if np.any(scales == SCALE_NAN):
        raise ValueError(f"{name}{SCALES} holds {SCALE_NAN}, NaN in the E8M0 format; accepted: "
                         f"scales 0..{SCALE_NAN - 1}")
    lut = FP4_E2M1.astype(dtype)
    values = np.empty((*blocks.shape[:-1], GROUP), dtype)                    # [.., G, 32]
    values[..., 0::2] = lut[blocks & 0x0F]
    values[..., 1::2] = lut[blocks >> 4]
    exponent = scales.astype(np.int32)[..., None] - SCALE_BIAS               # [.., G, 1]
    with np.errstate(over="ignore"):
        values = np.ldexp(values, exponent)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{name}: an MXFP4 value times its scale overflows {np.dtype(dtype)}; "
                         "decode it to float64")
    weight = values.reshape(*blocks.shape[:-2], -1)                          # [E, out, in]
    return np.ascontiguousarray(np.swapaxes(weight, -1, -2))                 # [E, in, out]
