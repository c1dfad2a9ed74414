"""The critic: the actor's architecture with a scalar value head, as DeepSpeed-Chat builds it
(`dschat/utils/model/reward_model.py`: the base transformer, then `v_head = Linear(D, 1,
bias=False)` on every position's final hidden state).

The trunk is a `models.GPT` (`embed` -> `blocks` -> `ln_f`); its tied language-model head is
simply not used. `Critic(trunk)` takes the trunk module itself, so the critic can start
from the actor's weights (DeepSpeed-Chat starts it from the reward model's; here the reward is a
program, so the actor's weights are the natural start), with a zero head: values start at 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zeroxla.models import axes
from zeroxla.models.layers import default_positions


class Critic(nnx.Module):
    """`critic(tokens int32[B, T]) -> values float32[B, T]`, the value of each prefix."""

    def __init__(self, trunk: nnx.Module):
        if not all(hasattr(trunk, name) for name in ("embed", "blocks", "ln_f", "config")):
            raise ValueError(f"Critic(trunk): trunk must be a models.GPT (embed, blocks, ln_f); "
                             f"got {type(trunk).__name__}")
        self.trunk = trunk
        d = trunk.config.d_model
        self.v_head = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=(axes.EMBED,))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = default_positions(tokens)                             # [B, T]
        x = self.trunk.embed(tokens, positions)                           # [B, T, D]
        x, _ = self.trunk.blocks(x, positions)
        x = self.trunk.ln_f(x)
        return jnp.einsum("BTD,D->BT", x, self.v_head[...].astype(x.dtype))
