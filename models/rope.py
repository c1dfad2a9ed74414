"""RoPE's inverse frequencies, plain and scaled (Hugging Face's `rope_type`s `default`, `linear`
and `llama3`), computed once per config on the host as transformers computes them (float32).

`inv_freq(head_dim, theta, ...)` -> float32 [head_dim / 2]; `models.layers.rope` rotates by
`position * inv_freq`.
"""

from __future__ import annotations

import math

import numpy as np

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
