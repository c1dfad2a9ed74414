"""`LoRAWeight`: a linear weight W read as W + (alpha / r) * A @ B (Hu et al. 2021, LoRA §4).

The adapter replaces the `nnx.Param` attribute that holds W and is read the way the model
reads a weight (`module.w[...]`), so a model that contracts its weights with einsums, not
through `nnx.Linear` calls, is adapted without changing its code. The adapted weight is formed
before the contraction (the "merged" form): at B = 0 it is W exactly, so the model's function
is unchanged at step 0, and gradients reach A and B through the sum.

Dims: W [*L, *IN, *OUT] (L: the stacked `layers` dim of a `LayerStack`, when present), A [*L,
*IN, r], B [*L, r, *OUT]. A has LoRA's random init (PEFT's and DeepSpeed-Chat's kaiming-uniform:
U(-1/sqrt(fan_in), 1/sqrt(fan_in))), B is zero. A and B are `nnx.LoRAParam`s, so the nnx
filter `nnx.LoRAParam` selects the adapters alone (`only_optimize_lora`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class LoRAWeight(nnx.Module):
    """`base` (the original `nnx.Param`, kept with its metadata) plus rank-r `lora_a`, `lora_b`.

    `self()` and `self[index]` give the adapted weight (`self[...]` as a model reads a Param).
    `fan_in_dims`: how many dims after the stacked ones are W's input dims (the rest are output).
    """

    def __init__(self, base: nnx.Param, *, rank: int, scaling: float, stacked_dims: int,
                 fan_in_dims: int, key: jax.Array):
        shape = base.get_value().shape
        names = base.get_metadata().get("logical_axes") or (None,) * len(shape)
        split = stacked_dims + fan_in_dims
        fan_in = math.prod(shape[stacked_dims:split])
        bound = 1.0 / math.sqrt(fan_in)
        self.base = base
        self.lora_a = nnx.LoRAParam(                                    # [*L, *IN, r]
            jax.random.uniform(key, (*shape[:split], rank), jnp.float32, -bound, bound),
            logical_axes=(*names[:split], None))
        self.lora_b = nnx.LoRAParam(                                    # [*L, r, *OUT]
            jnp.zeros((*shape[:stacked_dims], rank, *shape[split:]), jnp.float32),
            logical_axes=(*names[:stacked_dims], None, *names[split:]))
        self.scaling = scaling
        self.fan_in_dims = fan_in_dims

    def delta(self) -> jax.Array:
        """(alpha / r) * A @ B in W's shape, float32. Inside a `LayerStack`'s scan the stacked
        dim is gone from all three, so the leading dims are counted from A at call time."""
        a, b = self.lora_a[...], self.lora_b[...]
        lead = a.shape[:a.ndim - 1 - self.fan_in_dims]
        rank = a.shape[-1]
        ins, outs = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
        a2 = a.reshape(*lead, math.prod(ins), rank)                     # [*L, IN, r]
        b2 = b.reshape(*lead, rank, math.prod(outs))                    # [*L, r, OUT]
        ab = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST)    # [*L, IN, OUT]
        return self.scaling * ab.reshape(*lead, *ins, *outs)

    def __call__(self) -> jax.Array:
        w = self.base[...]
        return w + self.delta().astype(w.dtype)

    def __getitem__(self, index):
        return self()[index]
