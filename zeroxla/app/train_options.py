"""`zeroxla train`'s options, in one table: each option's flag, the `TrainJobConfig` field it
sets, its parser, its help, and where it lands in a DeepSpeed config.

Everything that names an option is generated from `OPTIONS`: the argparse declarations
(`add_options`), the fields a command line gives (`explicit_fields`, which `--resume` lets win over
the run's saved job), the names in messages (`OPTION_NAMES`, `describe_resume`), and the typed
DeepSpeed overrides of a `--config` run (`deepspeed_overrides`: `--zero-stage 3` is
`Override("zero.stage", 3, "--zero-stage 3")`). A new option is one row here and one
`TrainJobConfig` field.

Every option defaults to None ("not given"), so a resumed run can tell what the command line
sets; `TrainJobConfig`'s defaults apply after that. Nothing here uses JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from zeroxla.app.cli_args import (mesh_shape, non_negative_int, positive_float, positive_int,
                                  temperature)
from zeroxla.app.job import (DEFAULT_BATCH_SIZE, DEFAULT_LR, DTYPES, OFFLOAD_DEVICES,
                             PER_INVOCATION, TrainJobConfig)
from zeroxla.deepspeed.overrides import Override
from zeroxla.inference.sampling import TEMPERATURE_RULE

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainJobConfig)}
# --help groups, in order.
THEMES = {"model": "model and data", "schedule": "schedule", "parallel": "parallelism and recipe",
          "run": "the run"}


@dataclasses.dataclass(frozen=True)
class JobOption:
    """One `zeroxla train` option.

    flag / field: "--zero-stage" sets TrainJobConfig.zero_stage (also the argparse dest).
    deepspeed: with --config, the `Override` target it is (None: not a DeepSpeed setting);
    to_deepspeed turns the job value into the Override's value ("fp16" -> "float16").
    action: "store_false" for a switch whose flag turns a field off (--no-progress).
    """

    flag: str
    field: str
    theme: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    deepspeed: str | None = None
    to_deepspeed: Callable[[Any], Any] | None = None
    action: str | None = None

    def add_to(self, parser: argparse.ArgumentParser | Any) -> None:
        kwargs: dict[str, Any] = {"dest": self.field, "default": None, "help": self.help}
        if self.action is not None:
            kwargs["action"] = self.action
        else:
            kwargs.update(type=self.type, choices=self.choices, metavar=self.metavar)
        parser.add_argument(self.flag, **kwargs)


def _default(field: str) -> str:
    value = _DEFAULTS[field]
    return f"{value[0]}x{value[1]}" if field == "mesh" else f"{value}"


OPTIONS: tuple[JobOption, ...] = (
    # model and data
    JobOption("--model", "model", "model",
              f"models/ preset (gpt-tiny, gpt-small, llama-tiny, ...); default {_default('model')}"),
    JobOption("--init-from", "init_from", "model",
              "start from a pretrained Hugging Face checkpoint (GPT-2 or Llama: config.json, "
              "safetensors, tokenizer.json), loaded straight into its ZeRO partitions; its model "
              "and tokenizer replace --model/--tokenizer", metavar="HF_DIR"),
    JobOption("--data", "data", "model",
              "UTF-8 text file (.gz ok), or supervised fine-tuning examples: a .jsonl of "
              "{\"prompt\", \"response\"} lines (DeepSpeed-Chat's \"chosen\" also read) or a "
              ".json array of those objects (.gz ok), the loss on the response tokens only. "
              "Examples with no loss token (an empty response and no EOS token) are counted and "
              "reported; a file (or its train or validation split) in which no example has one "
              "is refused. A file not named .jsonl/.json that holds such records is refused, "
              "not read as text; default: the bundled tiny-shakespeare", metavar="PATH"),
    JobOption("--tokenizer", "tokenizer", "model",
              "character-level (vocabulary from the corpus) or UTF-8 byte-level; default char "
              "(with --init-from: the checkpoint's own)", choices=("char", "byte")),
    # schedule
    JobOption("--steps", "steps", "schedule", f"training steps; default {_default('steps')}",
              type=positive_int),
    JobOption("--batch-size", "batch_size", "schedule",
              "global batch (DeepSpeed's train_batch_size); default: from --config, else "
              f"{DEFAULT_BATCH_SIZE}", type=positive_int, deepspeed="train_batch_size"),
    JobOption("--seq-len", "seq_len", "schedule",
              "tokens per sequence (at most the model's max_seq_len); default "
              f"{_default('seq_len')}", type=positive_int),
    JobOption("--lr", "lr", "schedule",
              "peak learning rate of the default warmup + cosine AdamW recipe (not with a "
              f"--config that has an optimizer or scheduler); default {DEFAULT_LR:g}",
              type=positive_float),
    JobOption("--warmup-steps", "warmup_steps", "schedule",
              f"linear warmup steps; default {_default('warmup_steps')}", type=non_negative_int),
    # parallelism and recipe
    JobOption("--mesh", "mesh", "parallel",
              f"device mesh; on CPU the devices are simulated; default {_default('mesh')}",
              type=mesh_shape, metavar="NODESxLOCAL"),
    JobOption("--pipeline-stages", "pipeline_stages", "parallel",
              "pipeline the model's layers over S stages (1F1B, --grad-accum micro-batches), "
              "each stage a --mesh of data-parallel devices: S x nodes x local devices in all; "
              "default 1 (no pipeline)", type=positive_int, metavar="S"),
    JobOption("--zero-stage", "zero_stage", "parallel",
              "ZeRO stage (default 3, or zero_optimization.stage from --config)", type=int,
              choices=(0, 1, 2, 3), deepspeed="zero.stage"),
    JobOption("--dtype", "dtype", "parallel",
              "compute dtype; master weights and optimizer state stay float32; fp16 adds "
              "DeepSpeed's dynamic loss scaling (default fp32, or the fp16/bf16 section of "
              "--config)", choices=tuple(DTYPES), deepspeed="zero.compute_dtype",
              to_deepspeed=DTYPES.__getitem__),
    JobOption("--grad-accum", "grad_accum", "parallel",
              "micro-batches per step (DeepSpeed's gradient_accumulation_steps); the batch is "
              "split N ways (default 1, or from --config)", type=positive_int, metavar="N",
              deepspeed="gradient_accumulation_steps"),
    JobOption("--persistence-threshold", "persistence_threshold", "parallel",
              "parameters with fewer elements stay replicated (DeepSpeed's "
              "stage3_param_persistence_threshold); default: from --config, else 0 (partition "
              "every leaf of the tiny default model)", type=non_negative_int, metavar="N",
              deepspeed="zero.persistence_threshold"),
    JobOption("--offload-optimizer", "offload_optimizer", "parallel",
              "ZeRO-Offload: keep the optimizer state and float32 masters in host memory "
              "(DeepSpeed's offload_optimizer.device; stage >= 1); default none, or from --config",
              choices=OFFLOAD_DEVICES, deepspeed="zero.offload_optimizer"),
    JobOption("--offload-param", "offload_param", "parallel",
              "ZeRO-Infinity's parameter offload (DeepSpeed's offload_param.device): 'cpu' keeps "
              "every stage-3 parameter partition (the float32 master) in pinned host memory "
              "between steps, copies each layer's partition to the device just before its "
              "all-gather and drops it after, and runs the update on the host; needs --zero-stage "
              "3, not with --pipeline-stages; default none, or from --config",
              choices=OFFLOAD_DEVICES,
              deepspeed="zero.offload_param"),
    JobOption("--config", "deepspeed_config", "parallel",
              "a DeepSpeed JSON config (batch sizes, optimizer, scheduler, fp16/bf16, "
              "zero_optimization); as in DeepSpeed, no zero_optimization means stage 0",
              metavar="DS_CONFIG.json"),
    # the run
    JobOption("--out", "out_dir", "run",
              "run directory; default: a fresh runs/<model>-<YYYYmmdd-HHMMSS> (the resumed run's "
              "own directory with --resume). A directory that holds another run is refused",
              metavar="DIR"),
    JobOption("--seed", "seed", "run",
              f"model init, data order and sampling; default {_default('seed')}",
              type=non_negative_int),
    JobOption("--eval-every", "eval_every", "run",
              f"validation every N steps (and at the end); default {_default('eval_every')}",
              type=positive_int),
    JobOption("--eval-batches", "eval_batches", "run",
              f"validation batches per evaluation; default {_default('eval_batches')}",
              type=positive_int),
    JobOption("--save-every", "save_every", "run",
              "save a checkpoint every N steps (DeepSpeed's checkpoint interval); the final step "
              "is always saved; default 0: only the final one", type=non_negative_int,
              metavar="N"),
    JobOption("--keep-last", "keep_last", "run",
              "keep only the newest K step checkpoints, deleting older ones after a newer one is "
              "committed (torchtitan's keep_latest_k); default 0: keep all",
              type=non_negative_int, metavar="K"),
    JobOption("--sample-tokens", "sample_tokens", "run",
              "tokens generated from the trained model at the end (Hybrid Engine, KV cache; 0: "
              "none). Prompt + sample stop at --seq-len, the positions the model was trained on: "
              "a larger value is capped there and the run says so; default "
              f"{_default('sample_tokens')}", type=non_negative_int),
    JobOption("--temperature", "temperature", "run",
              f"sampling temperature of the closing sample: {TEMPERATURE_RULE}; default "
              f"{_default('temperature')}",
              type=temperature),
    JobOption("--no-progress", "progress", "run", "no progress bar", action="store_false"),
    JobOption("--resume", "resume", "run",
              "continue a run: its directory, its checkpoint/ or one step in it (the newest "
              "complete checkpoint by default). The run's own settings (model, data, mesh, ZeRO "
              "stage, dtype, batch, ...) are restored unless given here; metrics.jsonl is "
              "appended", metavar="DIR"),
)

# TrainJobConfig field -> its flag, for messages.
OPTION_NAMES: Mapping[str, str] = {o.field: o.flag for o in OPTIONS}


def add_options(parser: argparse.ArgumentParser) -> None:
    """Declares every option of `OPTIONS`, grouped by theme in `--help`."""
    for theme, title in THEMES.items():
        group = parser.add_argument_group(title)
        for option in OPTIONS:
            if option.theme == theme:
                option.add_to(group)


def explicit_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainJobConfig fields the command line gives (options left out are not listed)."""
    return {o.field: getattr(args, o.field) for o in OPTIONS if getattr(args, o.field) is not None}


def deepspeed_overrides(job: TrainJobConfig) -> tuple[Override, ...]:
    """The job's settings that land in its DeepSpeed config, as typed overrides (each option
    set in `job` with a `deepspeed` target)."""
    out = []
    for option in OPTIONS:
        value = getattr(job, option.field)
        if option.deepspeed is None or value is None:
            continue
        convert = option.to_deepspeed or (lambda v: v)
        out.append(Override(option.deepspeed, convert(value), f"{option.flag} {value}"))
    return tuple(out)


def _show(name: str, value: Any) -> str:
    if name == "mesh" and isinstance(value, (list, tuple)):
        return "x".join(map(str, value))
    return str(value)


def describe_resume(saved_settings: Mapping[str, Any] | None,
                    explicit: Mapping[str, Any]) -> list[str]:
    """Lines saying what a resume kept from the run and what the command line changed.

    `saved_settings` are the settings the run used (its summary's "settings"); `explicit` the
    TrainJobConfig fields given on the command line (per-invocation ones are not compared).
    """
    if not saved_settings:
        return ["resume: the checkpoint records no zeroxla train settings; using the command "
                "line and the defaults"]
    explicit = {k: v for k, v in explicit.items() if k not in PER_INVOCATION}
    kept = [f"{OPTION_NAMES[name]} {_show(name, saved_settings[name])}"
            for name in ("model", "mesh", "zero_stage", "dtype", "grad_accum", "batch_size",
                         "seq_len", "steps") if name not in explicit and name in saved_settings]
    changed = [f"{OPTION_NAMES.get(name, name)} {_show(name, saved_settings[name])} -> "
               f"{_show(name, value)}" for name, value in explicit.items()
               if name in saved_settings
               and _show(name, saved_settings[name]) != _show(name, value)]
    lines = [f"resume: kept from the run: {', '.join(kept) or 'nothing listed'} (and its other "
             "settings)"]
    lines.append(f"resume: changed on the command line: {', '.join(changed) or 'nothing'}")
    return lines


__all__ = ["JobOption", "OPTIONS", "OPTION_NAMES", "THEMES", "add_options", "deepspeed_overrides",
           "describe_resume", "explicit_fields"]
