"""fp16 loss scaling with DeepSpeed's semantics (`deepspeed/runtime/fp16/loss_scaler.py`).

Dynamic scaling (`DynamicLossScaler`, consecutive_hysteresis=False): on an overflow the step is
skipped; the scale is divided by 2 (not below `min_loss_scale`) once `hysteresis` overflows have
been absorbed, else the hysteresis counter drops by one. After `loss_scale_window` iterations
without overflow (counted from the last overflow) the scale doubles and the hysteresis counter is
restored. A static `loss_scale > 0` never changes. Pure functions over a small pytree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from zeroxla.sharding.config import ZeroConfig

SCALE_FACTOR = 2.0


@struct.dataclass
class LossScaleState:
    scale: jax.Array               # float32 scalar
    cur_iter: jax.Array            # int32: iterations seen
    last_overflow_iter: jax.Array  # int32: -1 before any overflow
    cur_hysteresis: jax.Array      # int32: overflows still tolerated before shrinking


def init_loss_scale(config: ZeroConfig) -> LossScaleState:
    scale = config.loss_scale if config.loss_scale > 0 else 2.0 ** config.initial_scale_power
    return LossScaleState(jnp.float32(scale), jnp.int32(0), jnp.int32(-1),
                          jnp.int32(config.hysteresis))


def update_loss_scale(state: LossScaleState, overflow: jax.Array,
                      config: ZeroConfig) -> LossScaleState:
    """The state after one iteration whose gradients did (`overflow`) or did not overflow."""
    if config.loss_scale > 0:
        return state.replace(cur_iter=state.cur_iter + 1)
    shrink = overflow & ((config.hysteresis == 1) | (state.cur_hysteresis == 1))
    since = state.cur_iter - state.last_overflow_iter
    grow = ~overflow & (since % config.loss_scale_window == 0)
    scale = jnp.where(shrink, jnp.maximum(state.scale / SCALE_FACTOR, config.min_loss_scale),
                      jnp.where(grow, state.scale * SCALE_FACTOR, state.scale))
    hysteresis = jnp.where(overflow & ~shrink, state.cur_hysteresis - 1,
                           jnp.where(grow, jnp.int32(config.hysteresis), state.cur_hysteresis))
    return LossScaleState(
        scale=scale.astype(jnp.float32),
        cur_iter=state.cur_iter + 1,
        last_overflow_iter=jnp.where(overflow, state.cur_iter, state.last_overflow_iter),
        cur_hysteresis=hysteresis.astype(jnp.int32))
