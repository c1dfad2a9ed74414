"""`zeroxla train` as the runner drives it: one optimizer step a unit on the job's data.

    summary = job.run(resolve_job({"steps": 100, "zero_stage": 2}))      # a TrainSummary

`TrainJob(tree)` sets everything up that can fail on a bad option or bad data (the recipe, the
data with the resumed run's own tokenizer, the model, the mesh and the step; the initial state
unless `--resume` restores one) before the runner makes any directory
(`zeroxla.app.run.runner`: checkpoints, metrics.jsonl, signals, divergence, resume). Each step
records its loss, gradient norm, learning rate and speed; every `--eval-every` steps and at the
end the held-out batches add `val_loss`. The end reports the final losses, speed, per-device
memory from the compiled step, the loss curve and a sample (`zeroxla.app.jobs.train.report`).

In a multi-process run (`zeroxla launch`) every process runs this; each builds only its own
devices' rows of every batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np

import zeroxla
from zeroxla.engine.router_aux import router_record
from zeroxla.app import distributed
from zeroxla.app.run import rundir
from zeroxla.app.run import runner
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.app.jobs.train.config import TrainJobConfig
from zeroxla.app.jobs.train.data import load_train_data
from zeroxla.app.jobs.train.model import initial_state, model_config
from zeroxla.app.jobs.train.prepare import describe_run, make_train_step, recorded_tokenizer
from zeroxla.app.jobs.train.recipe import build_setup
from zeroxla.app.jobs.train.report import (TrainSummary, check_sample, final_sample, run_settings,
                                           write_plot)
from zeroxla.app.jobs.train.resume import RECORD_KEY, job_record
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata

LEGACY_POSITION = "data_position"      # where an older zeroxla's checkpoint recorded its step


class TrainJob:
    """`zeroxla train`'s algorithm (`zeroxla.app.run.job.Job`)."""

    NAME: ClassVar[str] = "train"
    UNIT: ClassVar[str] = "step"
    COUNTER: ClassVar[tuple[str, int]] = ("step", 0)
    EXPORT_DIR: ClassVar[None] = None
    PARTS: ClassVar[tuple[None]] = (None,)
    DATA: ClassVar[dict[str, str]] = {"--data": "data.path"}
    EVALUATE_FIRST: ClassVar[bool] = False

    def __init__(self, config: TrainJobConfig, write: Callable[[str], None] | None = None):
        self.config, self.write = config, write or runner.default_write()
        resume = rundir.locate_resume(config.run.resume) if config.run.resume else None
        self.setup = build_setup(config)
        self.data = load_train_data(
            config.data.path, split=config.data.split, tokenizer=config.data.tokenizer,
            init_from=config.model.init_from,
            batch_size=config.schedule.batch_size, seq_len=config.data.seq_len,
            val_fraction=config.data.val_fraction, seed=config.run.seed,
            recorded=recorded_tokenizer(resume), packing=config.data.packing)
        self.tokenizer = self.data.tokenizer
        model = model_config(config, self.data)
        self.mesh = distributed.job_mesh(config.sharding.mesh, config.pipeline.stages,
                                         config.sharding.sequence_parallel_size,
                                         config.sharding.expert_parallel_size)
        self.step = make_train_step(config, self.setup, model, self.mesh)
        check_sample(self.step, config)          # the closing sample's refusals, before training
        self.val_batches = self.data.eval_batches("val", config.run.eval_batches,
                                                  self.step.layout.batch_sharding)
        # A resumed run's state comes from its checkpoint (the runner restores it).
        self.state = (None if resume else
                      initial_state(config, self.step, model, self.mesh))
        self.settings = run_settings(config, self.setup, self.data)
        self.step_times: list[float] = []
        self.first = 0
        self.summary: TrainSummary | None = None

    @property
    def label(self) -> str:
        return Path(self.config.model_name).name

    @property
    def total(self) -> int:
        return self.config.schedule.steps

    @property
    def tokens_per_step(self) -> int:
        return self.config.schedule.batch_size * self.config.data.seq_len

    def parts(self) -> dict[None, "TrainJob"]:
        return {None: self}

    def describe(self, first: int) -> str:
        self.first = first
        return describe_run(self.config, self.setup, self.data, self.mesh, self.settings)

    def advance(self, done: int) -> dict[str, float]:
        batch = self.data.train_batch(done, self.step.layout.batch_sharding)
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        values = {name: float(v) for name, v in metrics.items()      # waits for the step
                  if np.ndim(v) == 0} | router_record(metrics)      # an MoE's per-expert load
        seconds = time.perf_counter() - start
        self.step_times.append(seconds)
        return {**values, "lr": float(self.setup.learning_rate(done)),
                "tokens": self.tokens_per_step, "step_time_s": seconds,
                "tokens_per_s": self.tokens_per_step / seconds}

    def _mean_loss(self, batches: list[dict]) -> float:
        return float(np.mean([float(self.step.eval_loss(self.state, b)) for b in batches]))

    def evaluate(self) -> dict[str, float]:
        return {"val_loss": self._mean_loss(self.val_batches)}

    def say(self, record: dict[str, Any]) -> str:
        return (f"step {record['step']:>6}: train loss {record['loss']:.4f}  validation loss "
                f"{record['val_loss']:.4f}")

    def checkpoint_metadata(self, out: Path, part: None) -> dict[str, Any]:
        config = self.config
        return {"seed": config.run.seed, "model": config.model_name,
                RECORD_KEY: job_record(config), "settings": self._settings(out),
                "tokenizer": tokenizer_record(self.tokenizer),
                LORA_KEY: as_metadata(config.lora.config())}

    def checkpoint_model_config(self, part: None) -> None:
        return None

    def restored(self, metadata: dict[str, Any]) -> int | None:
        """An older zeroxla's checkpoint recorded its step as the data position."""
        return metadata.get(LEGACY_POSITION)

    def plot_title(self) -> str:
        """loss_curve.png's title: model, data, ZeRO stage, mesh and batch."""
        c = self.config
        nodes, local = c.sharding.mesh
        return (f"{c.model_name} on {self.data.source}: ZeRO-{self.setup.zero.stage}, mesh "
                f"{nodes}x{local}, batch {c.schedule.batch_size}x{c.data.seq_len}")

    def draw(self, out: Path, records: list[dict[str, Any]]) -> None:
        write_plot(out / rundir.PLOT_FILE, records, self.plot_title())

    def finish(self, out: Path, records: list[dict[str, Any]],
               before: dict[str, float]) -> dict[str, Any]:
        """Final losses, speed and memory, the sample; summary.json's keys (the TrainSummary
        and the settings)."""
        del before
        config, step, state = self.config, self.step, self.state
        train_loss = self._mean_loss(self.data.eval_batches(
            "train", config.run.eval_batches, step.layout.batch_sharding))
        # The median step after the first (compiling) one: robust to a recompile or a busy host.
        times = self.step_times or [float("nan")]
        step_time = float(np.median(times[1:] or times))
        report = zeroxla.memory_report(step.compile(state, self.val_batches[0]), state,
                                       layout=step.layout)
        samples = final_sample(step, state, self.data, self.data.sample_prompt(), config,
                               self.write)
        done = int(jax.device_get(state.step))
        self.summary = TrainSummary(
            steps=config.schedule.steps,
            tokens_seen=sum(r.get("tokens", self.tokens_per_step) for r in records
                            if "loss" in r),
            final_train_loss=train_loss, final_val_loss=records[-1]["val_loss"],
            tokens_per_s=self.tokens_per_step / step_time, step_time_s=step_time,
            compile_time_s=times[0], wall_time_s=0.0,
            memory={k: int(v) for k, v in report.to_dict().items()
                    if isinstance(v, (int, float))},
            memory_table=report.table(), parameters=runner.parameter_counts(step.layout),
            samples=samples,
            paths={"run_dir": str(out), "metrics": str(out / rundir.METRICS_FILE),
                   "loss_curve": str(out / rundir.PLOT_FILE),
                   "summary": str(out / rundir.SUMMARY_FILE),
                   "checkpoint": str(out / rundir.CHECKPOINT_DIR / str(done))},
            resumed_from_step=self.first)
        return {"settings": self._settings(out), **self.summary.to_dict()}

    def _settings(self, out: Path) -> dict[str, Any]:
        """Every value the run uses, by the options' names, the run directory included."""
        return {**self.settings, "out_dir": str(out)}


def run(config: TrainJobConfig, *, write: Callable[[str], None] | None = None) -> TrainSummary:
    """Trains as `config` says (`--resume` included) and returns the TrainSummary; raises the
    runner's `RunInterrupted` after a stop signal and `RunDiverged` on a non-finite loss."""
    write = write or runner.default_write()
    job = TrainJob(config, write)
    resume = rundir.locate_resume(config.run.resume) if config.run.resume else None
    summary = runner.run(job, resume=resume, write=write)
    return TrainSummary(**{**job.summary.to_dict(), "wall_time_s": summary["wall_time_s"]})


__all__ = ["LEGACY_POSITION", "TrainJob", "run"]
