"""RoPE: its inverse frequencies, plain and scaled (Hugging Face's `rope_type`s `default`,
`linear` and `llama3`), computed once per config on the host as transformers computes them
(float32), and the rotation itself.

`inv_freq(head_dim, theta, ...)` -> float32 [head_dim / 2]; `rope(x, positions, inv_freq)`
rotates by `position * inv_freq`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .layers import at_least_float32

# The rope_type values built; transformers' others (dynamic, yarn, longrope, ...) are refused.
ROPE_TYPES = ("default", "linear", "llama3")


def inv_freq(head_dim: int, theta: float, rope_type: str = "default", *, factor: float = 1.0,
             low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
             original_max_len: int = 8192) -> np.ndarray:
    """float32 [head_dim / 2]: theta^(-2i/head_dim), scaled by `rope_type`:

    - `default`: plain RoPE (Su et al. 2021);
    - `linear`: every frequency divided by `factor` (position interpolation, Chen et al. 2023);
    - `llama3` (Llama 3.1): frequencies whose wavelength exceeds original_max_len /
      low_freq_factor divided by `factor`, those under original_max_len / high_freq_factor
      kept, the ones between interpolated (transformers' `_compute_llama3_parameters`).
    """
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not built; accepted: {', '.join(ROPE_TYPES)}")
    base = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                         / np.float32(head_dim)))).astype(np.float32)
    if rope_type == "default":
        return base
    if rope_type == "linear":
        return (base / np.float32(factor)).astype(np.float32)
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / base
    scaled = np.where(wavelen > low_wavelen, base / np.float32(factor), base)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: Any) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), HF Llama's rotate-half convention.

    x [B, T, H, K] with K even; positions int [B, T]; inv_freq float32 [K/2] (`inv_freq`).
    The angles and the rotation are float32, float64 for float64 x: rounded to float32 here, a
    float64 run's rotation was 1e-5 off at position 600 and its logits depended on how XLA
    fused the layer (2.9e-10 apart on the blockwise and naive attention routes).
    """
    k = x.shape[-1]
    acc = at_least_float32(x.dtype)
    inv_freq = jnp.asarray(inv_freq, acc)                                      # [K/2]
    angles = positions.astype(acc)[..., None] * inv_freq                       # [B, T, K/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]        # [B, T, 1, K]
    h = x.astype(acc)
    half = k // 2
    rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return (h * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)
