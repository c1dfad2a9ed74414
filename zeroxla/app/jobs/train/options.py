"""`zeroxla train`'s options, in one table: each option's flag, the field of the config tree it
sets (`zeroxla.app.jobs.train.config`), its parser, its help, and the DeepSpeed setting it is beside
a `--config` JSON.

The rows are `zeroxla.app.run.options.Option`s, as every job's: train's own here, and the
rows every job shares (`--mesh`, `--zero-stage`, the run's, LoRA's) from there. Everything that
names an option is generated from `OPTIONS` (`TABLE`): the argparse declarations
(`add_options`), the options a command line gives (`given_options`, which `--resume` lets win
over the run's saved tree), the names in messages (`OPTION_NAMES`), the tree's sections with
the given values (`section_changes`: `dataclasses.replace` on each typed section) and the typed
DeepSpeed overrides of a `--config` run (`deepspeed_overrides`: `--zero-stage 3` is
`Overrides(stage=3)`). A new option is one row here and one field of a section.

Every option defaults to None ("not given"), so a resumed run can tell what the command line
sets; the tree's defaults (`zeroxla.app.jobs.train.defaults` for the engine's) apply after that, and
each option's help says its default and, where it differs from ZeroConfig's, why. Nothing here
uses JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroxla.app.cli_args import (non_negative_float, non_negative_int, positive_float,
                                  positive_int, temperature)
from zeroxla.app.tokenizers.basic import TOKENIZERS
from zeroxla.app.run.options import (DATA_FORMS, LORA_OPTIONS, RUN_OPTIONS, SHARDING_OPTIONS,
                                     Option, OptionTable)
from zeroxla.app.jobs.train.config import (PRETRAINED, SECTIONS, Data, Model, Run, Schedule,
                                           TrainJobConfig)
from zeroxla.app.jobs.train.defaults import JSON_DEFAULTS, describe_default, job_default_of
from zeroxla.deepspeed.overrides import Overrides
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD
from zeroxla.inference.sampling import TEMPERATURE_RULE
from zeroxla.sharding.config import OFFLOAD_DEVICES, SEQUENCE_PARALLEL_STRATEGIES

# --dtype: the compute dtype (ZeroConfig.compute_dtype); master weights stay float32.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# --help groups, in order.
THEMES = {"model": "model and data", "lora": "LoRA: adapters on the model's weights",
          "schedule": "schedule", "parallel": "parallelism and recipe", "run": "the run"}


def _default(section: type, field: str) -> str:
    value = {f.name: f.default for f in dataclasses.fields(section)}[field]
    return f"{value[0]}x{value[1]}" if field == "mesh" else f"{value}"


def _on_off(value: bool) -> str:
    return "on" if value else "off"


# What a --config JSON that leaves a key out runs with: DeepSpeed's default, in --config's help.
_JSON_DEFAULT_WORDS = {"stage": "stage {} (plain data parallelism)",
                       "persistence_threshold": "a threshold of {:,}",
                       "gradient_clipping": "clipping {} (off)"}


def json_default_text(field: str) -> str:
    """--config's words for DeepSpeed's default of ZeroConfig `field`: "stage 0 (plain data
    parallelism) without zero_optimization.stage"."""
    return (f"{_JSON_DEFAULT_WORDS[field].format(JSON_DEFAULTS[field])} without "
            f"{KEY_OF_FIELD[field]}")


def _beside_config(field: str) -> str:
    """What a --config JSON does to the ZeroConfig `field` of an option."""
    row = job_default_of(field)
    if row is not None and row.with_config:
        return f"also with --config, unless it sets {KEY_OF_FIELD[field]}"
    return f"with --config, its {KEY_OF_FIELD[field]} or DeepSpeed's default"


def _config_help() -> str:
    """--config's help: what the JSON sets, and DeepSpeed's defaults for what it leaves out."""
    left_out = ", ".join(json_default_text(f) for f in _JSON_DEFAULT_WORDS)
    return ("a DeepSpeed JSON config (batch sizes, optimizer, scheduler, fp16/bf16, "
            "zero_optimization), read into the job's settings; options given beside it must "
            "agree with the keys it sets. As in DeepSpeed, a key it leaves out takes DeepSpeed's "
            f"default, not this command's: {left_out}; --check-grad-overflow stays on unless "
            "it sets bf16.check_grad_overflow")


OPTIONS: tuple[Option, ...] = (
    # model and data
    Option("--model", "model", "model", "preset", "model",
              "models/ preset (gpt-tiny, gpt-small, llama-tiny, ...); default "
              f"{_default(Model, 'preset')}"),
    Option("--init-from", "init_from", "model", "init_from", "model",
              "start from a pretrained Hugging Face checkpoint of a family in docs/models.md (GPT-2, "
              "Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 2: config.json, "
              "safetensors, tokenizer.json), loaded straight into its ZeRO partitions; its model "
              "and tokenizer replace --model/--tokenizer", metavar="HF_DIR"),
    Option("--data", "data", "data", "path", "model",
              "UTF-8 text file (.gz ok), or supervised fine-tuning examples, "
              f"{DATA_FORMS}, of {{\"prompt\", \"response\"}} rows (TRL's \"completion\" and "
              "DeepSpeed-Chat's \"chosen\" also read), the loss on the response tokens only; or "
              "{\"messages\": [{\"role\", \"content\"}, ...]} conversations (or TRL's "
              "conversational prompt and completion), rendered with the --init-from "
              "checkpoint's chat template, the loss on the assistant's tokens. "
              "Examples with no loss token (an empty response and no EOS token) are counted and "
              "reported; a file (or its train or validation split) in which no example has one "
              "is refused. A file not named .jsonl/.json that holds such records is refused, "
              "not read as text; default: the bundled tiny-shakespeare", metavar="PATH"),
    Option("--split", "split", "data", "split", "model",
           "the split of a --data directory saved by a datasets DatasetDict (train, test, ...)",
           metavar="NAME"),
    Option("--tokenizer", "tokenizer", "data", "tokenizer", "model",
              "character-level (vocabulary from the corpus) or UTF-8 byte-level; default char "
              "(with --init-from: the checkpoint's own)", choices=TOKENIZERS),
    Option("--packing", "packing", "data", "packing", "model",
           "supervised fine-tuning: pack whole examples into each --seq-len row, told apart by "
           "segment ids (attention stays within an example, positions restart; the loss equals "
           "the padded rows', TRL's packing / verl's use_remove_padding), so --batch-size counts "
           "rows of --seq-len tokens, not examples; validation rows stay padded; --no-packing: "
           "one example per row; text data is never padded; default on",
           action=argparse.BooleanOptionalAction),
    # schedule
    Option("--steps", "steps", "schedule", "steps", "schedule",
              f"training steps; default {_default(Schedule, 'steps')}", type=positive_int),
    Option("--batch-size", "batch_size", "schedule", "batch_size", "schedule",
              "global batch (DeepSpeed's train_batch_size); default: from --config, else "
              f"{_default(Schedule, 'batch_size')}", type=positive_int,
              deepspeed="train_batch_size"),
    Option("--seq-len", "seq_len", "data", "seq_len", "schedule",
              "tokens per sequence (at most the model's max_seq_len); default "
              f"{_default(Data, 'seq_len')}", type=positive_int),
    Option("--learning-rate", "lr", "schedule", "lr", "schedule",
           "peak learning rate of the default warmup + cosine AdamW recipe (not with a "
           "--config that has an optimizer or scheduler); --lr is the same option; default "
           f"{float(_default(Schedule, 'lr')):g}", type=positive_float, aliases=("--lr",)),
    Option("--warmup-steps", "warmup_steps", "schedule", "warmup_steps", "schedule",
              f"linear warmup steps; default {_default(Schedule, 'warmup_steps')}",
              type=non_negative_int),
    # parallelism and recipe
    Option("--pipeline-stages", "pipeline_stages", "pipeline", "stages", "parallel",
              "pipeline the model's layers over S stages (1F1B, --grad-accum micro-batches), "
              "each stage a --mesh of data-parallel devices: S x nodes x local devices in all; "
              "default 1 (no pipeline)", type=positive_int, metavar="S"),
    Option("--dtype", "dtype", "numerics", "compute_dtype", "parallel",
              "compute dtype; master weights and optimizer state stay float32; fp16 adds "
              "DeepSpeed's dynamic loss scaling; "
              f"{describe_default('compute_dtype', DTYPE_NAMES.get)}; with --config, its "
              "fp16/bf16 section", choices=tuple(DTYPES), to_tree=DTYPES.__getitem__,
              deepspeed="compute_dtype"),
    Option("--grad-accum", "grad_accum", "sharding", "gradient_accumulation_steps",
              "parallel", "micro-batches per step (DeepSpeed's gradient_accumulation_steps); the "
              "batch is split N ways; default 1, or from --config", type=positive_int,
              metavar="N", deepspeed="gradient_accumulation_steps"),
    Option("--persistence-threshold", "persistence_threshold", "sharding",
              "persistence_threshold", "parallel",
              "parameters with fewer elements stay replicated (DeepSpeed's "
              f"stage3_param_persistence_threshold); {describe_default('persistence_threshold')}"
              f"; {_beside_config('persistence_threshold')}",
              type=non_negative_int, metavar="N", deepspeed="persistence_threshold"),
    Option("--gradient-clipping", "gradient_clipping", "numerics", "gradient_clipping",
              "parallel",
              "clip the gradients' global norm (over all shards) to this (DeepSpeed's "
              f"gradient_clipping; 0: off); {describe_default('gradient_clipping')}; "
              f"{_beside_config('gradient_clipping')}", type=non_negative_float, metavar="NORM",
              deepspeed="gradient_clipping"),
    Option("--check-grad-overflow", "check_grad_overflow", "numerics", "check_grad_overflow",
              "parallel",
              "skip the update of a step whose gradients are not finite (DeepSpeed's "
              f"bf16.check_grad_overflow; fp16 always checks); "
              f"{describe_default('check_grad_overflow', _on_off)}; "
              f"{_beside_config('check_grad_overflow')}",
              action=argparse.BooleanOptionalAction, deepspeed="check_grad_overflow"),
    Option("--offload-optimizer", "offload_optimizer", "offload", "offload_optimizer",
              "parallel",
              "ZeRO-Offload: keep the optimizer state and float32 masters in host memory "
              "(DeepSpeed's offload_optimizer.device; stage >= 1); default none, or from --config",
              choices=OFFLOAD_DEVICES, deepspeed="offload_optimizer"),
    Option("--offload-param", "offload_param", "offload", "offload_param", "parallel",
              "ZeRO-Infinity's parameter offload (DeepSpeed's offload_param.device): 'cpu' keeps "
              "every stage-3 parameter partition (the float32 master) in pinned host memory "
              "between steps, copies each layer's partition to the device just before its "
              "all-gather and drops it after, and runs the update on the host; needs --zero-stage "
              "3, not with --pipeline-stages; default none, or from --config",
              choices=OFFLOAD_DEVICES, deepspeed="offload_param"),
    Option("--sequence-parallel-strategy", "sequence_parallel_strategy", "sharding",
              "sequence_parallel_strategy", "parallel",
              "attention under --sequence-parallel-size > 1: ulysses (DeepSpeed-Ulysses: the "
              "heads are split, so P divides them), allgather or ring (context parallelism: any "
              "head count, --seq-len a multiple of 2P; ring holds 1/P of the keys and values), "
              "usp (Ulysses in groups as far as the heads divide, a ring across them; --seq-len "
              "a multiple of 2P); default ulysses",
              choices=SEQUENCE_PARALLEL_STRATEGIES),
    Option("--config", "deepspeed_config", None, "deepspeed_config", "parallel",
              _config_help(), metavar="DS_CONFIG.json"),
    # the run
    Option("--eval-batches", "eval_batches", "run", "eval_batches", "run",
              f"validation batches per evaluation; default {_default(Run, 'eval_batches')}",
              type=positive_int),
    Option("--sample-tokens", "sample_tokens", "run", "sample_tokens", "run",
              "tokens generated from the trained model at the end (Hybrid Engine, KV cache; 0: "
              "none). Prompt + sample stop at --seq-len, the positions the model was trained on: "
              "a larger value is capped there and the run says so; default "
              f"{_default(Run, 'sample_tokens')}", type=non_negative_int),
    Option("--temperature", "temperature", "run", "temperature", "run",
              f"sampling temperature of the closing sample: {TEMPERATURE_RULE}; default "
              f"{_default(Run, 'temperature')}", type=temperature),
    *SHARDING_OPTIONS, *RUN_OPTIONS, *LORA_OPTIONS,
)

TABLE = OptionTable("train", TrainJobConfig, OPTIONS, THEMES)
# argparse dest -> its flag, for messages.
OPTION_NAMES: Mapping[str, str] = TABLE.names
_BY_DEST = TABLE.by_dest
_NOT_OVERRIDES = [o.flag for o in OPTIONS if o.deepspeed is not None and o.deepspeed not in {
    f.name for f in dataclasses.fields(Overrides)} - {"given_as"}]
if _NOT_OVERRIDES:
    raise ValueError(f"options {_NOT_OVERRIDES}: their `deepspeed` is no Overrides field")


def add_options(parser: argparse.ArgumentParser) -> None:
    """Declares every option of `OPTIONS`, grouped by theme in `--help`."""
    TABLE.add_to(parser)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the command line gives (dest -> value; options left out are not listed)."""
    return TABLE.given(args)


def _check_known(given: Mapping[str, Any]) -> None:
    unknown = sorted(set(given) - set(_BY_DEST))
    if unknown:
        raise ValueError(f"unknown zeroxla train option(s) {', '.join(unknown)}; accepted: "
                         + ", ".join(_BY_DEST))


def section_changes(job: TrainJobConfig, given: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainJobConfig fields `given` (dest -> value) changes: each section `dataclasses.
    replace`d with its given fields (and checked), and TrainJobConfig's own fields. --init-from
    without --tokenizer brings the checkpoint's own tokenizer; with it, it is refused."""
    _check_known(given)
    fields: dict[str, dict[str, Any]] = {}
    root: dict[str, Any] = {}
    for dest, value in given.items():
        option = _BY_DEST[dest]
        if option.section is None:
            root[option.field] = option.tree_value(value)
        else:
            fields.setdefault(option.section, {})[option.field] = option.tree_value(value)
    if given.get("init_from") is not None:
        if "tokenizer" in given:
            raise ValueError(f"--tokenizer {given['tokenizer']} with --init-from "
                             f"{given['init_from']}: a pretrained model's vocabulary is its own "
                             "tokenizer's; leave --tokenizer out")
        fields.setdefault(Data.NAME, {})["tokenizer"] = PRETRAINED
    return {**root, **{name: dataclasses.replace(getattr(job, name), **changes)
                       for name, changes in fields.items() if name in SECTIONS}}


def _as_written(option: Option, value: Any) -> str:
    """The option as a command line writes it: "--zero-stage 3", "--no-check-grad-overflow"."""
    if isinstance(value, bool):
        return option.flag if value else f"--no-{option.flag.removeprefix('--')}"
    return f"{option.flag} {value}"


def deepspeed_overrides(given: Mapping[str, Any]) -> Overrides:
    """The given options that are DeepSpeed settings, typed, as written for messages."""
    _check_known(given)
    values, written = {}, {}
    for dest, value in given.items():
        option = _BY_DEST[dest]
        if option.deepspeed is not None:
            values[option.deepspeed] = option.tree_value(value)
            written[option.deepspeed] = _as_written(option, value)
    return Overrides(**values, given_as=written)


__all__ = ["DTYPES", "DTYPE_NAMES", "OPTIONS", "TABLE", "OPTION_NAMES", "THEMES",
           "add_options", "deepspeed_overrides", "given_options", "json_default_text",
           "section_changes"]
