"""The training job behind `zeroxla train`: data -> mesh -> step -> loop -> report.

`run(TrainJobConfig(...)) -> TrainSummary` trains a `models/` preset, or a pretrained Hugging Face
checkpoint (`init_from`, loaded straight into its ZeRO partitions), on a text corpus or on
prompt/response pairs (`zeroxla.app.train_data`: the loss on the responses only) with
`zeroxla.make_step` on a `("node", "local")` mesh, shows a progress bar (step, loss, tokens/s, step
time), evaluates on the held-out split every `eval_every` steps, and writes to its run directory
(`zeroxla.app.rundir`; a fresh `runs/<model>-<time>` unless `out_dir` says otherwise):

    metrics.jsonl     one JSON object per step ({"step", "loss", "grad_norm", "lr", ...}) and per
                      evaluation ({"step", "val_loss"}); a resumed run appends to it
    loss_curve.png    train and validation loss against step, the whole run
    summary.json      "settings" (every value the run used) and the TrainSummary
    checkpoint/<n>/   every `save_every` steps and at the end (the newest `keep_last` kept), and
                      at Ctrl-C; each records the job, so `--resume` continues it as it was

The recipe (ZeRO config, optimizer, schedule, batch) comes from `zeroxla.app.recipe`; setting up
(everything before the run directory is made) is `zeroxla.app.train_setup`, and the settings, loss
curve, sample and summary are `zeroxla.app.train_report`.

In a multi-process run (`zeroxla launch`, `zeroxla.app.distributed`) every process runs this same
function: each builds only its own devices' rows of every batch, all take part in every step,
evaluation and checkpoint, and process 0 alone writes metrics, plot and summary.

The run directory is created only once the job has been set up (options, data, model, restore),
so a job that fails to start leaves no directory behind; one that fails before its first step
removes the directory it created.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import zeroxla
from zeroxla import checkpoint
from zeroxla.app import distributed, rundir
from zeroxla.app.interrupt import stop_requests
from zeroxla.app.job import DEFAULT_BATCH_SIZE, DEFAULT_LR, TrainJobConfig, job_record
from zeroxla.app.recipe import TrainingSetup, resolve_setup
from zeroxla.app.tokenizer_records import tokenizer_record
from zeroxla.app.train_report import (TrainSummary, final_sample, format_summary, run_settings,
                                      write_plot as _write_plot, write_summary)
from zeroxla.app.train_setup import TrainRun, set_up
from zeroxla.checkpoint.retention import prune_checkpoints


class TrainingInterrupted(Exception):
    """Ctrl-C stopped the run between steps; a checkpoint of `step` was saved at `checkpoint`."""

    def __init__(self, step: int, checkpoint_path: Path, run_dir: Path):
        super().__init__(f"interrupted after step {step}; saved checkpoint {checkpoint_path}")
        self.step, self.checkpoint_path, self.run_dir = step, checkpoint_path, run_dir


# ------------------------------------------------------------------------------------------------
# Helpers.


def save_checkpoint(step: Any, state: Any, directory: Path, *, metadata: dict) -> Path:
    """Writes the TrainState as checkpoint `state.step` under `directory` (orbax, sharded;
    restorable onto any mesh with `zeroxla.restore` or `zeroxla train --resume`); returns the
    step's path. Every process must call it."""
    return checkpoint.save(directory, state, step=step, metadata=metadata)


def _mean_loss(step: Any, state: Any, batches: list[dict]) -> float:
    """The mean loss of `state` on `batches`, without training."""
    return float(np.mean([float(step.eval_loss(state, b)) for b in batches]))


# ------------------------------------------------------------------------------------------------
# The run directory.


def _create_out_dir(out: Path, fresh: bool) -> Path | None:
    """Creates `out` (process 0 only); returns the outermost directory this created, if any."""
    if jax.process_index() != 0:
        return None
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    if fresh and out.exists():
        raise rundir.RunDirError(f"run directory {out} was created by another run meanwhile; "
                                 "start again (a new name is chosen)")
    out.mkdir(parents=True, exist_ok=True)
    return created


def _earlier_records(resume: rundir.ResumePoint | None, first_step: int) -> list[dict]:
    """The resumed run's metrics up to its checkpoint (later ones are redone, so dropped)."""
    if resume is None or resume.run_dir is None:
        return []
    return [r for r in rundir.read_metrics(resume.run_dir / rundir.METRICS_FILE)
            if r["step"] <= first_step]


# ------------------------------------------------------------------------------------------------
# The loop.


def _saver(r: TrainRun) -> Callable[[Any, int], Path]:
    """`save(state, done)`: checkpoint `done` in the run directory, recording the job (so
    `--resume` continues it as it was) and the data position; the newest `keep_last` are kept."""
    job, checkpoint_dir = r.job, r.out / rundir.CHECKPOINT_DIR
    primary = jax.process_index() == 0
    metadata = {"seed": job.seed, "model": job.model_name, "job": job_record(job),
                "settings": r.settings, "tokenizer": tokenizer_record(r.data.tokenizer)}

    def save(state: Any, done: int) -> Path:
        path = save_checkpoint(r.step, state, checkpoint_dir,
                               metadata={**metadata, "data_position": done})
        if job.keep_last and primary:
            prune_checkpoints(checkpoint_dir, job.keep_last)
        return path

    return save


@dataclasses.dataclass
class _Progress:
    """Where the loop stands, updated as it goes (so `run` can read it after a stop or an
    error)."""

    done: int                       # steps trained, resumed ones included
    records: list[dict]             # metrics.jsonl's records, the resumed run's included
    saved_at: int | None = None     # the step of the newest checkpoint in the run directory
    saved_path: Path | None = None
    val_loss: float = float("nan")
    step_times: list[float] = dataclasses.field(default_factory=list)
    stopped: bool = False           # at Ctrl-C


def _step(r: TrainRun, state: Any, k: int, progress: _Progress) -> tuple[Any, dict]:
    """Trains step `k + 1` on its batch; returns the new state and the step's metrics record
    (also added to `progress`). A non-finite loss ends the run."""
    batch_k = r.data.train_batch(k, r.step.batch_sharding)
    t0 = time.perf_counter()
    state, metrics = r.step(state, batch_k)
    values = {name: float(v) for name, v in metrics.items()}   # waits for the step
    dt = time.perf_counter() - t0
    progress.step_times.append(dt)
    if not math.isfinite(values["loss"]):
        raise FloatingPointError(f"step {k + 1}: loss is {values['loss']}; lower --lr "
                                 "or enable gradient clipping in --config")
    progress.done = k + 1
    record = {"step": progress.done, **values, "lr": float(r.setup.learning_rate(k)),
              "tokens": r.tokens_per_step, "step_time_s": dt,
              "tokens_per_s": r.tokens_per_step / dt}
    progress.records.append(record)
    return state, record


def _train(r: TrainRun, state: Any, progress: _Progress, save: Callable[[Any, int], Path],
           write: Callable[[str], None]) -> Any:
    """Trains from `progress.done` to `--steps` (or to a Ctrl-C), appending to metrics.jsonl,
    evaluating every `eval_every` steps and saving every `save_every`; returns the state."""
    from tqdm import tqdm

    job = r.job
    primary = jax.process_index() == 0
    multi = jax.process_count() > 1
    # Processes other than 0 write their metrics nowhere.
    metrics_target = r.out / rundir.METRICS_FILE if primary else os.devnull
    with open(metrics_target, "a", encoding="utf-8") as metrics_file, \
            tqdm(total=job.steps, initial=r.first_step, desc="train", unit="step",
                 disable=not (job.progress and primary), dynamic_ncols=True,
                 mininterval=0.5) as bar, \
            stop_requests() as ctrl_c:
        for k in range(r.first_step, job.steps):
            # Every process must stop at the same step (the save is collective).
            if distributed.any_process(ctrl_c.requested) if multi else ctrl_c.requested:
                progress.stopped = True
                break
            state, record = _step(r, state, k, progress)
            metrics_file.write(json.dumps(record) + "\n")
            bar.set_postfix_str(f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} "
                                f"tok/s  {record['step_time_s'] * 1e3:.0f} ms/step",
                                refresh=False)
            bar.update(1)
            done = progress.done
            if done % job.eval_every == 0 or done == job.steps:
                progress.val_loss = _mean_loss(r.step, state, r.val_batches)
                val_record = {"step": done, "val_loss": progress.val_loss}
                progress.records.append(val_record)
                metrics_file.write(json.dumps(val_record) + "\n")
                write(f"step {done:>6}: train loss {record['loss']:.4f}  "
                      f"validation loss {progress.val_loss:.4f}")
            metrics_file.flush()
            if job.save_every and done % job.save_every == 0 and done < job.steps:
                progress.saved_at, progress.saved_path = done, save(state, done)
                write(f"step {done:>6}: saved checkpoint {progress.saved_path}")
    return state


# ------------------------------------------------------------------------------------------------
# The end: at Ctrl-C, or the report.


def _interrupted(r: TrainRun, state: Any, progress: _Progress,
                 save: Callable[[Any, int], Path]) -> TrainingInterrupted:
    """After Ctrl-C: saves the current step (unless just saved), draws the loss curve and
    returns the exception that says where the checkpoint is."""
    if progress.saved_at != progress.done:
        progress.saved_path = save(state, progress.done)
    if jax.process_index() == 0:
        _write_plot(r.out / rundir.PLOT_FILE, progress.records, r.plot_title)
    return TrainingInterrupted(progress.done, progress.saved_path, r.out)


def _report(r: TrainRun, state: Any, progress: _Progress, save: Callable[[Any, int], Path],
            start: float, write: Callable[[str], None]) -> TrainSummary:
    """The end of a finished run: final losses, speed and memory, the loss curve, the final
    checkpoint (unless just saved), the sample and summary.json; returns the summary."""
    job, step, out = r.job, r.step, r.out
    primary = jax.process_index() == 0
    train_loss = _mean_loss(step, state,
                            r.data.eval_batches("train", job.eval_batches, step.batch_sharding))
    # The median step after the first (compiling) one: robust to a recompile or a busy host.
    step_times = progress.step_times
    step_time = float(np.median(step_times[1:] or step_times))
    report = zeroxla.memory_report(step, state, r.val_batches[0])
    plot_path = out / rundir.PLOT_FILE
    if primary:
        _write_plot(plot_path, progress.records, r.plot_title)
    checkpoint_path = (save(state, job.steps) if progress.saved_at != job.steps
                       else progress.saved_path)

    samples = final_sample(step, state, r.data, r.data.sample_prompt(), job, write)

    summary_path = out / rundir.SUMMARY_FILE
    tokens_per_step = r.tokens_per_step
    summary = TrainSummary(
        steps=job.steps,
        tokens_seen=sum(rec.get("tokens", tokens_per_step) for rec in progress.records
                        if "loss" in rec),
        final_train_loss=train_loss, final_val_loss=progress.val_loss,
        tokens_per_s=tokens_per_step / step_time, step_time_s=step_time,
        compile_time_s=step_times[0], wall_time_s=time.perf_counter() - start,
        memory={k: int(v) for k, v in report.to_dict().items() if isinstance(v, (int, float))},
        memory_table=report.table(),
        samples=samples,
        paths={"run_dir": str(out), "metrics": str(out / rundir.METRICS_FILE),
               "loss_curve": str(plot_path), "summary": str(summary_path),
               "checkpoint": str(checkpoint_path)},
        resumed_from_step=r.first_step)
    if primary:
        write_summary(summary_path, r.settings, summary)
    return summary


# ------------------------------------------------------------------------------------------------
# The job.


def run(job: TrainJobConfig, *, write: Callable[[str], None] | None = None) -> TrainSummary:
    """Trains as `job` says and returns the summary (see the module docstring for the outputs).

    `write` prints a line without breaking the progress bar (default: tqdm.write to stdout); in
    a multi-process run only process 0 writes. Raises `TrainingInterrupted` after Ctrl-C, once
    the checkpoint of the current step is saved.
    """
    from tqdm import tqdm

    start = time.perf_counter()
    primary = jax.process_index() == 0
    write = (write or (lambda line: tqdm.write(line))) if primary else (lambda line: None)

    # 1. Set up: everything that can fail on a bad option or bad data, before any file is made.
    r, state = set_up(job, write)

    # 2. The run directory; a run that fails before its first step takes it away again.
    created = _create_out_dir(r.out, r.fresh)
    records = _earlier_records(r.resume, r.first_step)
    if primary:
        rundir.write_metrics(r.out / rundir.METRICS_FILE, records)
    save = _saver(r)

    # 3. The loop.
    progress = _Progress(done=r.first_step, records=records)
    checkpoint_dir = r.out / rundir.CHECKPOINT_DIR
    if r.resume and r.resume.checkpoint_dir.resolve() == checkpoint_dir.resolve():
        # Resumed from this run directory's own checkpoint: no need to save it again.
        progress.saved_at, progress.saved_path = r.first_step, r.restored_path
    try:
        state = _train(r, state, progress, save, write)
    except BaseException:
        if created is not None and progress.done == r.first_step:
            shutil.rmtree(created, ignore_errors=True)
        raise
    if progress.stopped:
        raise _interrupted(r, state, progress, save)

    # 4. The report.
    return _report(r, state, progress, save, start, write)


__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_LR", "TrainJobConfig", "TrainSummary",
           "TrainingInterrupted", "TrainingSetup", "format_summary", "resolve_setup", "run",
           "run_settings", "save_checkpoint"]
