"""DeepSpeed's `optimizer` section as an optax transformation.

`build_optimizer(name, params, learning_rate)` builds, from a checked section, the optax chain
whose updates match DeepSpeed's optimizer: FusedAdam (Adam/AdamW, decoupled or L2 weight decay),
FusedLion, and torch's SGD, Adagrad and RMSprop. `DEFAULT_LR` is each one's lr when the section
gives none. `optimizer_and_schedule` builds both from the checked `optimizer` and `scheduler`
sections, as DeepSpeed pairs them (the schedule drives the optimizer's lr).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zeroxla.deepspeed.lr_schedules import Schedule, build_schedule

# DeepSpeed's optimizer lr default (FusedAdam, FusedLion: 1e-3; torch Adagrad, RMSprop: 1e-2;
# torch SGD: 1e-3).
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "lion": 1e-3, "sgd": 1e-3, "adagrad": 1e-2,
              "rmsprop": 1e-2}


def _scale_by_rss_torch(initial_accumulator_value: float,
                        eps: float) -> optax.GradientTransformation:
    """torch Adagrad's scaling g / (sqrt(sum g^2) + eps); optax.scale_by_rss puts eps inside the
    square root."""

    def init(params):
        return optax.ScaleByRssState(sum_of_squares=jax.tree.map(
            lambda p: jnp.full_like(p, initial_accumulator_value), params))

    def update(updates, state, params=None):
        del params
        sums = jax.tree.map(lambda s, g: s + g * g, state.sum_of_squares, updates)
        updates = jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + eps), updates, sums)
        return updates, optax.ScaleByRssState(sum_of_squares=sums)

    return optax.GradientTransformation(init, update)


def build_optimizer(name: str, params: Mapping[str, Any],
                    learning_rate: float | Schedule) -> optax.GradientTransformation:
    """The optax transformation for DeepSpeed optimizer `name` with checked `params`."""
    b1, b2 = params.get("betas", (0.9, 0.999))
    wd = params.get("weight_decay", 0.0)
    if name in ("adam", "adamw"):
        # DeepSpeed: type "AdamW" forces decoupled decay; "Adam" has adam_w_mode=True by default
        # (FusedAdam), so plain "Adam" is AdamW unless adam_w_mode is false.
        decoupled = name == "adamw" or params.get("adam_w_mode", True)
        if "weight_decay" not in params and params.get("torch_adam", False) and decoupled:
            wd = 0.01               # torch.optim.AdamW's default; FusedAdam's is 0
        scale = optax.scale_by_adam(b1, b2, params.get("eps", 1e-8))
        if decoupled:     # w -= lr * (adam(g) + wd * w)
            return optax.chain(scale, optax.add_decayed_weights(wd),
                               optax.scale_by_learning_rate(learning_rate))
        # L2 mode: g += wd * w before the moments
        return optax.chain(optax.add_decayed_weights(wd), scale,
                           optax.scale_by_learning_rate(learning_rate))
    if name == "lion":
        # FusedLion defaults betas (0.9, 0.999) and decoupled weight decay, like optax.lion.
        return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=wd)
    if name == "sgd":
        momentum = params.get("momentum", 0.0)
        parts = [optax.add_decayed_weights(wd)]           # torch SGD: L2 added to the gradient
        if momentum:
            parts.append(optax.trace(momentum, nesterov=params.get("nesterov", False)))
        return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))
    if name == "adagrad":
        return optax.chain(optax.add_decayed_weights(wd),
                           _scale_by_rss_torch(params.get("initial_accumulator_value", 0.0),
                                               params.get("eps", 1e-10)),
                           optax.scale_by_learning_rate(learning_rate))
    assert name == "rmsprop", name
    momentum = params.get("momentum", 0.0)
    return optax.chain(optax.add_decayed_weights(wd),
                       optax.rmsprop(learning_rate, decay=params.get("alpha", 0.99),
                                     eps=params.get("eps", 1e-8), eps_in_sqrt=False,
                                     centered=params.get("centered", False),
                                     momentum=momentum or None))


def optimizer_and_schedule(optimizer: str | None, optimizer_params: Mapping[str, Any],
                           scheduler: str | None, scheduler_params: Mapping[str, Any]
                           ) -> tuple[optax.GradientTransformation | None,
                                      float | Schedule | None]:
    """(the optax optimizer, the learning rate) of checked `optimizer` / `scheduler` sections
    (their canonical type names, None without the section, and params).

    The learning rate is the scheduler's schedule built on the optimizer's lr (`params.lr`, else
    its type's default), or that lr alone without a scheduler; None without either section.
    """
    base_lr = (optimizer_params.get("lr", DEFAULT_LR[optimizer]) if optimizer is not None
               else None)
    learning_rate: float | Schedule | None = base_lr
    if scheduler is not None:
        # Without an optimizer section DeepSpeed schedules the client's optimizer; its lr is
        # unknown here, so WarmupLR/WarmupCosineLR use FusedAdam's default 1e-3.
        learning_rate = build_schedule(scheduler, scheduler_params,
                                       DEFAULT_LR["adam"] if base_lr is None else base_lr)
    built = (build_optimizer(optimizer, optimizer_params, learning_rate)
             if optimizer is not None else None)
    return built, learning_rate


__all__ = ["DEFAULT_LR", "build_optimizer", "optimizer_and_schedule"]
