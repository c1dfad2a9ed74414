"""The update half of the step: on global arrays, outside the `shard_map`.

    reduced gradients (stored layout, times the loss scale)
      -> logical gradients / scale -> global norm -> DeepSpeed's clipping
      -> the optax transformation on the logical trainable parameters (`ShardedOptimizer`)
      -> each updated leaf back in its stored layout (`engine.update.stored_update`)
      -> fp16: an overflow keeps parameters and optimizer state bit-identical, the scale moves
    ZeRO-Offload: optimizer state and masters moved in from host memory before, out after

A pure function of the layout, the state and the gradient pass's outputs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from zeroxla.collectives.zero import PARAM_UPDATE
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.loss_scale import update_loss_scale
from zeroxla.engine.offload import offloaded, resident
from zeroxla.engine.state import TrainState
from zeroxla.engine.update import logical_gradient, optimizer_input, stored_update


def apply_gradients(layout: ZeroLayout, state: TrainState, loss: jax.Array,
                    grads: dict[str, jax.Array], model_state: dict[str, jax.Array],
                    scale: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    """The next state and the step's metrics (loss, grad_norm; fp16: loss_scale, overflow).
    With ZeRO-Offload the optimizer state and masters come in from host memory for the update
    and go back after it (`engine.offload`)."""
    cfg, mesh, trainable = layout.config, layout.mesh, layout.plan.trainable_leaves
    logical_grads = {leaf.path: logical_gradient(leaf, grads[leaf.path] / scale,
                                                 cfg.stage, mesh) for leaf in trainable}
    grad_norm = optax.tree.norm(logical_grads)
    if cfg.gradient_clipping > 0:
        # DeepSpeed's clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied when < 1.
        coef = jnp.minimum(cfg.gradient_clipping / (grad_norm + 1e-6), 1.0)
        logical_grads = jax.tree.map(lambda g: g * coef, logical_grads)

    # ZeRO-Offload: the optimizer state and masters come onto the device for the update.
    state = resident(layout, state)
    with jax.named_scope(PARAM_UPDATE):
        params = {leaf.path: optimizer_input(leaf, state.params[leaf.path], mesh)
                  for leaf in trainable}
        new_logical, new_opt_state = layout.sharded_optimizer.update(
            logical_grads, state.opt_state, params)
        new_params = dict(state.params)
        new_params.update({leaf.path: stored_update(leaf, new_logical[leaf.path], mesh,
                                                    layout.axes) for leaf in trainable})

    metrics: dict[str, Any] = {"loss": loss, "grad_norm": grad_norm}
    loss_scale = state.loss_scale
    if cfg.uses_loss_scaling:
        nonfinite = sum(jnp.sum(~jnp.isfinite(g)) for g in logical_grads.values())
        overflow = (nonfinite > 0) | ~jnp.isfinite(grad_norm)
        # An overflow skips the update: parameters and optimizer state stay bit-identical.
        new_params, new_opt_state = jax.tree.map(
            lambda new, old: jnp.where(overflow, old, new),
            (new_params, new_opt_state), (state.params, state.opt_state))
        loss_scale = update_loss_scale(state.loss_scale, overflow, cfg)
        metrics.update(loss_scale=state.loss_scale.scale, overflow=overflow)
    new_state = state.replace(step=state.step + 1, params=new_params,
                              opt_state=new_opt_state, loss_scale=loss_scale,
                              model_state=model_state)
    return offloaded(layout, new_state), metrics
