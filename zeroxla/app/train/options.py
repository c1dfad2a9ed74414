"""`zeroxla train`'s options, in one table: each option's flag, the field of the config tree it
sets (`zeroxla.app.train.config`), its parser, its help, and the DeepSpeed setting it is beside
a `--config` JSON.

Everything that names an option is generated from `OPTIONS`: the argparse declarations
(`add_options`), the options a command line gives (`given_options`, which `--resume` lets win
over the run's saved tree), the names in messages (`OPTION_NAMES`), the tree's sections with
the given values (`section_changes`: `dataclasses.replace` on each typed section) and the typed
DeepSpeed overrides of a `--config` run (`deepspeed_overrides`: `--zero-stage 3` is
`Overrides(stage=3)`). A new option is one row here and one field of a section.

Every option defaults to None ("not given"), so a resumed run can tell what the command line
sets; the tree's defaults (`zeroxla.app.train.defaults` for the engine's) apply after that, and
each option's help says its default and, where it differs from ZeroConfig's, why. Nothing here
uses JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from zeroxla.app.cli_args import (mesh_shape, non_negative_float, non_negative_int,
                                  positive_float, positive_int, temperature)
from zeroxla.app.train.config import (PRETRAINED, SECTIONS, Data, Model, Numerics, Offload,
                                      Pipeline, Run, Schedule, Sharding, TrainJobConfig)
from zeroxla.app.train.defaults import JSON_DEFAULTS, describe_default, job_default_of
from zeroxla.app.train.lora import LoRA
from zeroxla.deepspeed.overrides import Overrides
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD
from zeroxla.inference.sampling import TEMPERATURE_RULE
from zeroxla.sharding.config import OFFLOAD_DEVICES

# --dtype: the compute dtype (ZeroConfig.compute_dtype); master weights stay float32.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# --help groups, in order.
THEMES = {"model": "model and data", "schedule": "schedule", "parallel": "parallelism and recipe",
          "run": "the run"}


@dataclasses.dataclass(frozen=True)
class JobOption:
    """One `zeroxla train` option.

    flag / dest: "--zero-stage" is argparse's `zero_stage` (the name in messages, resume
    records and summary.json's settings). section / field: the tree field it sets
    (`Sharding`, "stage"; section None: a field of TrainJobConfig itself). to_tree turns the
    option's value into the field's ("fp16" -> "float16"). deepspeed: the `Overrides` field it is
    beside a --config JSON (None: not a DeepSpeed setting). action: "store_false" for a switch
    that turns a field off (--no-progress), BooleanOptionalAction for an on/off pair.
    """

    flag: str
    dest: str
    section: type | None
    field: str
    theme: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    to_tree: Callable[[Any], Any] | None = None
    deepspeed: str | None = None
    action: Any = None

    def __post_init__(self) -> None:
        owner = TrainJobConfig if self.section is None else self.section
        if self.field not in {f.name for f in dataclasses.fields(owner)}:
            raise ValueError(f"JobOption {self.flag}: {owner.__name__} has no field "
                             f"{self.field!r}")
        if self.deepspeed is not None and self.deepspeed not in {
                f.name for f in dataclasses.fields(Overrides)} - {"given_as"}:
            raise ValueError(f"JobOption {self.flag}: Overrides has no field {self.deepspeed!r}")

    def add_to(self, parser: argparse.ArgumentParser | Any) -> None:
        kwargs: dict[str, Any] = {"dest": self.dest, "default": None, "help": self.help}
        if self.action is not None:
            kwargs["action"] = self.action
        else:
            kwargs.update(type=self.type, choices=self.choices, metavar=self.metavar)
        parser.add_argument(self.flag, **kwargs)

    def tree_value(self, value: Any) -> Any:
        return value if self.to_tree is None else self.to_tree(value)


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


OPTIONS: tuple[JobOption, ...] = (
    # model and data
    JobOption("--model", "model", Model, "preset", "model",
              "models/ preset (gpt-tiny, gpt-small, llama-tiny, ...); default "
              f"{_default(Model, 'preset')}"),
    JobOption("--init-from", "init_from", Model, "init_from", "model",
              "start from a pretrained Hugging Face checkpoint of a family in docs/models.md (GPT-2, "
              "Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 2: config.json, "
              "safetensors, tokenizer.json), loaded straight into its ZeRO partitions; its model "
              "and tokenizer replace --model/--tokenizer", metavar="HF_DIR"),
    JobOption("--data", "data", Data, "path", "model",
              "UTF-8 text file (.gz ok), or supervised fine-tuning examples: a .jsonl of "
              "{\"prompt\", \"response\"} lines (DeepSpeed-Chat's \"chosen\" also read) or a "
              ".json array of those objects (.gz ok), the loss on the response tokens only; or "
              "{\"messages\": [{\"role\", \"content\"}, ...]} conversations, rendered with the "
              "--init-from checkpoint's chat template, the loss on the assistant's tokens. "
              "Examples with no loss token (an empty response and no EOS token) are counted and "
              "reported; a file (or its train or validation split) in which no example has one "
              "is refused. A file not named .jsonl/.json that holds such records is refused, "
              "not read as text; default: the bundled tiny-shakespeare", metavar="PATH"),
    JobOption("--tokenizer", "tokenizer", Data, "tokenizer", "model",
              "character-level (vocabulary from the corpus) or UTF-8 byte-level; default char "
              "(with --init-from: the checkpoint's own)", choices=("char", "byte")),
    JobOption("--lora-dim", "lora_dim", LoRA, "dim", "model",
              "LoRA rank r (DeepSpeed-Chat's --lora_dim): adapters W + (alpha / r) A @ B on the "
              "weights --lora-module-name matches, B zero so step 0 is the base model; default "
              "0: no LoRA", type=non_negative_int, metavar="R"),
    JobOption("--lora-alpha", "lora_alpha", LoRA, "alpha", "model",
              "LoRA alpha: the adapters are scaled by alpha / r (PEFT's lora_alpha; "
              f"DeepSpeed-Chat's lora_scaling is alpha / r); default {_default(LoRA, 'alpha')}",
              type=positive_float),
    JobOption("--lora-module-name", "lora_module_name", LoRA, "module_name", "model",
              "regular expression searched in each weight's '/'-joined path (blocks/layers/wq): "
              "the weights that get adapters (DeepSpeed-Chat's --lora_module_name); one matching "
              f"nothing is refused; default {_default(LoRA, 'module_name')}", metavar="REGEX"),
    JobOption("--only-optimize-lora", "only_optimize_lora", LoRA, "only_optimize_lora",
              "model", "train the adapters alone: the base is frozen and optimizer state exists "
              "for the adapters only (needs --lora-dim > 0)",
              action="store_true"),
    # schedule
    JobOption("--steps", "steps", Schedule, "steps", "schedule",
              f"training steps; default {_default(Schedule, 'steps')}", type=positive_int),
    JobOption("--batch-size", "batch_size", Schedule, "batch_size", "schedule",
              "global batch (DeepSpeed's train_batch_size); default: from --config, else "
              f"{_default(Schedule, 'batch_size')}", type=positive_int,
              deepspeed="train_batch_size"),
    JobOption("--seq-len", "seq_len", Data, "seq_len", "schedule",
              "tokens per sequence (at most the model's max_seq_len); default "
              f"{_default(Data, 'seq_len')}", type=positive_int),
    JobOption("--lr", "lr", Schedule, "lr", "schedule",
              "peak learning rate of the default warmup + cosine AdamW recipe (not with a "
              "--config that has an optimizer or scheduler); default "
              f"{float(_default(Schedule, 'lr')):g}", type=positive_float),
    JobOption("--warmup-steps", "warmup_steps", Schedule, "warmup_steps", "schedule",
              f"linear warmup steps; default {_default(Schedule, 'warmup_steps')}",
              type=non_negative_int),
    # parallelism and recipe
    JobOption("--mesh", "mesh", Sharding, "mesh", "parallel",
              f"device mesh; on CPU the devices are simulated; default "
              f"{_default(Sharding, 'mesh')}", type=mesh_shape, metavar="NODESxLOCAL"),
    JobOption("--pipeline-stages", "pipeline_stages", Pipeline, "stages", "parallel",
              "pipeline the model's layers over S stages (1F1B, --grad-accum micro-batches), "
              "each stage a --mesh of data-parallel devices: S x nodes x local devices in all; "
              "default 1 (no pipeline)", type=positive_int, metavar="S"),
    JobOption("--zero-stage", "zero_stage", Sharding, "stage", "parallel",
              f"ZeRO stage; {describe_default('stage')}; {_beside_config('stage')}", type=int,
              choices=(0, 1, 2, 3), deepspeed="stage"),
    JobOption("--dtype", "dtype", Numerics, "compute_dtype", "parallel",
              "compute dtype; master weights and optimizer state stay float32; fp16 adds "
              "DeepSpeed's dynamic loss scaling; "
              f"{describe_default('compute_dtype', DTYPE_NAMES.get)}; with --config, its "
              "fp16/bf16 section", choices=tuple(DTYPES), to_tree=DTYPES.__getitem__,
              deepspeed="compute_dtype"),
    JobOption("--grad-accum", "grad_accum", Sharding, "gradient_accumulation_steps",
              "parallel", "micro-batches per step (DeepSpeed's gradient_accumulation_steps); the "
              "batch is split N ways; default 1, or from --config", type=positive_int,
              metavar="N", deepspeed="gradient_accumulation_steps"),
    JobOption("--persistence-threshold", "persistence_threshold", Sharding,
              "persistence_threshold", "parallel",
              "parameters with fewer elements stay replicated (DeepSpeed's "
              f"stage3_param_persistence_threshold); {describe_default('persistence_threshold')}"
              f"; {_beside_config('persistence_threshold')}",
              type=non_negative_int, metavar="N", deepspeed="persistence_threshold"),
    JobOption("--gradient-clipping", "gradient_clipping", Numerics, "gradient_clipping",
              "parallel",
              "clip the gradients' global norm (over all shards) to this (DeepSpeed's "
              f"gradient_clipping; 0: off); {describe_default('gradient_clipping')}; "
              f"{_beside_config('gradient_clipping')}", type=non_negative_float, metavar="NORM",
              deepspeed="gradient_clipping"),
    JobOption("--check-grad-overflow", "check_grad_overflow", Numerics, "check_grad_overflow",
              "parallel",
              "skip the update of a step whose gradients are not finite (DeepSpeed's "
              f"bf16.check_grad_overflow; fp16 always checks); "
              f"{describe_default('check_grad_overflow', _on_off)}; "
              f"{_beside_config('check_grad_overflow')}",
              action=argparse.BooleanOptionalAction, deepspeed="check_grad_overflow"),
    JobOption("--offload-optimizer", "offload_optimizer", Offload, "offload_optimizer",
              "parallel",
              "ZeRO-Offload: keep the optimizer state and float32 masters in host memory "
              "(DeepSpeed's offload_optimizer.device; stage >= 1); default none, or from --config",
              choices=OFFLOAD_DEVICES, deepspeed="offload_optimizer"),
    JobOption("--offload-param", "offload_param", Offload, "offload_param", "parallel",
              "ZeRO-Infinity's parameter offload (DeepSpeed's offload_param.device): 'cpu' keeps "
              "every stage-3 parameter partition (the float32 master) in pinned host memory "
              "between steps, copies each layer's partition to the device just before its "
              "all-gather and drops it after, and runs the update on the host; needs --zero-stage "
              "3, not with --pipeline-stages; default none, or from --config",
              choices=OFFLOAD_DEVICES, deepspeed="offload_param"),
    JobOption("--config", "deepspeed_config", None, "deepspeed_config", "parallel",
              _config_help(), metavar="DS_CONFIG.json"),
    # the run
    JobOption("--out", "out_dir", Run, "out_dir", "run",
              "run directory; default: a fresh runs/<model>-<YYYYmmdd-HHMMSS> (the resumed run's "
              "own directory with --resume). A directory that holds another run is refused",
              metavar="DIR"),
    JobOption("--seed", "seed", Run, "seed", "run",
              f"model init, data order and sampling; default {_default(Run, 'seed')}",
              type=non_negative_int),
    JobOption("--eval-every", "eval_every", Run, "eval_every", "run",
              f"validation every N steps (and at the end); default {_default(Run, 'eval_every')}",
              type=positive_int),
    JobOption("--eval-batches", "eval_batches", Run, "eval_batches", "run",
              f"validation batches per evaluation; default {_default(Run, 'eval_batches')}",
              type=positive_int),
    JobOption("--save-every", "save_every", Run, "save_every", "run",
              "save a checkpoint every N steps (DeepSpeed's checkpoint interval); the final step "
              "is always saved; default 0: only the final one", type=non_negative_int,
              metavar="N"),
    JobOption("--keep-last", "keep_last", Run, "keep_last", "run",
              "keep only the newest K step checkpoints, deleting older ones after a newer one is "
              "committed (torchtitan's keep_latest_k); default 0: keep all",
              type=non_negative_int, metavar="K"),
    JobOption("--sample-tokens", "sample_tokens", Run, "sample_tokens", "run",
              "tokens generated from the trained model at the end (Hybrid Engine, KV cache; 0: "
              "none). Prompt + sample stop at --seq-len, the positions the model was trained on: "
              "a larger value is capped there and the run says so; default "
              f"{_default(Run, 'sample_tokens')}", type=non_negative_int),
    JobOption("--temperature", "temperature", Run, "temperature", "run",
              f"sampling temperature of the closing sample: {TEMPERATURE_RULE}; default "
              f"{_default(Run, 'temperature')}", type=temperature),
    JobOption("--no-progress", "progress", Run, "progress", "run", "no progress bar",
              action="store_false"),
    JobOption("--resume", "resume", Run, "resume", "run",
              "continue a run: its directory, its checkpoint/ or one step in it (the newest "
              "complete checkpoint by default). The run's own settings (model, data, mesh, ZeRO "
              "stage, dtype, batch, ...) are restored unless given here; metrics.jsonl is "
              "appended", metavar="DIR"),
)

# argparse dest -> its flag, for messages.
OPTION_NAMES: Mapping[str, str] = {o.dest: o.flag for o in OPTIONS}
_BY_DEST = {o.dest: o for o in OPTIONS}


def add_options(parser: argparse.ArgumentParser) -> None:
    """Declares every option of `OPTIONS`, grouped by theme in `--help`."""
    for theme, title in THEMES.items():
        group = parser.add_argument_group(title)
        for option in OPTIONS:
            if option.theme == theme:
                option.add_to(group)


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the command line gives (dest -> value; options left out are not listed)."""
    return {o.dest: getattr(args, o.dest) for o in OPTIONS if getattr(args, o.dest) is not None}


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
            fields.setdefault(option.section.NAME, {})[option.field] = option.tree_value(value)
    if given.get("init_from") is not None:
        if "tokenizer" in given:
            raise ValueError(f"--tokenizer {given['tokenizer']} with --init-from "
                             f"{given['init_from']}: a pretrained model's vocabulary is its own "
                             "tokenizer's; leave --tokenizer out")
        fields.setdefault(Data.NAME, {})["tokenizer"] = PRETRAINED
    return {**root, **{name: dataclasses.replace(getattr(job, name), **changes)
                       for name, changes in fields.items() if name in SECTIONS}}


def _as_written(option: JobOption, value: Any) -> str:
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


__all__ = ["DTYPES", "DTYPE_NAMES", "JobOption", "OPTIONS", "OPTION_NAMES", "THEMES",
           "add_options", "deepspeed_overrides", "given_options", "json_default_text",
           "section_changes"]
