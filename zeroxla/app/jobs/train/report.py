"""What a `zeroxla train` run reports: its settings, the loss curve, the end-of-run sample and
the summary.

    run_settings      every value the run used (summary.json's "settings", each checkpoint's too)
    write_plot        loss_curve.png: train and validation loss against step
    final_sample      the prompt continued by the trained model (Hybrid Engine, KV cache);
                      `check_sample` builds its engine before the training (refusals first)
    TrainSummary      what a finished run reports; `write_summary` writes it as summary.json
    format_summary    the report `zeroxla train` prints

`zeroxla.app.jobs.train.job.TrainJob` builds these at the end of a run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

import zeroxla
from zeroxla.app.sampling import local_zero3_step, sample_with_engine
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.app.jobs.train.config import TrainJobConfig
from zeroxla.app.jobs.train.data import SFTData, TextData
from zeroxla.app.jobs.train.options import DTYPE_NAMES
from zeroxla.app.jobs.train.recipe import TrainingSetup


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
    parameters: Mapping[str, int]   # `parameter_counts`: total and trainable elements
    memory_table: str
    samples: str
    paths: Mapping[str, str | None]
    resumed_from_step: int = 0      # 0: trained from scratch

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "memory": dict(self.memory),
                "parameters": dict(self.parameters), "paths": dict(self.paths)}


def _peak_lr(schedule: Callable[[Any], Any], steps: int) -> float:
    """The largest learning rate of the run, to float32's 7 digits (0.01, not 0.0099999998)."""
    return float(f"{float(np.max(np.asarray(schedule(np.arange(steps))))):.7g}")


def run_settings(job: TrainJobConfig, setup: TrainingSetup,
                 data: TextData | SFTData) -> dict[str, Any]:
    """Every value the run uses, by the options' names (summary.json's "settings", with the run
    directory as "out_dir"; also stored in each checkpoint, and compared on --resume)."""
    zero, schedule, run = setup.zero, job.schedule, job.run
    settings = {
        "model": job.model_name, "data": data.source,
        "tokenizer": tokenizer_record(data.tokenizer)["kind"], "vocab_size": data.vocab_size,
        "steps": schedule.steps, "batch_size": schedule.batch_size,
        "micro_batch_size": job.micro_batch_size,
        "seq_len": job.data.seq_len, "lr": _peak_lr(setup.learning_rate, schedule.steps),
        "lr_schedule": setup.source, "warmup_steps": schedule.warmup_steps,
        "mesh": "x".join(map(str, job.sharding.mesh)), "pipeline_stages": job.pipeline.stages,
        "sequence_parallel_size": job.sharding.sequence_parallel_size,
        "expert_parallel_size": job.sharding.expert_parallel_size,
        "processes": jax.process_count(),
        "zero_stage": zero.stage, "persistence_threshold": zero.persistence_threshold,
        "dtype": DTYPE_NAMES[zero.compute_dtype],
        "loss_scaling": ("off" if not zero.uses_loss_scaling else "dynamic"
                         if zero.loss_scale == 0 else f"static {zero.loss_scale:g}"),
        "grad_accum": zero.gradient_accumulation_steps,
        "offload_optimizer": zero.offload_optimizer, "offload_param": zero.offload_param,
        "gradient_clipping": zero.gradient_clipping,
        "check_grad_overflow": zero.check_grad_overflow, "seed": run.seed,
        "eval_every": run.eval_every, "eval_batches": run.eval_batches,
        "save_every": run.save_every, "keep_last": run.keep_last,
        "sample_tokens": run.sample_tokens, "temperature": run.temperature,
    }
    if job.deepspeed_config is not None:
        settings["deepspeed_config"] = job.deepspeed_config
    if job.lora.enabled:
        settings.update(lora_dim=job.lora.dim, lora_alpha=job.lora.alpha,
                        lora_module_name=job.lora.module_name,
                        only_optimize_lora=job.lora.only_optimize_lora)
    return settings


def write_plot(path: Path, records: list[dict], title: str) -> None:
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


def _samples_on_step(job: TrainJobConfig) -> bool:
    """Whether the closing sample reads the trained state in the step's own layout (one
    process, no pipeline); else it runs on the gathered weights (`final_sample`)."""
    return jax.process_count() == 1 and job.pipeline.stages == 1


def check_sample(step: Any, job: TrainJobConfig) -> None:
    """Builds (and drops) the Hybrid Engine the closing sample will read `step`'s states with,
    before the first step: what the engine refuses of the step's layout (a model without the
    KV-cache protocol, a storage it cannot read) is refused before the training, not after
    it. Nothing to check without a sample, or when it runs on the gathered weights."""
    if job.run.sample_tokens and _samples_on_step(job):
        zeroxla.HybridEngine(step.layout,
                             zeroxla.HybridEngineConfig(max_out_tokens=job.data.seq_len))


def final_sample(step: Any, state: Any, data: TextData | SFTData, prompt: np.ndarray,
                 job: TrainJobConfig, write: Callable[[str], None]) -> str:
    """The end-of-run sample: `prompt` continued by `--sample-tokens` tokens, generated by the
    Hybrid Engine (KV cache) from the trained state. Prompt + sample stop at `--seq-len`, the
    positions the model was trained on (GPT's learned positions end at max_seq_len, and those
    past the training length are untrained); a longer request is capped, and the run says so.
    With several processes, or a pipelined step, each process generates on its own devices
    from the gathered weights, the way `zeroxla generate` does from a checkpoint."""
    run, seq_len = job.run, job.data.seq_len
    if run.sample_tokens == 0:
        return data.tokenizer.decode(np.asarray(prompt))
    if not _samples_on_step(job):
        step = local_zero3_step(_host_model(state))
        state = step.init()
    text, new = sample_with_engine(step, state, data.tokenizer, prompt,
                                   num_tokens=run.sample_tokens, max_len=seq_len,
                                   temperature=run.temperature, seed=run.seed)
    if new < run.sample_tokens:
        write(f"sample: {new} new tokens, not --sample-tokens {run.sample_tokens}: prompt + "
              f"sample are capped at --seq-len {seq_len}, the positions the model was "
              "trained on")
    return text


def write_summary(path: Path, settings: Mapping[str, Any], summary: TrainSummary) -> None:
    """summary.json: the run's settings and its TrainSummary."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"settings": settings, **summary.to_dict()}, f, indent=2)


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
        f"parameters            {summary.parameters['trainable']:,} trainable of "
        f"{summary.parameters['total']:,}",
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


__all__ = ["TrainSummary", "check_sample", "final_sample", "format_summary", "run_settings",
           "write_plot", "write_summary"]
