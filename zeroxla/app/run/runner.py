"""The one runner every job runs under: run directory, loop, checkpoints, signals, the end.

    summary = runner.run(job, resume=point)

What it owns, the same for every job (`zeroxla.app.run.job.Job` is what the job supplies):

- the run directory: `--out`, else a fresh `runs/<job>-<time>`, else (`--resume`) the run's
  own; claimed under a lock (`rundir.claim`) once the job is built, so a job that fails to
  start leaves nothing. The failure rule: **a run directory that holds a checkpoint is never
  removed**; a fresh run that fails before its first checkpoint removes what it made.
- the loop: `advance` per step (or iteration), `evaluate` every `run.eval_every` and at the
  end, metrics.jsonl one record per unit (a resumed run keeps the records up to its
  checkpoint and redoes the rest), each record also to the `run.report_to` trackers
  (`trackers`: a missing package refused before anything is made), the progress bar, a
  checkpoint every `run.save_every` and at the end (the newest `run.keep_last` kept), each
  recording the job (`run.resume`).
- stop signals: the first SIGINT or SIGTERM finishes the running unit, saves it and raises
  `RunInterrupted` (the command exits 130 or 143); a second stops at once.
- divergence: a non-finite loss, or parameters that are no longer finite when a checkpoint is
  due, stop the run with `RunDiverged` (exit 1) naming the unit. A step that skips a
  non-finite update (`ZeroConfig.check_grad_overflow`) kept the last finite state: that is
  saved; non-finite parameters are never saved, and nothing is exported.
- the end: the final checkpoint first, then its export as a Hugging Face checkpoint with the
  job's tokenizer (`Job.EXPORT_DIR`), the job's `finish` (plots, its figures), the parameter
  counts, and summary.json, strict JSON (a non-finite value is written null).

In a multi-process run every process runs this; all take part in each checkpoint and process 0
alone writes files.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla import checkpoint
from zeroxla.app import distributed
from zeroxla.app.run import rundir, trackers
from zeroxla.app.tokenizers.pretrained import save_tokenizer
from zeroxla.app.interrupt import STOP_SIGNALS, signal_name, stop_requests
from zeroxla.app.run.job import Job
from zeroxla.app.run.resume import RECORD_KEY, data_paths, job_record, tree_record
from zeroxla.checkpoint.export import export_checkpoint
from zeroxla.checkpoint.retention import prune_checkpoints


def where(job: Job, done: int) -> str:
    """Where a run stands after `done` units, as its metrics.jsonl counts them: "after step 3"
    (("step", 0)), "after iteration 1" or "before iteration 0" (("iteration", 1): 0-based)."""
    key, offset = job.COUNTER
    if done - offset < 0:
        return f"before {job.UNIT} 0"
    return f"after {job.UNIT} {done - offset}"


class RunInterrupted(Exception):
    """A stop signal (`signum`) ended the run after `done` units; checkpoint `path` holds them."""

    def __init__(self, job: Job, done: int, path: Path, run_dir: Path, signum: int):
        super().__init__(f"interrupted ({signal_name(signum)}) {where(job, done)}; saved "
                         f"checkpoint {path}\nresume with: zeroxla {job.NAME} --resume {run_dir}")
        self.done, self.path, self.run_dir, self.signum = done, path, run_dir, signum


class RunDiverged(FloatingPointError):
    """The loss or the parameters stopped being finite; the message names the unit and what was
    kept."""


class NothingLeft(Exception):
    """`--resume` of a finished run whose recorded end is not past: nothing to do."""


def parameter_counts(layout: Any) -> dict[str, int]:
    """{"total", "trainable"}: the model's parameter elements and those with gradients and
    optimizer state (all, or the LoRA adapters alone), from the step's plan."""
    plan = layout.plan
    return {"total": plan.total_numel(),
            "trainable": sum(leaf.numel for leaf in plan.trainable_leaves)}


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def all_finite(state: Any) -> bool:
    """Whether every floating parameter of `state` is finite (a collective across processes)."""
    leaves = [x for x in jax.tree.leaves(state.params) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                                      for x in xs])))(leaves))


class _Run:
    """One run's moving parts: the job, its directory, where the loop stands."""

    def __init__(self, job: Job, out: Path, done: int, records: list[dict],
                 write: Callable[[str], None], track: trackers.Trackers):
        self.job, self.out, self.done, self.records, self.write = job, out, done, records, write
        self.track = track
        self.primary = jax.process_index() == 0
        self.saved_at: int | None = None
        self.saved_path: Path | None = None

    def draw(self) -> None:
        """The job's pictures of the records so far (process 0)."""
        if self.primary:
            self.job.draw(self.out, self.records)

    def position(self, record: dict[str, Any]) -> int:
        key, offset = self.job.COUNTER
        return int(record[key]) + offset

    def save(self) -> Path:
        """Checkpoint of the units done (once per unit; each part of the job in its directory),
        the newest `keep_last` kept; the first part's path."""
        if self.saved_at == self.done:
            return self.saved_path
        parts = self.job.parts()
        if not all(all_finite(part.state) for part in parts.values()):
            raise RunDiverged(self._diverged_text("its parameters are not finite"))
        job, settings = self.job, self.job.config.run
        record = job_record(job.NAME, job.config, data_paths(job.config, job.DATA), self.done)
        paths = []
        for name, part in parts.items():
            directory = rundir.part_dir(self.out, name)
            metadata = {**job.checkpoint_metadata(self.out, name), RECORD_KEY: record}
            paths.append(checkpoint.save(directory, part.state, layout=part.step.layout,
                                         metadata=metadata,
                                         model_config=job.checkpoint_model_config(name)))
            if settings.keep_last and self.primary:
                prune_checkpoints(directory, settings.keep_last)
        self.saved_path, self.saved_at = paths[0], self.done
        return self.saved_path

    def _unit(self) -> str:
        """The unit just done as metrics.jsonl names it: "step 3", "iteration 0"."""
        return f"{self.job.UNIT} {self.done - self.job.COUNTER[1]}"

    def _diverged_text(self, what: str) -> str:
        """`what` went wrong at the unit just done; no checkpoint of it can be kept."""
        earlier = (f"the newest checkpoint is {self.saved_path}" if self.saved_path is not None
                   else "no checkpoint was saved before it (--save-every N keeps one every N "
                   f"{self.job.UNIT}s)")
        return (f"{self._unit()}: {what}, so training stopped (lower the learning rate). No "
                f"checkpoint of it was saved: non-finite parameters are never saved; {earlier}; "
                "nothing was exported")

    def diverged(self, loss: float) -> RunDiverged:
        """After a non-finite loss: the state is saved where the step skipped its update
        (`check_grad_overflow`) and so kept the last finite parameters."""
        what = f"the loss is {loss} (not finite)"
        if all(all_finite(part.state) for part in self.job.parts().values()):
            path = self.save()
            return RunDiverged(f"{self._unit()}: {what}, so training stopped (lower the learning "
                               f"rate). Its update was skipped: checkpoint {path} holds the "
                               "parameters and optimizer state from before it, the last finite "
                               f"ones (--resume {self.out} continues from there); nothing was "
                               "exported")
        return RunDiverged(self._diverged_text(what + " and its parameters are not finite"))


def _claim(out: Path, *, fresh: bool, resuming: Path | None) -> rundir.RunClaim | None:
    """`rundir.claim` on process 0; every process raises the same refusal."""
    held, refusal = None, ""
    if jax.process_index() == 0:
        try:
            held = rundir.claim(out, fresh=fresh, resuming=resuming)
        except rundir.RunDirError as err:
            refusal = str(err)
    if jax.process_count() > 1:
        refusal = distributed.broadcast_text(refusal)
    if refusal:
        raise rundir.RunDirError(refusal)
    return held


def _restore(job: Job, point: rundir.ResumePoint) -> tuple[int, Path]:
    """Loads `point`'s checkpoint into each part's `state`; (the units it had done, the first
    part's checkpoint path). A job of several parts continues from the newest step all its
    parts hold."""
    parts = job.parts()
    done, metadata, path = None, None, None
    for name, part in parts.items():
        directory = point.checkpoint_dir if name is None else point.checkpoint_dir / name
        restored = checkpoint.restore(directory, part.step, step=point.step)
        part.state = restored.state
        record = restored.metadata.get(RECORD_KEY)
        at = int(record["done"]) if record else job.restored(restored.metadata)
        if done is not None and at != done:
            raise checkpoint.CheckpointError(
                f"--resume {point.checkpoint_dir}: its parts were saved after different "
                f"units ({', '.join(map(str, parts))}: {done} and {at}); accepted: a run whose "
                "newest checkpoints of every part are one save")
        done, metadata, path = at, restored.metadata, path or restored.path
    if RECORD_KEY in metadata:
        job.restored(metadata)
    return done, path


def _out_dir(job: Job, resume: rundir.ResumePoint | None) -> Path:
    """--out, else the resumed run's own directory, else a fresh runs/<label>-<time> (process
    0's clock decides in a multi-process run)."""
    settings = job.config.run
    if settings.out_dir:
        return Path(settings.out_dir)
    if resume is not None and resume.run_dir is not None:
        return resume.run_dir
    out = rundir.default_run_dir(job.label, now=datetime.datetime.now())
    if jax.process_count() > 1:
        out = Path(distributed.broadcast_text(str(out)))
    return out


def default_write() -> Callable[[str], None]:
    """A line printed without breaking the progress bar (tqdm.write), on process 0 alone."""
    from tqdm import tqdm

    return tqdm.write if jax.process_index() == 0 else (lambda line: None)


def run(job: Job, *, resume: rundir.ResumePoint | None = None,
        write: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs `job` (continuing `resume`) to its end; returns summary.json's contents. Raises
    `RunInterrupted` after a stop signal, `RunDiverged` on a non-finite loss and `NothingLeft`
    when `resume` names a finished run that is already at `job.total`."""
    start = time.perf_counter()
    write = write if write is not None and jax.process_index() == 0 else default_write()
    settings = job.config.run
    trackers.check_installed(settings.report_to)
    resuming = resume.run_dir if resume is not None else None
    out = _out_dir(job, resume)
    write(f"zeroxla {job.NAME}: run directory {out}")
    done, restored_path = _restore(job, resume) if resume is not None else (0, None)
    if resume is not None:
        if done >= job.total and (out / rundir.SUMMARY_FILE).is_file():
            raise NothingLeft(f"nothing left to do: --resume {out} has run {job.UNIT} {done} "
                              f"of {job.total}; accepted: more {job.UNIT}s to continue it")
        rundir.check_no_newer(out, next(iter(job.parts())), restored_path)
        write(f"resumed from {restored_path} {where(job, done)}")
    with stop_requests(*STOP_SIGNALS) as stop:
        stopping = ((lambda: distributed.any_process(stop.requested))
                    if jax.process_count() > 1 else (lambda: stop.requested))
        held = _claim(out, fresh=settings.out_dir is None and resume is None, resuming=resuming)
        try:
            # The failure rule, on the process that claimed the directory (process 0).
            cleanup = (rundir.removed_unless_saved(out, created=held.created) if held is not None
                       else contextlib.nullcontext())
            names = settings.report_to if jax.process_index() == 0 else ()
            with cleanup, trackers.opened(names, out, job=job.NAME, key=job.COUNTER[0],
                                          config=tree_record(job.config),
                                          resumed=resume is not None) as track:
                r = _Run(job, out, done, [], write, track)
                if resume is not None and resume.checkpoint_dir.resolve() == (
                        out / rundir.CHECKPOINT_DIR).resolve():
                    r.saved_at, r.saved_path = done, restored_path
                return _run_claimed(r, resume, stopping, stop, start)
        finally:
            if held is not None:
                held.release()


def _run_claimed(r: _Run, resume: rundir.ResumePoint | None, stopping: Callable[[], bool],
                 stop: Any, start: float) -> dict[str, Any]:
    """`run` once the directory is this job's: records, the loop, the end."""
    job, metrics_path = r.job, r.out / rundir.METRICS_FILE
    if resume is not None:            # the run's records up to its checkpoint; later: redone
        source = (resume.run_dir or r.out) / rundir.METRICS_FILE
        r.records = [x for x in rundir.read_metrics(source, key=job.COUNTER[0])
                     if r.position(x) <= r.done]
    r.write(job.describe(r.done))
    before = job.evaluate() if r.done == 0 and job.EVALUATE_FIRST else {}
    key, offset = job.COUNTER
    if before and offset == 0:
        r.records.append({key: 0, **before})
    if r.primary:
        rundir.write_metrics(metrics_path, [finite(x) for x in r.records])
    for record in r.records:
        r.track.log(record)
    try:
        _loop(r, stopping)
    except RunDiverged:
        r.draw()
        raise
    if r.done < job.total or stopping():
        path = r.save()
        r.draw()
        raise RunInterrupted(job, r.done, path, r.out, stop.signum)
    path = r.save()                     # the training is kept before anything else runs
    r.draw()
    exported = {job.EXPORT_DIR: _export(r)} if job.EXPORT_DIR and r.primary else {}
    summary = {"settings": tree_record(job.config), **job.finish(r.out, r.records, before),
               **exported, "checkpoint": str(path), "parameters": _counts(job),
               "wall_time_s": time.perf_counter() - start}
    if stopping():                      # a stop during the end: trained and saved, no summary
        raise RunInterrupted(job, r.done, path, r.out, stop.signum)
    if r.primary:
        (r.out / rundir.SUMMARY_FILE).write_text(
            json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
    r.track.finish(finite(summary))
    return summary


def _loop(r: _Run, stopping: Callable[[], bool]) -> None:
    """Units `r.done` .. `total`, or to a stop request: each recorded as it finishes, evaluated
    and saved on the cadence; a non-finite loss raises `RunDiverged`."""
    from tqdm import tqdm

    job, settings = r.job, r.job.config.run
    key, offset = job.COUNTER
    every = settings.eval_every
    metrics_path = r.out / rundir.METRICS_FILE
    with open(metrics_path if r.primary else os.devnull, "a", encoding="utf-8") as metrics, \
            tqdm(total=job.total, initial=r.done, desc=job.NAME, unit=job.UNIT,
                 disable=not (settings.progress and r.primary), dynamic_ncols=True,
                 mininterval=0.5) as bar:
        while r.done < job.total and not stopping():
            record = job.advance(r.done)
            r.done += 1
            losses = [float(v) for k, v in record.items() if k == "loss" or k.endswith("_loss")]
            loss = losses[0] if losses else 0.0
            bad = [v for v in losses if not math.isfinite(v)]
            if bad:                     # "loss", or each model's ("actor_loss", "critic_loss")
                raise r.diverged(bad[0])
            record = {key: r.done - offset, **record}
            if (every and r.done % every == 0) or r.done == job.total:
                record.update(job.evaluate())
                r.write(job.say(record))
            r.records.append(record)
            metrics.write(json.dumps(finite(record)) + "\n")
            metrics.flush()
            r.track.log(record)
            bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            bar.update(1)
            if settings.save_every and r.done % settings.save_every == 0 and r.done < job.total:
                r.write(f"{job.UNIT} {r.done - offset}: saved checkpoint {r.save()}")


def _counts(job: Job) -> dict[str, Any]:
    """The parameter counts of the job's part, or {part: counts} of its several parts."""
    counts = {name: parameter_counts(part.step.layout) for name, part in job.parts().items()}
    return counts[None] if None in counts else counts


def _export(r: _Run) -> str:
    """The final checkpoint as a Hugging Face checkpoint with the job's tokenizer, in
    `out/EXPORT_DIR` (process 0; export reads the saved files)."""
    target = r.out / r.job.EXPORT_DIR
    name, part = next(iter(r.job.parts().items()))
    export_checkpoint(rundir.part_dir(r.out, name), target)
    model = part.step.layout.model_def.abstract_module()
    save_tokenizer(r.job.tokenizer, target, model_max_length=model.config.max_seq_len)
    return str(target)


__all__ = ["NothingLeft", "RunDiverged", "RunInterrupted", "all_finite", "default_write", "finite",
           "parameter_counts", "run"]
