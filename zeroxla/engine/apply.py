"""The update half of the step: on global arrays, outside the `shard_map`.

    reduced gradients (stored layout, times the loss scale)
      -> logical gradients / scale -> global norm -> DeepSpeed's clipping
      -> the optax transformation on the logical trainable parameters (`ShardedOptimizer`)
      -> each updated leaf back in its stored layout (`engine.update.stored_update`)
      -> fp16 (or `check_grad_overflow`): a non-finite gradient keeps parameters and optimizer
         state bit-identical; under fp16 the loss scale moves
    ZeRO-Offload: the update in host memory where it traces (`engine.host_update`), else on
    the device with the optimizer state and masters moved in from host memory before, out after

A pure function of the layout, the state and the gradient pass's outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from zeroxla.collectives.zero import PARAM_UPDATE
from zeroxla.engine.host_update import host_update
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.loss_scale import update_loss_scale
from zeroxla.engine.offload import offloaded, resident
from zeroxla.engine.state import TrainState
from zeroxla.engine.update import logical_gradient, optimizer_input, stored_update


def apply_gradients(layout: ZeroLayout, state: TrainState, loss: jax.Array,
                    grads: dict[str, jax.Array], model_state: dict[str, jax.Array],
                    scale: jax.Array, *, on_host: bool = False
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The next state and the step's metrics (loss, grad_norm; overflow when the step checks
    for it; fp16: loss_scale).
    With ZeRO-Offload the update runs in host memory (`on_host`: `engine.host_update`), or on
    the device with the optimizer state and masters brought in from host memory and sent back
    after it (`engine.offload`); the step's `UpdatePlacement` chose which."""
    cfg, mesh, trainable = layout.config, layout.mesh, layout.plan.trainable_leaves
    logical_grads = {leaf.path: logical_gradient(leaf, grads[leaf.path] / scale,
                                                 cfg.stage, mesh) for leaf in trainable}
    grad_norm = optax.tree.norm(logical_grads)
    if cfg.gradient_clipping > 0:
        # DeepSpeed's clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
        coef = jnp.minimum(cfg.gradient_clipping / (grad_norm + 1e-6), 1.0)
        logical_grads = jax.tree.map(lambda g: g * coef, logical_grads)

    if on_host:                      # ZeRO-Offload's update in host memory (`host_update`)
        return _host_applied(layout, state, loss, logical_grads, grad_norm, model_state)

    # The update on the device; offloaded state comes onto the device for it, and goes back.
    state = resident(layout, state)
    with jax.named_scope(PARAM_UPDATE):
        params = {leaf.path: optimizer_input(leaf, state.params[leaf.path], mesh)
                  for leaf in trainable}
        new_logical, new_opt_state = layout.sharded_optimizer.update(
            logical_grads, state.opt_state, params)
        new_params = dict(state.params)
        new_params.update({leaf.path: stored_update(leaf, new_logical[leaf.path], mesh,
                                                    layout.axes, state.step)
                           for leaf in trainable})

    overflow = None
    if cfg.skips_overflow:
        overflow = _overflow(logical_grads, grad_norm)
        # An overflow skips the update: parameters and optimizer state stay bit-identical.
        new_params, new_opt_state = jax.tree.map(
            lambda new, old: jnp.where(overflow, old, new),
            (new_params, new_opt_state), (state.params, state.opt_state))
    new_state, metrics = _next_state(layout, state, new_params, new_opt_state, overflow, loss,
                                     grad_norm, model_state)
    return offloaded(layout, new_state), metrics


def _overflow(logical_grads: dict[str, jax.Array], grad_norm: jax.Array) -> jax.Array:
    """Whether a gradient is not finite (the step is then skipped)."""
    nonfinite = sum(jnp.sum(~jnp.isfinite(g)) for g in logical_grads.values())
    return (nonfinite > 0) | ~jnp.isfinite(grad_norm)


def _host_applied(layout: ZeroLayout, state: TrainState, loss: jax.Array,
                  logical_grads: dict[str, jax.Array], grad_norm: jax.Array,
                  model_state: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    """`apply_gradients` with the update in host memory: the overflow flag is computed first,
    so that the skip runs inside the host update beside the host-held values."""
    overflow = (_overflow(logical_grads, grad_norm) if layout.config.skips_overflow
                else None)
    with jax.named_scope(PARAM_UPDATE):     # its all-gathers are the update's, as on the device
        new_params, new_opt_state = host_update(layout, state, logical_grads, overflow)
    return _next_state(layout, state, new_params, new_opt_state, overflow, loss, grad_norm,
                       model_state)


def _next_state(layout: ZeroLayout, state: TrainState, params: dict[str, Any], opt_state: Any,
                overflow: jax.Array | None, loss: jax.Array, grad_norm: jax.Array,
                model_state: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    """The state after an update (its skip, on overflow, already applied) and the step's
    metrics: `overflow` when the step checks for it (`ZeroConfig.skips_overflow`); under fp16
    the loss scale moves, as DeepSpeed's does."""
    metrics: dict[str, Any] = {"loss": loss, "grad_norm": grad_norm}
    loss_scale = state.loss_scale
    if overflow is not None:
        metrics.update(overflow=overflow)
    if layout.config.uses_loss_scaling:
        loss_scale = update_loss_scale(state.loss_scale, overflow, layout.config)
        metrics.update(loss_scale=state.loss_scale.scale)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         loss_scale=loss_scale, model_state=model_state), metrics
