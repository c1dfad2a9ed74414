"""The training job behind `zeroxla train`: data -> mesh -> step -> loop -> report.

`run(TrainJobConfig(...)) -> TrainSummary` trains a `models/` preset, or a pretrained Hugging Face
checkpoint (`model.init_from`, loaded straight into its ZeRO partitions), on a text corpus or on
prompt/response pairs (`zeroxla.app.train.data`: the loss on the responses only) with
`zeroxla.make_step` on a `("node", "local")` mesh, shows a progress bar (step, loss, tokens/s, step
time), evaluates on the held-out split every `run.eval_every` steps, and writes to its run
directory (`zeroxla.app.rundir`; a fresh `runs/<model>-<time>` unless `run.out_dir` says
otherwise):

    metrics.jsonl     one JSON object per step ({"step", "loss", "grad_norm", "lr", ...}) and per
                      evaluation ({"step", "val_loss"}); a resumed run appends to it
    loss_curve.png    train and validation loss against step, the whole run
    summary.json      "settings" (every value the run used) and the TrainSummary
    checkpoint/<n>/   every `run.save_every` steps and at the end (the newest `run.keep_last`
                      kept), and at a stop signal or a non-finite loss (`zeroxla.app.train.end`);
                      each records the job's config tree and its tokenizer, so `--resume`
                      continues it as it was (`zeroxla.app.train.resume`)

The job is a resolved config tree (`zeroxla.app.train.config`; `zeroxla.app.train.resolve` makes
one from options); the recipe (ZeRO config, optimizer, schedule) is built from it by
`zeroxla.app.train.recipe`; setting up (everything before the run directory is made) is
`zeroxla.app.train.prepare`, and the settings, loss curve, sample and summary are
`zeroxla.app.train.report`.

In a multi-process run (`zeroxla launch`, `zeroxla.app.distributed`) every process runs this same
function: each builds only its own devices' rows of every batch, all take part in every step,
evaluation and checkpoint, and process 0 alone writes metrics, plot and summary.

The run directory is created only once the job has been set up (options, data, model, restore),
and claimed under a lock (`rundir.claim`), so a job that fails to start leaves no directory
behind and two jobs never write into one; one that fails before its first step removes the
directory it created. From the claim on, SIGINT and SIGTERM finish the running step, save it and
stop (`zeroxla.app.interrupt`); the end of every run saves its last step before anything else.
"""

from __future__ import annotations

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
from zeroxla.app.interrupt import STOP_SIGNALS, StopRequest, stop_requests
from zeroxla.app.tokenizer_records import tokenizer_record
from zeroxla.app.train.config import TrainJobConfig
from zeroxla.app.train.end import (Progress, TrainingDiverged, TrainingInterrupted, diverged,
                                   interrupted, save_final)
from zeroxla.app.train.prepare import TrainRun, set_up
from zeroxla.app.train.report import (TrainSummary, final_sample, parameter_counts, write_plot,
                                      write_summary)
from zeroxla.app.train.resume import RECORD_KEY, job_record
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.checkpoint.retention import prune_checkpoints


# ------------------------------------------------------------------------------------------------
# Helpers.


def save_checkpoint(step: Any, state: Any, directory: Path, *, metadata: dict) -> Path:
    """Writes the TrainState as checkpoint `state.step` under `directory` (orbax, sharded;
    restorable onto any mesh with `zeroxla.restore` or `zeroxla train --resume`); returns the
    step's path. Every process must call it."""
    return checkpoint.save(directory, state, layout=step.layout, metadata=metadata)


def _mean_loss(step: Any, state: Any, batches: list[dict]) -> float:
    """The mean loss of `state` on `batches`, without training."""
    return float(np.mean([float(step.eval_loss(state, b)) for b in batches]))


# ------------------------------------------------------------------------------------------------
# The run directory.


def _claim_out_dir(r: TrainRun) -> rundir.RunClaim | None:
    """Claims the run directory for this job (`rundir.claim`: created if missing, locked, checked
    under the lock), on process 0; every process raises the same RunDirError if it is refused.
    Returns process 0's claim (None elsewhere)."""
    resuming = r.resume.run_dir if r.resume else None
    held, refusal = None, ""
    if jax.process_index() == 0:
        try:
            held = rundir.claim(r.out, fresh=r.fresh, resuming=resuming)
        except rundir.RunDirError as err:
            refusal = str(err)
    if jax.process_count() > 1:
        refusal = distributed.broadcast_text(refusal)
    if refusal:
        raise rundir.RunDirError(refusal)
    return held


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
    metadata = {"seed": job.run.seed, "model": job.model_name, RECORD_KEY: job_record(job),
                "settings": r.settings, "tokenizer": tokenizer_record(r.data.tokenizer),
                LORA_KEY: as_metadata(job.lora.config())}
    keep_last = job.run.keep_last

    def save(state: Any, done: int) -> Path:
        path = save_checkpoint(r.step, state, checkpoint_dir,
                               metadata={**metadata, "data_position": done})
        if keep_last and primary:
            prune_checkpoints(checkpoint_dir, keep_last)
        return path

    return save


def _step(r: TrainRun, state: Any, k: int, progress: Progress) -> tuple[Any, dict]:
    """Trains step `k + 1` on its batch; returns the new state and the step's metrics record
    (also added to `progress`). A non-finite loss sets `progress.diverged` instead."""
    batch_k = r.data.train_batch(k, r.step.layout.batch_sharding)
    t0 = time.perf_counter()
    state, metrics = r.step(state, batch_k)
    values = {name: float(v) for name, v in metrics.items()}   # waits for the step
    dt = time.perf_counter() - t0
    progress.step_times.append(dt)
    progress.done = k + 1
    if not math.isfinite(values["loss"]):
        progress.diverged = values["loss"]
        return state, {}
    record = {"step": progress.done, **values, "lr": float(r.setup.learning_rate(k)),
              "tokens": r.tokens_per_step, "step_time_s": dt,
              "tokens_per_s": r.tokens_per_step / dt}
    progress.records.append(record)
    return state, record


def _train(r: TrainRun, state: Any, progress: Progress, save: Callable[[Any, int], Path],
           write: Callable[[str], None], stopping: Callable[[], bool]) -> Any:
    """Trains from `progress.done` to `--steps`, to a stop signal (`stopping()`) or to a
    non-finite loss (`progress.diverged`), appending to metrics.jsonl, evaluating every
    `eval_every` steps and saving every `save_every`; returns the state."""
    from tqdm import tqdm

    every, steps = r.job.run, r.job.schedule.steps
    primary = jax.process_index() == 0
    # Processes other than 0 write their metrics nowhere.
    metrics_target = r.out / rundir.METRICS_FILE if primary else os.devnull
    with open(metrics_target, "a", encoding="utf-8") as metrics_file, \
            tqdm(total=steps, initial=r.first_step, desc="train", unit="step",
                 disable=not (every.progress and primary), dynamic_ncols=True,
                 mininterval=0.5) as bar:
        for k in range(r.first_step, steps):
            if stopping():
                break
            state, record = _step(r, state, k, progress)
            if progress.diverged is not None:
                break
            metrics_file.write(json.dumps(record) + "\n")
            bar.set_postfix_str(f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} "
                                f"tok/s  {record['step_time_s'] * 1e3:.0f} ms/step",
                                refresh=False)
            bar.update(1)
            done = progress.done
            if done % every.eval_every == 0 or done == steps:
                progress.val_loss = _mean_loss(r.step, state, r.val_batches)
                val_record = {"step": done, "val_loss": progress.val_loss}
                progress.records.append(val_record)
                metrics_file.write(json.dumps(val_record) + "\n")
                write(f"step {done:>6}: train loss {record['loss']:.4f}  "
                      f"validation loss {progress.val_loss:.4f}")
            metrics_file.flush()
            if every.save_every and done % every.save_every == 0 and done < steps:
                progress.mark_saved(save(state, done))
                write(f"step {done:>6}: saved checkpoint {progress.saved_path}")
    return state


def _report(r: TrainRun, state: Any, progress: Progress, start: float,
            write: Callable[[str], None], check_stop: Callable[[], None]) -> TrainSummary:
    """The end of a finished run, its final checkpoint saved: final losses, speed and memory,
    the loss curve, the sample and summary.json; returns the summary. `check_stop()` raises
    between its parts if a stop signal came meanwhile."""
    job, step, out = r.job, r.step, r.out
    primary = jax.process_index() == 0
    train_loss = _mean_loss(step, state, r.data.eval_batches("train", job.run.eval_batches,
                                                             step.layout.batch_sharding))
    check_stop()
    # The median step after the first (compiling) one: robust to a recompile or a busy host.
    step_times = progress.step_times
    step_time = float(np.median(step_times[1:] or step_times))
    report = zeroxla.memory_report(step.compile(state, r.val_batches[0]), state, layout=step.layout)
    plot_path = out / rundir.PLOT_FILE
    if primary:
        write_plot(plot_path, progress.records, r.plot_title)
    check_stop()
    samples = final_sample(step, state, r.data, r.data.sample_prompt(), job, write)
    check_stop()

    summary_path = out / rundir.SUMMARY_FILE
    tokens_per_step = r.tokens_per_step
    summary = TrainSummary(
        steps=job.schedule.steps,
        tokens_seen=sum(rec.get("tokens", tokens_per_step) for rec in progress.records
                        if "loss" in rec),
        final_train_loss=train_loss, final_val_loss=progress.val_loss,
        tokens_per_s=tokens_per_step / step_time, step_time_s=step_time,
        compile_time_s=step_times[0], wall_time_s=time.perf_counter() - start,
        memory={k: int(v) for k, v in report.to_dict().items() if isinstance(v, (int, float))},
        memory_table=report.table(), parameters=parameter_counts(step.layout),
        samples=samples,
        paths={"run_dir": str(out), "metrics": str(out / rundir.METRICS_FILE),
               "loss_curve": str(plot_path), "summary": str(summary_path),
               "checkpoint": str(progress.saved_path)},
        resumed_from_step=r.first_step)
    if primary:
        write_summary(summary_path, r.settings, summary)
    return summary


# ------------------------------------------------------------------------------------------------
# The job.


def _stopping(stop: StopRequest) -> Callable[[], bool]:
    """Whether a stop signal came, on any process (every process stops at the same step: the
    save is collective)."""
    if jax.process_count() > 1:
        return lambda: distributed.any_process(stop.requested)
    return lambda: stop.requested


def run(job: TrainJobConfig, *, write: Callable[[str], None] | None = None) -> TrainSummary:
    """Trains as `job` says and returns the summary (see the module docstring for the outputs).

    `write` prints a line without breaking the progress bar (default: tqdm.write to stdout); in
    a multi-process run only process 0 writes. From the moment the run directory is claimed, a
    first SIGINT or SIGTERM finishes the running step (or the final save), saves the last
    finished step and raises `TrainingInterrupted` (a second one stops at once). A non-finite
    loss raises `TrainingDiverged`, once the last finite state is saved where the step kept it.
    """
    from tqdm import tqdm

    start = time.perf_counter()
    primary = jax.process_index() == 0
    write = (write or (lambda line: tqdm.write(line))) if primary else (lambda line: None)

    # 1. Set up: everything that can fail on a bad option or bad data, before any file is made.
    r, state = set_up(job, write)

    with stop_requests(*STOP_SIGNALS) as stop:
        stopping = _stopping(stop)
        # 2. The run directory, claimed for this job; a run that fails before its first step
        # takes what it created away again.
        held = _claim_out_dir(r)
        try:
            return _run_claimed(r, state, held, stop, stopping, start, write)
        finally:
            if held is not None:
                held.release()


def _run_claimed(r: TrainRun, state: Any, held: rundir.RunClaim | None, stop: StopRequest,
                 stopping: Callable[[], bool], start: float,
                 write: Callable[[str], None]) -> TrainSummary:
    """`run` once the run directory is this job's: the loop, the final save, the report."""
    records = _earlier_records(r.resume, r.first_step)
    if jax.process_index() == 0:
        rundir.write_metrics(r.out / rundir.METRICS_FILE, records)
    save = _saver(r)

    # 3. The loop.
    progress = Progress(done=r.first_step, records=records)
    checkpoint_dir = r.out / rundir.CHECKPOINT_DIR
    if r.resume and r.resume.checkpoint_dir.resolve() == checkpoint_dir.resolve():
        # Resumed from this run directory's own checkpoint: no need to save it again.
        progress.saved_at, progress.saved_path = r.first_step, r.restored_path
    try:
        state = _train(r, state, progress, save, write, stopping)
    except BaseException:
        created = held.created if held is not None else None
        if created is not None and progress.done == r.first_step:
            shutil.rmtree(created, ignore_errors=True)
        raise
    if progress.diverged is not None:
        raise diverged(r, state, progress, save)

    # 4. The last finished step's checkpoint first: whatever comes after, the training is kept.
    if stopping():
        raise interrupted(r, state, progress, save, stop.signum)
    save_final(state, progress, save)

    def check_stop() -> None:
        if stopping():
            raise interrupted(r, state, progress, save, stop.signum)

    # 5. The report.
    check_stop()
    return _report(r, state, progress, start, write, check_stop)


__all__ = ["TrainSummary", "TrainingDiverged", "TrainingInterrupted", "run", "save_checkpoint"]
