"""The training job behind `zeroxla train`: data -> mesh -> step -> loop -> report.

`run(TrainJobConfig(...)) -> TrainSummary` trains a `models/` preset on a text corpus with
`zeroxla.make_step` on a `("node", "local")` mesh, shows a progress bar (step, loss, tokens/s, step
time), evaluates on the held-out split every `eval_every` steps, and writes to `out_dir`:

    metrics.jsonl     one JSON object per step ({"step", "loss", "grad_norm", "lr", ...}) and per
                      evaluation ({"step", "val_loss"})
    loss_curve.png    train and validation loss against step
    summary.json      the returned TrainSummary (final losses, tokens/s, memory, paths, samples)
    checkpoint/       the final TrainState, once `save_final_checkpoint` is filled in

Where the settings come from: an explicit field wins; a DeepSpeed JSON (`deepspeed_config`) gives
the batch size, ZeRO config, optimizer and schedule; otherwise the defaults below (tuned so the
default job, gpt-tiny on tiny-shakespeare, finishes in a few minutes on two CPU cores). A field set
both explicitly and in the JSON to different values is an error, not a silent override.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from zeroxla import models
import zeroxla
from zeroxla import checkpoint
from zeroxla.deepspeed import config as ds_config
from zeroxla.engine.config import ZeroConfig
from zeroxla.app.data import BatchPlan, Corpus, device_batch, load_corpus
from zeroxla.engine.mesh import make_mesh
from zeroxla.app.sampling import sample_text
from zeroxla.app.tokenizer import TOKENIZERS

# Defaults of the default job (see README): gpt-tiny, character level, tiny-shakespeare.
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 1e-2
# Validation batches are drawn with this seed whatever the training seed, so validation losses
# of runs with different seeds are measured on the same text.
VALIDATION_SEED = 1234


@dataclasses.dataclass(frozen=True)
class TrainJobConfig:
    """Everything `zeroxla train` needs. `None` means "from the DeepSpeed config, else default"."""

    model: str = "gpt-tiny"
    data: str | None = None                 # a UTF-8 text file; None = bundled tiny-shakespeare
    tokenizer: str = "char"                 # "char" or "byte"
    steps: int = 600
    batch_size: int | None = None           # global batch (train_batch_size)
    seq_len: int = 128
    lr: float | None = None                 # peak learning rate of the default schedule
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1               # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    gradient_clipping: float = 1.0          # global-norm clipping of the default recipe
    mesh: tuple[int, int] = (2, 4)          # (nodes, local devices per node)
    zero_stage: int | None = None           # default 3
    # Parameters with fewer elements stay replicated (DeepSpeed's
    # stage3_param_persistence_threshold). None: from the DeepSpeed config, else 0. DeepSpeed's
    # default, 1e5, exceeds every leaf of gpt-tiny (the largest has 28,800 elements), so it would
    # partition nothing; 0 partitions every leaf and the summary shows ZeRO-3's 1/8 per device.
    persistence_threshold: int | None = None
    deepspeed_config: str | None = None     # a DeepSpeed JSON path
    out_dir: str = "runs/train"
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    val_fraction: float = 0.1
    sample_tokens: int = 400
    temperature: float = 0.8
    progress: bool = True
    resume: str | None = None               # a checkpoint directory written by an earlier run

    def __post_init__(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"TrainJobConfig.{name}={getattr(self, name)!r} is invalid; "
                             f"accepted: {accepted}")

        if self.model not in models.PRESETS:
            fail("model", ", ".join(models.PRESETS))
        if self.tokenizer not in TOKENIZERS:
            fail("tokenizer", ", ".join(TOKENIZERS))
        for name in ("steps", "seq_len", "eval_every", "eval_batches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, "an integer >= 1")
        for name in ("warmup_steps", "sample_tokens", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                fail(name, "an integer >= 0")
        if self.batch_size is not None and (not isinstance(self.batch_size, int)
                                            or self.batch_size < 1):
            fail("batch_size", "an integer >= 1, or None (from the DeepSpeed config or "
                 f"{DEFAULT_BATCH_SIZE})")
        if self.lr is not None and not self.lr > 0:
            fail("lr", "a positive number, or None")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("min_lr_ratio", "a number in [0, 1]")
        if self.weight_decay < 0:
            fail("weight_decay", "a number >= 0")
        if self.gradient_clipping < 0:
            fail("gradient_clipping", "0 (off) or a positive max norm")
        if (len(self.mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in self.mesh)):
            fail("mesh", "(nodes, local) with both >= 1, e.g. (2, 4)")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", "0, 1, 2, 3 or None")
        if self.persistence_threshold is not None and (
                not isinstance(self.persistence_threshold, int) or self.persistence_threshold < 0):
            fail("persistence_threshold", "an integer >= 0, or None")
        if not 0 < self.val_fraction < 1:
            fail("val_fraction", "a number in (0, 1)")
        if self.temperature < 0:
            fail("temperature", "0 (greedy) or a positive number")

    @property
    def data_parallel_size(self) -> int:
        return self.mesh[0] * self.mesh[1]


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """The resolved training recipe: what the job config and the DeepSpeed JSON add up to."""

    zero: ZeroConfig
    optimizer: optax.GradientTransformation
    learning_rate: Callable[[Any], Any]        # optax count -> lr (for logging)
    batch_size: int
    source: str                                # where the recipe came from, for the summary


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    """What a finished run reports (also written to summary.json)."""

    steps: int
    tokens_seen: int
    final_train_loss: float         # mean loss on `eval_batches` fixed training batches
    final_val_loss: float           # same, on the held-out split
    tokens_per_s: float             # batch tokens / step_time_s
    step_time_s: float              # median step time after the first (compiling) step
    compile_time_s: float           # the first step, compilation included
    wall_time_s: float
    memory: Mapping[str, int]       # per-device bytes from zeroxla.memory_report
    memory_table: str
    samples: str
    paths: Mapping[str, str | None]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "memory": dict(self.memory),
                "paths": dict(self.paths)}


# ------------------------------------------------------------------------------------------------
# Resolving the recipe.


def _default_schedule(job: TrainJobConfig, peak: float) -> Callable[[Any], Any]:
    """Linear warmup from 0 to `peak` over warmup_steps, then cosine to peak * min_lr_ratio."""
    warmup = min(job.warmup_steps, job.steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(job.steps, warmup + 1), end_value=peak * job.min_lr_ratio)


def _default_optimizer(job: TrainJobConfig,
                       schedule: Callable[[Any], Any]) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=job.weight_decay)


def _merge_job_into_deepspeed(job: TrainJobConfig, raw: dict, path: str) -> dict:
    """The DeepSpeed dict with the job's explicit settings added; a conflict is an error."""
    raw = json.loads(json.dumps(raw))      # a deep copy
    for option, key, value in (
            ("--zero-stage", "stage", job.zero_stage),
            ("--persistence-threshold", "stage3_param_persistence_threshold",
             job.persistence_threshold)):
        if value is None:
            continue
        zero = raw.setdefault("zero_optimization", {})
        if key in zero and zero[key] != value:
            raise ValueError(f"{option} {value} conflicts with zero_optimization.{key}="
                             f"{zero[key]} in {path}; give one")
        zero[key] = value
    if job.batch_size is not None:
        if "train_batch_size" in raw and raw["train_batch_size"] != job.batch_size:
            raise ValueError(f"--batch-size {job.batch_size} conflicts with train_batch_size="
                             f"{raw['train_batch_size']} in {path}; give one")
        raw["train_batch_size"] = job.batch_size
    elif "train_batch_size" not in raw and "train_micro_batch_size_per_gpu" not in raw:
        raw["train_batch_size"] = DEFAULT_BATCH_SIZE
    if job.lr is not None and ("optimizer" in raw or "scheduler" in raw):
        raise ValueError(f"--lr {job.lr} conflicts with the optimizer/scheduler sections of "
                         f"{path}, which set the learning rate; give one")
    return raw


def resolve_setup(job: TrainJobConfig) -> TrainingSetup:
    """The ZeRO config, optimizer, schedule and global batch size for `job` (no devices used)."""
    dp = job.data_parallel_size
    if job.deepspeed_config is None:
        batch = DEFAULT_BATCH_SIZE if job.batch_size is None else job.batch_size
        if batch % dp:
            raise ValueError(f"--batch-size {batch} is not a multiple of the {dp} data-parallel "
                             f"devices of --mesh {job.mesh[0]}x{job.mesh[1]}; use "
                             f"{max(dp, batch // dp * dp)}")
        schedule = _default_schedule(job, DEFAULT_LR if job.lr is None else job.lr)
        zero = ZeroConfig(
            stage=3 if job.zero_stage is None else job.zero_stage,
            persistence_threshold=job.persistence_threshold or 0,
            gradient_clipping=job.gradient_clipping)
        return TrainingSetup(zero=zero,
                             optimizer=_default_optimizer(job, schedule), learning_rate=schedule,
                             batch_size=batch, source="defaults (AdamW, warmup + cosine)")
    path = job.deepspeed_config
    raw, _ = ds_config.read_deepspeed_json(path)
    merged = _merge_job_into_deepspeed(job, raw, path)
    ds = ds_config.load_deepspeed_config(merged, data_parallel_size=dp, name=path)
    schedule = ds.learning_rate
    if schedule is None:
        schedule = _default_schedule(job, DEFAULT_LR if job.lr is None else job.lr)
    elif not callable(schedule):
        schedule = optax.constant_schedule(schedule)
    optimizer = ds.optimizer if ds.optimizer is not None else _default_optimizer(job, schedule)
    return TrainingSetup(zero=ds.zero, optimizer=optimizer, learning_rate=schedule,
                         batch_size=ds.train_batch_size, source=path)


# ------------------------------------------------------------------------------------------------
# Seams and helpers.


def save_final_checkpoint(step: Any, state: Any, out_dir: Path, *,
                          metadata: dict | None = None) -> Path:
    """Writes the final TrainState to `out_dir / "checkpoint"` (orbax, sharded; restorable onto
    any mesh with `zeroxla.restore` or `zeroxla train --resume`) and returns the step's path."""
    return checkpoint.save(out_dir / "checkpoint", state, step=step, metadata=metadata)


def _mesh_for(job: TrainJobConfig):
    nodes, local = job.mesh
    devices = jax.devices()
    # On a simulated CPU host the flag may have made more devices than the mesh needs.
    if devices[0].platform == "cpu" and len(devices) > nodes * local:
        devices = devices[:nodes * local]
    return make_mesh(nodes, local, devices=devices)


def _model_factory(job: TrainJobConfig, corpus: Corpus) -> Callable[[], Any]:
    _, preset = models.PRESETS[job.model]
    max_seq_len = preset().max_seq_len
    if job.seq_len > max_seq_len:
        raise ValueError(f"--seq-len {job.seq_len} exceeds the max_seq_len={max_seq_len} of "
                         f"--model {job.model}; accepted: --seq-len <= {max_seq_len}")
    # The tokenizer decides the vocabulary (65 characters for tiny-shakespeare, 256 bytes).
    return lambda: models.build(job.model, seed=job.seed, vocab_size=corpus.vocab_size)


def _mean_loss(step: Any, state: Any, batches: list[dict]) -> float:
    return float(np.mean([float(step.eval_loss(state, b)) for b in batches]))


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


# ------------------------------------------------------------------------------------------------
# The job.


def run(job: TrainJobConfig, *, write: Callable[[str], None] | None = None) -> TrainSummary:
    """Trains as `job` says and returns the summary (see the module docstring for the outputs).

    `write` prints a line without breaking the progress bar (default: tqdm.write to stdout).
    """
    from tqdm import tqdm

    write = write or (lambda line: tqdm.write(line))
    start = time.perf_counter()
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ds_config.DeepSpeedConfigWarning)
        setup = resolve_setup(job)
    for w in caught:          # DeepSpeed keys without effect: one plain line each
        if issubclass(w.category, ds_config.DeepSpeedConfigWarning):
            write(f"warning: {w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    corpus = load_corpus(job.data, tokenizer=job.tokenizer, val_fraction=job.val_fraction)
    mesh = _mesh_for(job)
    step = zeroxla.make_step(_model_factory(job, corpus), mesh, optimizer=setup.optimizer,
                             config=setup.zero)
    state, first_step = step.init(), 0
    if job.resume:
        # Any mesh, device count or stage: the checkpoint is re-laid out for this step.
        restored = checkpoint.restore(job.resume, step)
        state, first_step = restored.state, int(restored.metadata["data_position"])
        if first_step >= job.steps:
            raise ValueError(f"--resume {job.resume}: the checkpoint is at step {first_step}, "
                             f"but --steps is {job.steps}; accepted: --steps > {first_step}")
        write(f"resumed from {restored.path} at step {first_step}")

    batch, seq = setup.batch_size, job.seq_len
    train_plan = BatchPlan(len(corpus.train), batch, seq, seed=job.seed)
    val_plan = BatchPlan(len(corpus.val), batch, seq, seed=VALIDATION_SEED)
    train_eval_plan = BatchPlan(len(corpus.train), batch, seq, seed=VALIDATION_SEED)
    sharding = step.batch_sharding
    val_batches = [device_batch(corpus.val, val_plan, k, sharding)
                   for k in range(job.eval_batches)]
    write(f"zeroxla train: {job.model} on {corpus.source} ({len(corpus.train):,} train / "
          f"{len(corpus.val):,} val tokens, vocab {corpus.vocab_size}), ZeRO-{setup.zero.stage} "
          f"on a {job.mesh[0]}x{job.mesh[1]} mesh of {mesh.devices.flat[0].platform} devices, "
          f"batch {batch} x {seq} tokens, recipe: {setup.source}")

    metrics_path = out / "metrics.jsonl"
    records: list[dict] = []
    step_times: list[float] = []
    tokens_per_step = batch * seq
    val_loss = float("nan")
    with open(metrics_path, "a" if first_step else "w", encoding="utf-8") as metrics_file, \
            tqdm(total=job.steps, initial=first_step, desc="train", unit="step",
                 disable=not job.progress, dynamic_ncols=True, mininterval=0.5) as bar:
        for k in range(first_step, job.steps):
            batch_k = device_batch(corpus.train, train_plan, k, sharding)
            t0 = time.perf_counter()
            state, metrics = step(state, batch_k)
            values = {name: float(v) for name, v in metrics.items()}   # waits for the step
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if not math.isfinite(values["loss"]):
                raise FloatingPointError(f"step {k + 1}: loss is {values['loss']}; lower --lr "
                                         "or enable gradient clipping in --config")
            record = {"step": k + 1, **values, "lr": float(setup.learning_rate(k)),
                      "step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
            records.append(record)
            metrics_file.write(json.dumps(record) + "\n")
            bar.set_postfix_str(f"loss {values['loss']:.3f}  {tokens_per_step / dt:,.0f} tok/s  "
                                f"{dt * 1e3:.0f} ms/step", refresh=False)
            bar.update(1)
            if (k + 1) % job.eval_every == 0 or k + 1 == job.steps:
                val_loss = _mean_loss(step, state, val_batches)
                val_record = {"step": k + 1, "val_loss": val_loss}
                records.append(val_record)
                metrics_file.write(json.dumps(val_record) + "\n")
                metrics_file.flush()
                write(f"step {k + 1:>6}: train loss {values['loss']:.4f}  "
                      f"validation loss {val_loss:.4f}")

    train_loss = _mean_loss(step, state, [device_batch(corpus.train, train_eval_plan, k, sharding)
                                          for k in range(job.eval_batches)])
    # The median step after the first (compiling) one: robust to a recompile or a busy host.
    step_time = float(np.median(step_times[1:] or step_times))
    report = zeroxla.memory_report(step, state, val_batches[0])

    plot_path = out / "loss_curve.png"
    _write_plot(plot_path, records, f"{job.model} on {corpus.source}: ZeRO-{setup.zero.stage}, "
                f"mesh {job.mesh[0]}x{job.mesh[1]}, batch {batch}x{seq}")
    checkpoint_path = save_final_checkpoint(step, state, out, metadata={
        "data_position": job.steps, "seed": job.seed, "model": job.model})

    model = zeroxla.gathered_model(step, state)
    try:
        prompt = corpus.tokenizer.encode("\n")
    except ValueError:
        prompt = corpus.val[:1]
    samples = sample_text(model, corpus.tokenizer, prompt, num_tokens=job.sample_tokens,
                          context=seq, temperature=job.temperature, seed=job.seed)

    summary_path = out / "summary.json"
    summary = TrainSummary(
        steps=job.steps, tokens_seen=(job.steps - first_step) * tokens_per_step,
        final_train_loss=train_loss, final_val_loss=val_loss,
        tokens_per_s=tokens_per_step / step_time, step_time_s=step_time,
        compile_time_s=step_times[0], wall_time_s=time.perf_counter() - start,
        memory={k: int(v) for k, v in report.to_dict().items() if isinstance(v, (int, float))},
        memory_table=report.table(),
        samples=samples,
        paths={"metrics": str(metrics_path), "loss_curve": str(plot_path),
               "summary": str(summary_path),
               "checkpoint": str(checkpoint_path)})
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump({"job": dataclasses.asdict(job), **summary.to_dict()}, f, indent=2)
    return summary


def format_summary(summary: TrainSummary) -> str:
    """The end-of-run report `zeroxla train` prints."""
    sample = "\n".join("    " + line for line in summary.samples.splitlines())
    return "\n".join([
        "",
        "=== summary ===",
        f"steps                 {summary.steps}  ({summary.tokens_seen:,} tokens)",
        f"final train loss      {summary.final_train_loss:.4f}",
        f"final validation loss {summary.final_val_loss:.4f}",
        f"throughput            {summary.tokens_per_s:,.0f} tokens/s  "
        f"({summary.step_time_s * 1e3:.1f} ms/step, median; first step with compilation "
        f"{summary.compile_time_s:.1f} s)",
        f"wall time             {summary.wall_time_s:.1f} s",
        "per-device memory (zeroxla.memory_report):",
        "\n".join("    " + line for line in summary.memory_table.splitlines()),
        "",
        "=== sample (temperature sampling from the trained model) ===",
        sample,
        "",
        "=== written ===",
        f"metrics      {summary.paths['metrics']}",
        f"loss curve   {summary.paths['loss_curve']}",
        f"summary      {summary.paths['summary']}",
        f"checkpoint   {summary.paths['checkpoint']}",
    ])


__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_LR", "TrainJobConfig", "TrainSummary", "TrainingSetup",
           "format_summary", "resolve_setup", "run", "save_final_checkpoint"]
