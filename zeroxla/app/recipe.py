"""The training recipe of a job: ZeRO config, optimizer, learning-rate schedule, global batch.

`resolve_setup(job) -> TrainingSetup`. Where each setting comes from: an explicit job field wins;
a DeepSpeed JSON (`job.deepspeed_config`) gives the batch sizes, ZeRO config, precision,
optimizer and schedule; otherwise the defaults (tuned so the default job, gpt-tiny on
tiny-shakespeare, finishes in a few minutes on two CPU cores). A job checks every step for a
non-finite gradient and skips its update (`ZeroConfig.check_grad_overflow`; a JSON may turn it
off with `bf16.check_grad_overflow: false`), so a diverging run stops with its last finite
state intact to save (`zeroxla.app.train`). With a JSON, the job's options
that are DeepSpeed settings go to the loader as typed overrides
(`train_options.deepspeed_overrides`), applied while the JSON is read once; a field set both
explicitly and in the JSON to different values is an error naming both, not a silent override.
No device is used.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import optax

from zeroxla.app.job import DEFAULT_BATCH_SIZE, DEFAULT_LR, DTYPES, TrainJobConfig
from zeroxla.app.cli_args import check_batch
from zeroxla.app.train_options import deepspeed_overrides
from zeroxla.deepspeed import config as ds_config
from zeroxla.sharding.config import ZeroConfig


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """The resolved training recipe: what the job config and the DeepSpeed JSON add up to."""

    zero: ZeroConfig
    optimizer: optax.GradientTransformation
    learning_rate: Callable[[Any], Any]        # optax count -> lr (for logging)
    batch_size: int
    source: str                                # where the recipe came from, for the summary


def _default_schedule(job: TrainJobConfig, peak: float) -> Callable[[Any], Any]:
    """Linear warmup from 0 to `peak` over warmup_steps, then cosine to peak * min_lr_ratio."""
    warmup = min(job.warmup_steps, job.steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(job.steps, warmup + 1), end_value=peak * job.min_lr_ratio)


def _default_optimizer(job: TrainJobConfig,
                       schedule: Callable[[Any], Any]) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=job.weight_decay)


def resolve_setup(job: TrainJobConfig) -> TrainingSetup:
    """The ZeRO config, optimizer, schedule and global batch size for `job` (no devices used)."""
    dp = job.data_parallel_size
    if job.deepspeed_config is None:
        batch = DEFAULT_BATCH_SIZE if job.batch_size is None else job.batch_size
        accum = 1 if job.grad_accum is None else job.grad_accum
        check_batch(batch, "--batch-size", job.mesh, accum)
        schedule = _default_schedule(job, DEFAULT_LR if job.lr is None else job.lr)
        zero = ZeroConfig(
            stage=3 if job.zero_stage is None else job.zero_stage,
            persistence_threshold=job.persistence_threshold or 0,
            compute_dtype=DTYPES[job.dtype or "fp32"],
            gradient_clipping=job.gradient_clipping, gradient_accumulation_steps=accum,
            offload_optimizer=job.offload_optimizer or "none",
            offload_param=job.offload_param or "none", check_grad_overflow=True)
        return TrainingSetup(zero=zero,
                             optimizer=_default_optimizer(job, schedule), learning_rate=schedule,
                             batch_size=batch, source="defaults (AdamW, warmup + cosine)")
    path = job.deepspeed_config
    ds = ds_config.load_deepspeed_config(path, data_parallel_size=dp, mesh_local_size=job.mesh[1],
                                         overrides=deepspeed_overrides(job),
                                         default_train_batch_size=DEFAULT_BATCH_SIZE)
    if ds.hybrid_engine is not None:
        warnings.warn(f"{path}: the hybrid_engine section configures zeroxla.HybridEngine (RLHF "
                      "generation); zeroxla train's end-of-run sample does not read it",
                      ds_config.DeepSpeedConfigWarning, stacklevel=2)
    if job.lr is not None and (ds.optimizer_name is not None or ds.scheduler_name is not None):
        raise ValueError(f"--lr {job.lr} conflicts with the optimizer/scheduler sections of "
                         f"{path}, which set the learning rate; give one")
    schedule = ds.learning_rate
    if schedule is None:
        schedule = _default_schedule(job, DEFAULT_LR if job.lr is None else job.lr)
    elif not callable(schedule):
        schedule = optax.constant_schedule(schedule)
    optimizer = ds.optimizer if ds.optimizer is not None else _default_optimizer(job, schedule)
    zero = ds.zero
    if not {"bf16.check_grad_overflow", "bfloat16.check_grad_overflow"} & ds.given:
        zero = dataclasses.replace(zero, check_grad_overflow=True)     # the job's default
    return TrainingSetup(zero=zero, optimizer=optimizer, learning_rate=schedule,
                         batch_size=ds.train_batch_size, source=path)


__all__ = ["TrainingSetup", "resolve_setup"]
