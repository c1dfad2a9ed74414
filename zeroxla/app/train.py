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

The recipe (ZeRO config, optimizer, schedule, batch) comes from `zeroxla.app.recipe`. In a
multi-process run (`zeroxla launch`, `zeroxla.app.distributed`) every process runs this same
function: each builds only its own devices' rows of every batch, all take part in every step,
evaluation and checkpoint, and process 0 alone writes metrics, plot and summary.

The run directory is created only once the job has been set up (options, data, model, restore),
so a job that fails to start leaves no directory behind; one that fails before its first step
removes the directory it created.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

import zeroxla
from zeroxla import checkpoint
from zeroxla.app import distributed, rundir
from zeroxla.app.job_model import initial_state, model_config, model_factory
from zeroxla.app.train_data import SFTData, TextData, load_train_data
from zeroxla.app.interrupt import stop_requests
from zeroxla.app.job import (DEFAULT_BATCH_SIZE, DEFAULT_LR, DTYPE_NAMES, TrainJobConfig,
                             job_record)
from zeroxla.app.recipe import TrainingSetup, resolve_setup
from zeroxla.app.sampling import local_zero3_step, sample_with_engine
from zeroxla.app.tokenizer_records import tokenizer_record
from zeroxla.checkpoint.retention import prune_checkpoints
from zeroxla.deepspeed import config as ds_config
from zeroxla.sharding.mesh import make_mesh



@dataclasses.dataclass(frozen=True)
class TrainSummary:
    """What a finished run reports (also written to summary.json)."""

    steps: int
    tokens_seen: int                # over the whole run, resumed parts included
    final_train_loss: float         # mean loss on `eval_batches` fixed training batches
    final_val_loss: float           # same, on the held-out split
    tokens_per_s: float             # batch tokens / step_time_s
    step_time_s: float              # median step time after the first (compiling) step
    compile_time_s: float           # the first step of this invocation, compilation included
    wall_time_s: float              # this invocation
    memory: Mapping[str, int]       # per-device bytes from zeroxla.memory_report
    memory_table: str
    samples: str
    paths: Mapping[str, str | None]
    resumed_from_step: int = 0      # 0: trained from scratch

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "memory": dict(self.memory),
                "paths": dict(self.paths)}


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


def _mesh_for(job: TrainJobConfig):
    nodes, local = job.mesh
    stages = job.pipeline_stages
    return make_mesh(nodes, local, stages=stages,
                     devices=distributed.mesh_devices(jax.devices(), stages * nodes * local))


def _mean_loss(step: Any, state: Any, batches: list[dict]) -> float:
    return float(np.mean([float(step.eval_loss(state, b)) for b in batches]))


def _host_model(state: Any) -> Any:
    """The full model on this process's first device, for sampling. `gathered_model` moves the
    parameters to one device, which needs them addressable here: with several processes each
    first collects the whole storage-layout parameters on its host."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        device = jax.local_devices()[0]
        params = jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True),
                              state.params)
        state = state.replace(step=jax.device_put(np.int32(0), device),
                              params=jax.device_put(params, device), opt_state=None,
                              loss_scale=None)
    return zeroxla.gathered_model(state)


def _sample(step: Any, state: Any, data: TextData | SFTData, prompt: np.ndarray, job: TrainJobConfig,
            write: Callable[[str], None]) -> str:
    """The end-of-run sample: `prompt` continued by `--sample-tokens` tokens, generated by the
    Hybrid Engine (KV cache) from the trained state. Prompt + sample stop at `--seq-len`, the
    positions the model was trained on (GPT's learned positions end at max_seq_len, and those
    past the training length are untrained); a longer request is capped, and the run says so.
    With several processes, or a pipelined step, each process generates on its own devices
    from the gathered weights, the way `zeroxla generate` does from a checkpoint."""
    if job.sample_tokens == 0:
        return data.tokenizer.decode(np.asarray(prompt))
    if jax.process_count() > 1 or job.pipeline_stages > 1:
        step = local_zero3_step(_host_model(state))
        state = step.init()
    text, new = sample_with_engine(step, state, data.tokenizer, prompt,
                                   num_tokens=job.sample_tokens, max_len=job.seq_len,
                                   temperature=job.temperature, seed=job.seed)
    if new < job.sample_tokens:
        write(f"sample: {new} new tokens, not --sample-tokens {job.sample_tokens}: prompt + "
              f"sample are capped at --seq-len {job.seq_len}, the positions the model was "
              "trained on")
    return text


def _peak_lr(schedule: Callable[[Any], Any], steps: int) -> float:
    """The largest learning rate of the run, to float32's 7 digits (0.01, not 0.0099999998)."""
    return float(f"{float(np.max(np.asarray(schedule(np.arange(steps))))):.7g}")


def _write_plot(path: Path, records: list[dict], title: str) -> None:
    """loss_curve.png: per-step train loss (and its moving average) and validation loss."""
    from matplotlib.figure import Figure   # no pyplot: no global figure state

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.add_subplot()
    if train:
        steps, losses = map(np.asarray, zip(*train))
        width = len(losses) // 30           # smooth long runs; short ones are shown as they are
        ax.plot(steps, losses, color="tab:blue", alpha=0.3 if width > 1 else 1.0,
                lw=0.8 if width > 1 else 1.8, label="train (per step)")
        if width > 1:
            smooth = np.convolve(losses, np.ones(width) / width, mode="valid")
            ax.plot(steps[width - 1:], smooth, color="tab:blue", lw=1.8,
                    label=f"train ({width}-step mean)")
    if val:
        steps, losses = zip(*val)
        ax.plot(steps, losses, "o-", color="tab:orange", lw=1.8, ms=4, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run_settings(job: TrainJobConfig, setup: TrainingSetup, data: TextData | SFTData,
                 out: Path) -> dict[str, Any]:
    """Every value the run uses, defaults resolved (summary.json's "settings"; also stored in
    each checkpoint, and compared on --resume)."""
    zero = setup.zero
    dp = job.data_parallel_size
    settings = {
        "model": job.model_name, "data": data.source,
        "tokenizer": tokenizer_record(data.tokenizer)["kind"], "vocab_size": data.vocab_size,
        "steps": job.steps, "batch_size": setup.batch_size,
        "micro_batch_size": setup.batch_size // (dp * zero.gradient_accumulation_steps),
        "seq_len": job.seq_len, "lr": _peak_lr(setup.learning_rate, job.steps),
        "lr_schedule": setup.source, "warmup_steps": job.warmup_steps,
        "mesh": f"{job.mesh[0]}x{job.mesh[1]}", "pipeline_stages": job.pipeline_stages,
        "processes": jax.process_count(),
        "zero_stage": zero.stage, "persistence_threshold": zero.persistence_threshold,
        "dtype": DTYPE_NAMES[zero.compute_dtype],
        "loss_scaling": ("off" if not zero.uses_loss_scaling else "dynamic"
                         if zero.loss_scale == 0 else f"static {zero.loss_scale:g}"),
        "grad_accum": zero.gradient_accumulation_steps,
        "gradient_clipping": zero.gradient_clipping, "seed": job.seed,
        "eval_every": job.eval_every, "eval_batches": job.eval_batches,
        "save_every": job.save_every, "keep_last": job.keep_last,
        "sample_tokens": job.sample_tokens, "temperature": job.temperature, "out_dir": str(out),
    }
    if job.deepspeed_config is not None:
        settings["deepspeed_config"] = job.deepspeed_config
    return settings


# ------------------------------------------------------------------------------------------------
# The run directory.


def _choose_out_dir(job: TrainJobConfig, resume: rundir.ResumePoint | None) -> tuple[Path, bool]:
    """(the run directory, whether it is a fresh default one). Every process gets the same."""
    if job.out_dir is not None:
        out = Path(job.out_dir)
        rundir.check_out_dir(out, resuming=resume.run_dir if resume else None)
        return out, False
    if resume is not None and resume.run_dir is not None:
        return resume.run_dir, False
    out = rundir.default_run_dir(Path(job.model_name).name, now=datetime.datetime.now())
    if jax.process_count() > 1:               # process 0's clock and file system decide
        out = Path(distributed.broadcast_text(str(out)))
    return out, True


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


def _check_no_newer_checkpoint(directory: Path, first_step: int) -> None:
    latest = checkpoint.latest_step(directory)
    if latest is not None and latest > first_step:
        raise rundir.RunDirError(
            f"--resume: the checkpoint is at step {first_step} but {directory} already has a "
            f"newer one, step {latest}; resume from the newest (--resume {directory.parent}) or "
            f"continue into a fresh directory (--out {rundir.fresh_path(directory.parent)})")


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
    multi = jax.process_count() > 1
    write = (write or (lambda line: tqdm.write(line))) if primary else (lambda line: None)

    # 1. Set up: everything that can fail on a bad option or bad data, before any file is made.
    resume = rundir.locate_resume(job.resume) if job.resume else None
    out, fresh = _choose_out_dir(job, resume)
    write(f"zeroxla train: run directory {out}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ds_config.DeepSpeedConfigWarning)
        setup = resolve_setup(job)
    for w in caught:          # DeepSpeed keys without effect: one plain line each
        if issubclass(w.category, ds_config.DeepSpeedConfigWarning):
            write(f"warning: {w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    data = load_train_data(job.data, tokenizer=job.tokenizer, init_from=job.init_from,
                           batch_size=setup.batch_size, seq_len=job.seq_len,
                           val_fraction=job.val_fraction, seed=job.seed)
    config = model_config(job, data)
    mesh = _mesh_for(job)
    pipeline = (zeroxla.PipelineConfig(setup.zero.gradient_accumulation_steps)
                if job.pipeline_stages > 1 else None)
    step = zeroxla.make_step(model_factory(job, config), mesh, optimizer=setup.optimizer,
                             config=setup.zero, pipeline=pipeline)
    batch, seq = setup.batch_size, job.seq_len
    sharding = step.batch_sharding
    val_batches = data.eval_batches("val", job.eval_batches, sharding)
    checkpoint_dir = out / rundir.CHECKPOINT_DIR
    first_step = 0
    if resume:
        # Any mesh, device count or stage: the checkpoint is re-laid out for this step.
        restored = checkpoint.restore(resume.checkpoint_dir, step, step=resume.step)
        state, first_step = restored.state, int(restored.metadata["data_position"])
        if first_step >= job.steps:
            raise ValueError(f"--resume {job.resume}: the checkpoint is at step {first_step}, "
                             f"but --steps is {job.steps}; accepted: --steps > {first_step}")
        _check_no_newer_checkpoint(checkpoint_dir, first_step)
        write(f"resumed from {restored.path} at step {first_step}")
    else:
        state = initial_state(job, step, config, mesh)
    settings = run_settings(job, setup, data, out)
    zero = setup.zero
    write(f"zeroxla train: {job.model_name} on {data.source} ({data.describe()}, vocab "
          f"{data.vocab_size}), ZeRO-{zero.stage} "
          f"on a {job.mesh[0]}x{job.mesh[1]} mesh of {mesh.devices.flat[0].platform} devices"
          + (f" in {jax.process_count()} processes" if multi else "")
          + f", batch {batch} x {seq} tokens"
          + (f" in {zero.gradient_accumulation_steps} micro-batches"
             if zero.gradient_accumulation_steps > 1 else "")
          + f", {settings['dtype']}, recipe: {setup.source}")

    # 2. The run directory; a run that fails before its first step takes it away again.
    created = _create_out_dir(out, fresh)
    metrics_path = out / rundir.METRICS_FILE
    records = _earlier_records(resume, first_step)
    if primary:
        rundir.write_metrics(metrics_path, records)
    metadata = {"seed": job.seed, "model": job.model_name, "job": job_record(job),
                "settings": settings, "tokenizer": tokenizer_record(data.tokenizer)}

    def save(state: Any, done: int) -> Path:
        path = save_checkpoint(step, state, checkpoint_dir,
                               metadata={**metadata, "data_position": done})
        if job.keep_last and primary:
            prune_checkpoints(checkpoint_dir, job.keep_last)
        return path

    # 3. The loop.
    step_times: list[float] = []
    tokens_per_step = batch * seq
    val_loss = float("nan")
    done, saved_at, saved_path = first_step, None, None
    if resume and resume.checkpoint_dir.resolve() == checkpoint_dir.resolve():
        saved_at, saved_path = first_step, restored.path        # no need to save it again
    stopped = False
    try:
        # Processes other than 0 write their metrics nowhere.
        metrics_target = metrics_path if primary else os.devnull
        with open(metrics_target, "a", encoding="utf-8") as metrics_file, \
                tqdm(total=job.steps, initial=first_step, desc="train", unit="step",
                     disable=not (job.progress and primary), dynamic_ncols=True,
                     mininterval=0.5) as bar, \
                stop_requests() as ctrl_c:
            for k in range(first_step, job.steps):
                # Every process must stop at the same step (the save is collective).
                if distributed.any_process(ctrl_c.requested) if multi else ctrl_c.requested:
                    stopped = True
                    break
                batch_k = data.train_batch(k, sharding)
                t0 = time.perf_counter()
                state, metrics = step(state, batch_k)
                values = {name: float(v) for name, v in metrics.items()}   # waits for the step
                dt = time.perf_counter() - t0
                step_times.append(dt)
                if not math.isfinite(values["loss"]):
                    raise FloatingPointError(f"step {k + 1}: loss is {values['loss']}; lower --lr "
                                             "or enable gradient clipping in --config")
                done = k + 1
                record = {"step": done, **values, "lr": float(setup.learning_rate(k)),
                          "tokens": tokens_per_step, "step_time_s": dt,
                          "tokens_per_s": tokens_per_step / dt}
                records.append(record)
                metrics_file.write(json.dumps(record) + "\n")
                bar.set_postfix_str(f"loss {values['loss']:.3f}  {tokens_per_step / dt:,.0f} "
                                    f"tok/s  {dt * 1e3:.0f} ms/step", refresh=False)
                bar.update(1)
                if done % job.eval_every == 0 or done == job.steps:
                    val_loss = _mean_loss(step, state, val_batches)
                    val_record = {"step": done, "val_loss": val_loss}
                    records.append(val_record)
                    metrics_file.write(json.dumps(val_record) + "\n")
                    write(f"step {done:>6}: train loss {values['loss']:.4f}  "
                          f"validation loss {val_loss:.4f}")
                metrics_file.flush()
                if job.save_every and done % job.save_every == 0 and done < job.steps:
                    saved_at, saved_path = done, save(state, done)
                    write(f"step {done:>6}: saved checkpoint {saved_path}")
    except BaseException:
        if created is not None and done == first_step:
            shutil.rmtree(created, ignore_errors=True)
        raise

    plot_path = out / rundir.PLOT_FILE
    title = (f"{job.model_name} on {data.source}: ZeRO-{zero.stage}, mesh "
             f"{job.mesh[0]}x{job.mesh[1]}, batch {batch}x{seq}")
    if stopped:
        if saved_at != done:
            saved_path = save(state, done)
        if primary:
            _write_plot(plot_path, records, title)
        raise TrainingInterrupted(done, saved_path, out)

    # 4. The report.
    train_loss = _mean_loss(step, state, data.eval_batches("train", job.eval_batches, sharding))
    # The median step after the first (compiling) one: robust to a recompile or a busy host.
    step_time = float(np.median(step_times[1:] or step_times))
    report = zeroxla.memory_report(step, state, val_batches[0])
    if primary:
        _write_plot(plot_path, records, title)
    checkpoint_path = save(state, job.steps) if saved_at != job.steps else saved_path

    samples = _sample(step, state, data, data.sample_prompt(), job, write)

    summary_path = out / rundir.SUMMARY_FILE
    summary = TrainSummary(
        steps=job.steps,
        tokens_seen=sum(r.get("tokens", tokens_per_step) for r in records if "loss" in r),
        final_train_loss=train_loss, final_val_loss=val_loss,
        tokens_per_s=tokens_per_step / step_time, step_time_s=step_time,
        compile_time_s=step_times[0], wall_time_s=time.perf_counter() - start,
        memory={k: int(v) for k, v in report.to_dict().items() if isinstance(v, (int, float))},
        memory_table=report.table(),
        samples=samples,
        paths={"run_dir": str(out), "metrics": str(metrics_path), "loss_curve": str(plot_path),
               "summary": str(summary_path), "checkpoint": str(checkpoint_path)},
        resumed_from_step=first_step)
    if primary:
        with open(summary_path, "w", encoding="utf-8") as f:
            json.dump({"settings": settings, **summary.to_dict()}, f, indent=2)
    return summary


def format_summary(summary: TrainSummary) -> str:
    """The end-of-run report `zeroxla train` prints."""
    sample = "\n".join("    " + line for line in summary.samples.splitlines())
    resumed = (f", resumed at step {summary.resumed_from_step}" if summary.resumed_from_step
               else "")
    return "\n".join([
        "",
        "=== summary ===",
        f"steps                 {summary.steps}  ({summary.tokens_seen:,} tokens{resumed})",
        f"final train loss      {summary.final_train_loss:.4f}",
        f"final validation loss {summary.final_val_loss:.4f}",
        f"throughput            {summary.tokens_per_s:,.0f} tokens/s  "
        f"({summary.step_time_s * 1e3:.1f} ms/step, median; first step with compilation "
        f"{summary.compile_time_s:.1f} s)",
        f"wall time             {summary.wall_time_s:.1f} s",
        "per-device memory (zeroxla.memory_report):",
        "\n".join("    " + line for line in summary.memory_table.splitlines()),
        "",
        "=== sample (generated from the trained model by the Hybrid Engine, KV cache) ===",
        sample,
        "",
        "=== written ===",
        f"run directory {summary.paths['run_dir']}",
        f"metrics      {summary.paths['metrics']}",
        f"loss curve   {summary.paths['loss_curve']}",
        f"summary      {summary.paths['summary']}",
        f"checkpoint   {summary.paths['checkpoint']}",
    ])


__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_LR", "TrainJobConfig", "TrainSummary",
           "TrainingInterrupted", "TrainingSetup", "format_summary", "resolve_setup", "run",
           "run_settings", "save_checkpoint"]
