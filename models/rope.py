"""RoPE: its inverse frequencies, plain and scaled (Hugging Face's `rope_type`s `default`,
`linear`, `llama3` and `yarn`), computed once per config on the host as transformers computes
them (float32), and the rotation itself.

`inv_freq(head_dim, theta, ...)` -> float32 [head_dim / 2]; `rope(x, positions, inv_freq,
scaling)` rotates by `position * inv_freq` and multiplies by `scaling` (YaRN's attention
factor, `yarn_attention_factor`, which transformers applies to cos and sin: q and k both).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .invariant import exact_product
from .layers import at_least_float32

# The rope_type values built; transformers' others (dynamic, longrope, ...) are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inv_freq(head_dim: int, theta: float, rope_type: str = "default", *, factor: float = 1.0,
             low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
             original_max_len: int = 8192, beta_fast: float = 32.0, beta_slow: float = 1.0,
             truncate: bool = True) -> np.ndarray:
    """float32 [head_dim / 2]: theta^(-2i/head_dim), scaled by `rope_type`:

    - `default`: plain RoPE (Su et al. 2021);
    - `linear`: every frequency divided by `factor` (position interpolation, Chen et al. 2023);
    - `llama3` (Llama 3.1): frequencies whose wavelength exceeds original_max_len /
      low_freq_factor divided by `factor`, those under original_max_len / high_freq_factor
      kept, the ones between interpolated (transformers' `_compute_llama3_parameters`);
    - `yarn` (Peng et al. 2023, "YaRN"): frequencies ramped from kept (dims that turn more than
      `beta_fast` times over original_max_len) to divided by `factor` (fewer than `beta_slow`
      turns) (transformers' `_compute_yarn_parameters`; its attention factor:
      `yarn_attention_factor`).
    """
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not built; accepted: {', '.join(ROPE_TYPES)}")
    base = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                         / np.float32(head_dim)))).astype(np.float32)
    if rope_type == "default":
        return base
    if rope_type == "linear":
        return (base / np.float32(factor)).astype(np.float32)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, factor, original_max_len, beta_fast, beta_slow, truncate)
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / base
    scaled = np.where(wavelen > low_wavelen, base / np.float32(factor), base)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(head_dim: int, theta: float, factor: float, original_max_len: int, beta_fast: float,
          beta_slow: float, truncate: bool) -> np.ndarray:
    """float32 [head_dim / 2]: YaRN's frequencies, step for step as transformers 5.23's
    `_compute_yarn_parameters` (float32 arrays, Python-float bounds)."""
    powers = (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                    / np.float32(head_dim))).astype(np.float32)
    extrapolation = (1.0 / powers).astype(np.float32)                 # the original frequencies
    interpolation = (1.0 / (np.float32(factor) * powers)).astype(np.float32)

    def dim_of(turns: float) -> float:           # the dim whose wavelength turns `turns` times
        return head_dim * math.log(original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                                 # transformers' guard
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)         # 1: extrapolate (keep), 0: interpolate
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def yarn_attention_factor(factor: float, attention_factor: float | None = None,
                          mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """YaRN's attention factor (the multiplier of cos and sin): `attention_factor` when given,
    else 0.1 ln(factor) + 1 (YaRN §3.4), or DeepSeek's ratio of two such with `mscale` and
    `mscale_all_dim` (transformers' `get_mscale`); 1 for factor <= 1."""
    if attention_factor is not None:
        return float(attention_factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def rope(x: jax.Array, positions: jax.Array, inv_freq: Any, scaling: float = 1.0, *,
         exact: bool = False) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), HF Llama's rotate-half convention.

    x [B, T, H, K] with K even; positions int [B, T]; inv_freq float32 [K/2] (`inv_freq`);
    `scaling` (a Python float) multiplies cos and sin (YaRN's attention factor).
    The angles and the rotation are float32, float64 for float64 x: rounded to float32 here, a
    float64 run's rotation was 1e-5 off at position 600 and its logits depended on how XLA
    fused the layer (2.9e-10 apart on the blockwise and naive attention routes).
    `exact` (the batch-invariant mode, float32): h cos + r sin with each product exact
    (`invariant.exact_product`): XLA:CPU contracts one of them into a fused multiply-add or
    not as the surrounding fusion's shape decides, and the two round differently.
    """
    k = x.shape[-1]
    acc = at_least_float32(x.dtype)
    inv_freq = jnp.asarray(inv_freq, acc)                                      # [K/2]
    angles = positions.astype(acc)[..., None] * inv_freq                       # [B, T, K/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]        # [B, T, 1, K]
    h = x.astype(acc)
    half = k // 2
    rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    if exact:        # the batch-invariant mode: no fused multiply-add may round one term
        return (exact_product(h, cos) + exact_product(rotated, sin)).astype(x.dtype)
    return (h * cos + rotated * sin).astype(x.dtype)
