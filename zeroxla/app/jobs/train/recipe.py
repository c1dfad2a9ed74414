"""The training recipe of a job: its config tree built into what the step takes.

`build_setup(job) -> TrainingSetup`: the ZeroConfig (`TrainJobConfig.zero_config()`), the optax
optimizer and the learning-rate schedule. Without a --config optimizer or scheduler section the
default recipe runs (tuned so the default job, gpt-tiny on tiny-shakespeare, finishes in a few
minutes on two CPU cores): AdamW, a linear warmup and a cosine decay. A JSON's sections replace
its optimizer and its schedule, built by `zeroxla.deepspeed` exactly as DeepSpeed's. Every value
comes from the tree; nothing is decided here. No device is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

from zeroxla.app.jobs.train.config import TrainJobConfig
from zeroxla.deepspeed.optimizers import optimizer_and_schedule
from zeroxla.sharding.config import ZeroConfig

DEFAULT_RECIPE = "defaults (AdamW, warmup + cosine)"


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """What the job's tree builds for the step."""

    zero: ZeroConfig
    optimizer: optax.GradientTransformation
    learning_rate: Callable[[Any], Any]        # optax count -> lr (for logging)
    source: str                                # where the recipe came from, for the summary


def _default_schedule(job: TrainJobConfig) -> Callable[[Any], Any]:
    """Linear warmup from 0 to lr over warmup_steps, then cosine to lr * min_lr_ratio."""
    schedule = job.schedule
    warmup = min(schedule.warmup_steps, schedule.steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=schedule.lr, warmup_steps=warmup,
        decay_steps=max(schedule.steps, warmup + 1),
        end_value=schedule.lr * schedule.min_lr_ratio)


def _default_optimizer(job: TrainJobConfig,
                       schedule: Callable[[Any], Any]) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=job.schedule.weight_decay)


def build_setup(job: TrainJobConfig) -> TrainingSetup:
    """The ZeRO config, optimizer and schedule of `job` (no devices used)."""
    optimizer_section, scheduler_section = job.schedule.optimizer, job.schedule.scheduler
    optimizer, schedule = optimizer_and_schedule(
        None if optimizer_section is None else optimizer_section.type,
        {} if optimizer_section is None else optimizer_section.params,
        None if scheduler_section is None else scheduler_section.type,
        {} if scheduler_section is None else scheduler_section.params)
    if schedule is None:
        schedule = _default_schedule(job)
    elif not callable(schedule):
        schedule = optax.constant_schedule(schedule)
    if optimizer is None:
        optimizer = _default_optimizer(job, schedule)
    return TrainingSetup(zero=job.zero_config(), optimizer=optimizer, learning_rate=schedule,
                         source=job.deepspeed_config or DEFAULT_RECIPE)


__all__ = ["DEFAULT_RECIPE", "TrainingSetup", "build_setup"]
