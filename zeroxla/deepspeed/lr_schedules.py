"""DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py) as optax schedules.

WarmupLR, WarmupDecayLR, WarmupCosineLR and LRRangeTest are written here with DeepSpeed's formulas
as functions of its `last_batch_iteration` (jnp, so they trace inside the compiled step);
`build_schedule(name, params, base_lr)` turns a checked `scheduler` section into the optax
schedule that reproduces DeepSpeed's lr step for step.

The step counter. DeepSpeed's engine calls `optimizer.step()` and then `lr_scheduler.step()`, and
the scheduler's constructor already set the lr for `last_batch_iteration = -1`. So the n-th update
(optax `count = n`, from 0) runs with the lr DeepSpeed's `get_lr()` returns at
`last_batch_iteration = n - 1`; the schedules built here are exactly `count -> ds_lr(count - 1)`,
so the first update uses `warmup_min_lr` (WarmupLR, WarmupDecayLR) or 0 (WarmupCosineLR), as in
DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

Schedule = Callable[[Any], Any]

# Each schedule's constructor defaults in DeepSpeed, by scheduler type.
DEFAULTS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                      "warmup_type": "log"},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log"},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
                    "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False},
}


def _warmup_gamma(it, warmup_num_steps: int, warmup_type: str):
    """WarmupLR._get_gamma during warmup; `warmup_num_steps` already max(2, n)."""
    if warmup_type == "log":
        return jnp.log(jnp.maximum(it, 0.0) + 1.0) / math.log(warmup_num_steps)
    return it / warmup_num_steps


def warmup_lr(*, warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int,
              warmup_type: str, total_num_steps: int | None = None) -> Schedule:
    """DeepSpeed's WarmupLR (or WarmupDecayLR when `total_num_steps` is given) as a function of
    `last_batch_iteration`: min + (max - min) * gamma, gamma the log/linear warmup, then 1
    (WarmupLR) or max(0, (total - it) / max(1, total - warmup)) (WarmupDecayLR)."""
    n = max(2, warmup_num_steps)
    delta = warmup_max_lr - warmup_min_lr

    def lr(it):
        it = jnp.asarray(it, jnp.float32)
        if total_num_steps is None:
            after = jnp.float32(1.0)
        else:
            after = jnp.maximum(0.0, (total_num_steps - it) / max(1.0, total_num_steps - n))
        gamma = jnp.where(it < n, _warmup_gamma(it, n, warmup_type), after)
        return jnp.where(it < 0, warmup_min_lr, warmup_min_lr + delta * gamma)

    return lr


def warmup_cosine_lr(*, base_lr: float, total_num_steps: int, warmup_min_ratio: float,
                     warmup_num_steps: int, cos_min_ratio: float, warmup_type: str) -> Schedule:
    """DeepSpeed's WarmupCosineLR as a function of `last_batch_iteration`: the optimizer's lr times
    a ratio that warms up from `warmup_min_ratio` to 1, then follows a cosine to `cos_min_ratio`
    (progress clamped to 1 after `total_num_steps`); 0 before the first step."""
    n = max(2, warmup_num_steps)
    real_total = max(1, total_num_steps - n)

    def lr(it):
        it = jnp.asarray(it, jnp.float32)
        warm = warmup_min_ratio + _warmup_gamma(it, n, warmup_type) * (1.0 - warmup_min_ratio)
        progress = jnp.minimum(1.0, (it - n + 1) / real_total)
        cosine = jnp.maximum(0.0, cos_min_ratio + (1.0 - cos_min_ratio)
                             * (1.0 + jnp.cos(jnp.pi * progress)) / 2.0)
        ratio = jnp.where(it < 0, 0.0, jnp.where(it < n, warm, cosine))
        return base_lr * ratio

    return lr


def lr_range_test(*, lr_range_test_min_lr: float, lr_range_test_step_size: int,
                  lr_range_test_step_rate: float, lr_range_test_staircase: bool) -> Schedule:
    """DeepSpeed's LRRangeTest: min_lr * (1 + rate * (it + 1) / step_size), floored if staircase."""

    def lr(it):
        interval = (jnp.asarray(it, jnp.float32) + 1.0) / lr_range_test_step_size
        if lr_range_test_staircase:
            interval = jnp.floor(interval)
        return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)

    return lr


def as_optax_schedule(ds_lr: Schedule) -> Schedule:
    """optax `count` (updates done) -> the lr DeepSpeed uses for that update: `ds_lr(count - 1)`
    (DeepSpeed steps the scheduler after the optimizer; see the module docstring)."""
    return lambda count: ds_lr(jnp.asarray(count, jnp.float32) - 1.0)


def build_schedule(name: str, params: Mapping[str, Any], base_lr: float) -> Schedule:
    """The optax schedule for DeepSpeed scheduler `name` (a key of `DEFAULTS`) with checked
    `params`; `base_lr` is the optimizer's lr, which WarmupLR and WarmupCosineLR start from."""
    p = {**DEFAULTS[name], **params}
    if name == "WarmupLR":
        # WarmupLR's warmup_max_lr defaults to the optimizer's lr; WarmupDecayLR's to 0.001.
        max_lr = base_lr if p["warmup_max_lr"] is None else p["warmup_max_lr"]
        ds_lr = warmup_lr(warmup_min_lr=p["warmup_min_lr"], warmup_max_lr=max_lr,
                          warmup_num_steps=p["warmup_num_steps"], warmup_type=p["warmup_type"])
    elif name == "WarmupDecayLR":
        ds_lr = warmup_lr(warmup_min_lr=p["warmup_min_lr"], warmup_max_lr=p["warmup_max_lr"],
                          warmup_num_steps=p["warmup_num_steps"], warmup_type=p["warmup_type"],
                          total_num_steps=p["total_num_steps"])
    elif name == "WarmupCosineLR":
        ds_lr = warmup_cosine_lr(base_lr=base_lr, **p)
    else:
        ds_lr = lr_range_test(**p)
    return as_optax_schedule(ds_lr)


__all__ = ["DEFAULTS", "Schedule", "as_optax_schedule", "build_schedule", "lr_range_test",
           "warmup_cosine_lr", "warmup_lr"]
