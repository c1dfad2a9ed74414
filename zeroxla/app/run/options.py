"""Every job's options as one kind of row, and the rows every job shares, declared once.

A row (`Option`) knows its flag, the field of the job's config tree it sets (`section`, the
tree's attribute holding a section dataclass, or None for the tree's own field; `field`), its
parser and its help. An `OptionTable` of a job's rows over its tree type generates everything
that names an option: the argparse declarations grouped by theme (`add_to`, so `--help` is the
rows), the options a command line gives (`given`: every option defaults to None, "not given",
so a resumed run can tell what the command line changes), the tree with them applied (`apply`:
each section `dataclasses.replace`d, an error naming the option) and the names in messages.

The rows shared by every job (`RUN_OPTIONS`: seed, cadence, --out, --resume, --no-progress;
`SHARDING_OPTIONS`: --mesh, --zero-stage, --sequence-parallel-size; `LORA_OPTIONS`) live here;
a job's own rows live beside its code. A help text's `{default}` is the tree's default for the
field and `{unit}` the job's unit ("step", "iteration"). Nothing here uses JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from zeroxla.app.cli_args import mesh_shape, non_negative_int, positive_float, positive_int
from zeroxla.app.run.trackers import PACKAGES, parse_report_to
from zeroxla.rlhf.rollout_correction import IS_LEVELS, RS_LEVELS, RS_STATISTICS
from zeroxla.sharding.config import ZERO_STAGES

_MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option of a job.

    flag / dest: "--zero-stage" is argparse's `zero_stage` (the name in messages and records).
    section / field: the tree field it sets ("sharding", "stage"; section None: a field of the
    tree itself). to_tree turns the option's value into the field's ("fp16" -> "float16").
    deepspeed: the `zeroxla.deepspeed.overrides.Overrides` field it is beside a DeepSpeed JSON
    (`zeroxla train --config`; None: not a DeepSpeed setting). action: "store_true" /
    "store_false" for a switch, BooleanOptionalAction for an on/off pair. aliases: other
    spellings argparse also accepts (an older or DeepSpeed-Chat name: "--lr" of
    "--learning-rate"); messages name `flag`. fixed: a resumed run
    cannot change it (the checkpoint's state or the frozen reference was built from it: the
    model it starts from, its adapters); `--resume` refuses another value, naming the option.
    exclusive: the rows of one name (all of one theme) are a mutually exclusive group: argparse
    refuses a command line that gives two of them ("--seq-len" or "--max-seq-len").
    """

    flag: str
    dest: str
    section: str | None
    field: str
    theme: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    to_tree: Callable[[Any], Any] | None = None
    deepspeed: str | None = None
    action: Any = None
    nargs: str | int | None = None
    fixed: bool = False
    aliases: tuple[str, ...] = ()
    exclusive: str | None = None

    @property
    def target(self) -> str:
        """The dotted tree field: "sharding.stage", or "steps" for the tree's own field."""
        return self.field if self.section is None else f"{self.section}.{self.field}"

    def tree_value(self, value: Any) -> Any:
        return value if self.to_tree is None else self.to_tree(value)


def _field_default(cls: type, name: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return field.default_factory()
    return _MISSING


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}x{value[1]}"                  # a mesh
    return "none" if value is None else str(value)


class OptionTable:
    """A job's rows over its tree type `tree`; `themes` orders and titles the --help groups."""

    def __init__(self, name: str, tree: type, rows: Iterable[Option],
                 themes: Mapping[str, str], unit: str = "step"):
        self.name, self.tree, self.rows, self.themes = name, tree, tuple(rows), dict(themes)
        self.unit = unit
        hints = typing.get_type_hints(tree)
        fields = {f.name for f in dataclasses.fields(tree)}
        self.by_dest: dict[str, Option] = {}
        for row in self.rows:
            owner = tree if row.section is None else _section_type(tree, row.section, hints)
            if row.section is not None and row.section not in fields or owner is None or (
                    row.field not in {f.name for f in dataclasses.fields(owner)}):
                raise ValueError(f"option {row.flag}: {tree.__name__} has no field "
                                 f"{row.target!r}")
            if row.theme not in self.themes:
                raise ValueError(f"option {row.flag}: theme {row.theme!r} is not one of "
                                 f"{', '.join(self.themes)}")
            if row.exclusive is not None and any(
                    other.exclusive == row.exclusive and other.theme != row.theme
                    for other in self.rows):
                raise ValueError(f"option {row.flag}: the rows of exclusive group "
                                 f"{row.exclusive!r} are not all of theme {row.theme!r}")
            if row.dest in self.by_dest:
                raise ValueError(f"options {self.by_dest[row.dest].flag} and {row.flag} share "
                                 f"the dest {row.dest!r}")
            self.by_dest[row.dest] = row
        self.names = {row.dest: row.flag for row in self.rows}
        self.by_target = {row.target: row.flag for row in self.rows}
        self.fixed = frozenset(row.target for row in self.rows if row.fixed)

    def row(self, target: str) -> Option:
        """The row that sets the dotted tree field `target`."""
        return next(row for row in self.rows if row.target == target)

    def default(self, row: Option) -> Any:
        """The tree's default of `row`'s field (dataclasses.MISSING where it has none)."""
        if row.section is None:
            return _field_default(self.tree, row.field)
        section = _field_default(self.tree, row.section)
        return _MISSING if section is _MISSING else getattr(section, row.field)

    def help(self, row: Option) -> str:
        default = self.default(row)
        shown = "no default" if default is _MISSING else _show(default)
        return row.help.replace("{default}", shown).replace("{unit}", self.unit)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Declares every row, grouped by theme in `--help` (an exclusive group's rows in one
        mutually exclusive group); every one defaults to None."""
        for theme, title in self.themes.items():
            group = parser.add_argument_group(title)
            exclusive: dict[str, Any] = {}
            for row in self.rows:
                if row.theme != theme:
                    continue
                kwargs: dict[str, Any] = {"dest": row.dest, "default": None,
                                          "help": self.help(row)}
                if row.action is not None:
                    kwargs["action"] = row.action
                else:
                    kwargs.update(type=row.type, choices=row.choices, metavar=row.metavar,
                                  nargs=row.nargs)
                if row.exclusive is not None and row.exclusive not in exclusive:
                    exclusive[row.exclusive] = group.add_mutually_exclusive_group()
                target = group if row.exclusive is None else exclusive[row.exclusive]
                target.add_argument(row.flag, *row.aliases, **kwargs)

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The options the command line gives (dest -> value; those left out not listed)."""
        return {row.dest: getattr(args, row.dest) for row in self.rows
                if getattr(args, row.dest, None) is not None}

    def apply(self, tree: Any, given: Mapping[str, Any]) -> Any:
        """`tree` with the `given` options set (sections replaced and checked, then the tree);
        a field's refusal names the option as typed."""
        unknown = sorted(set(given) - set(self.by_dest))
        if unknown:
            raise ValueError(f"unknown zeroxla {self.name} option(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(sorted(self.by_dest))}")
        sections: dict[str, dict[str, Any]] = {}
        root: dict[str, Any] = {}
        for dest, value in given.items():
            row = self.by_dest[dest]
            target = root if row.section is None else sections.setdefault(row.section, {})
            target[row.field] = row.tree_value(value)
        for name, changes in sections.items():
            try:
                root[name] = dataclasses.replace(getattr(tree, name), **changes)
            except (ValueError, TypeError) as err:
                raise ValueError(self._named(err, name, changes)) from None
        return dataclasses.replace(tree, **root)

    def build(self, given: Mapping[str, Any], **required: Any) -> Any:
        """A fresh tree: the defaults, the `required` fields the tree has no default for, and
        the `given` options over them."""
        return self.apply(self.tree(**required), given)

    def _named(self, err: Exception, section: str, changes: Mapping[str, Any]) -> str:
        """A section's refusal in the option's words: an error that carries its `field`,
        `value` and `accepted` (GRPOConfigError) as "FLAG VALUE is invalid; accepted: ...",
        another prefixed with the option as written."""
        text = str(err)
        flag = self.by_target.get(f"{section}.{getattr(err, 'field', '')}")
        if flag and hasattr(err, "value") and hasattr(err, "accepted"):
            return f"{flag} {err.value} is invalid; accepted: {err.accepted}"
        for field, value in changes.items():
            flag = self.by_target.get(f"{section}.{field}")
            if flag and f".{field}=" in text:
                written = flag if isinstance(value, bool) else f"{flag} {_show(value)}"
                return f"{written}: {text}"
        return text


def _section_type(tree: type, name: str, hints: Mapping[str, Any]) -> type | None:
    hint = hints.get(name)
    return hint if dataclasses.is_dataclass(hint) else None


def _positive_or_none(text: str) -> int | None:
    return None if text.lower() in ("none", "end") else positive_int(text)


# ------------------------------------------------------------------------------------------------
# The rows every job shares (section "run": `run.job.RunSettings`'s fields; "sharding": a
# section with `mesh`, `stage`, `sequence_parallel_size` and `expert_parallel_size`; "lora":
# `zeroxla.lora.LoRAConfig`'s fields).

RUN_OPTIONS: tuple[Option, ...] = (
    Option("--out", "out_dir", "run", "out_dir", "run",
           "run directory; default: a fresh runs/<job>-<YYYYmmdd-HHMMSS> (the resumed run's own "
           "directory with --resume). A directory that holds another run is refused",
           metavar="DIR"),
    Option("--seed", "seed", "run", "seed", "run",
           "model init, data order and sampling; default {default}", type=non_negative_int),
    Option("--eval-every", "eval_every", "run", "eval_every", "run",
           "evaluate every N {unit}s (and at the end); default {default}",
           type=_positive_or_none, metavar="N"),
    Option("--save-every", "save_every", "run", "save_every", "run",
           "save a checkpoint every N {unit}s (DeepSpeed's checkpoint interval); the final "
           "{unit} is always saved; default {default} (0: only the final one)",
           type=non_negative_int, metavar="N"),
    Option("--keep-last", "keep_last", "run", "keep_last", "run",
           "keep only the newest K checkpoints, deleting older ones after a newer one is "
           "committed (torchtitan's keep_latest_k); default {default} (0: keep all)",
           type=non_negative_int, metavar="K"),
    Option("--no-progress", "progress", "run", "progress", "run", "no progress bar",
           action="store_false"),
    Option("--report-to", "report_to", "run", "report_to", "run",
           f"experiment trackers that get every metrics.jsonl record, the settings and the "
           f"summary (TRL's report_to): none, or a comma-separated list of "
           f"{', '.join(PACKAGES)}; each is an extra (pip install \"zeroxla[wandb]\"), a "
           "missing one refused before the run starts; W&B offline with WANDB_MODE=offline, "
           "MLflow in the run directory unless MLFLOW_TRACKING_URI is set; default none",
           type=parse_report_to, metavar="NAMES"),
    Option("--resume", "resume", "run", "resume", "run",
           "continue a run: its directory, its checkpoint/ or one step in it (the newest "
           "complete checkpoint by default). The run's recorded settings come back; options "
           "given here change them, and the first line says which; a data file edited since "
           "is refused", metavar="DIR"),
)

SHARDING_OPTIONS: tuple[Option, ...] = (
    Option("--mesh", "mesh", "sharding", "mesh", "parallel",
           "device mesh (nodes x local devices); on CPU the devices are simulated; default "
           "{default}", type=mesh_shape, metavar="NODESxLOCAL"),
    Option("--zero-stage", "zero_stage", "sharding", "stage", "parallel",
           "ZeRO stage; default {default}", type=int, choices=ZERO_STAGES, deepspeed="stage"),
    Option("--sequence-parallel-size", "sequence_parallel_size", "sharding",
           "sequence_parallel_size", "parallel",
           "sequence parallelism (DeepSpeed-Ulysses' sequence_parallel_size): --mesh still names "
           "every device, and each node's LOCAL devices become LOCAL/P data replicas x P "
           "sequence devices, every sequence split P ways (P divides LOCAL; the sequence length "
           "is a multiple of P; the global batch's rows divide over NODES x LOCAL/P replicas: "
           "DeepSpeed's dp = world / sp); ZeRO partitions over all of them; default {default}",
           type=positive_int, metavar="P", deepspeed="sequence_parallel_size"),
    Option("--expert-parallel-size", "expert_parallel_size", "sharding",
           "expert_parallel_size", "parallel",
           "expert parallelism (DeepSpeed-MoE's ep_size): EP consecutive data replicas of a "
           "node form an expert group, over which every Mixture-of-Experts layer's experts are "
           "split (E / EP each; EP divides the experts and LOCAL / P); the batch, dense "
           "parameters and ZeRO are data parallel over them as before; default {default}",
           type=positive_int, metavar="EP"),
)

LORA_OPTIONS: tuple[Option, ...] = (
    Option("--lora-dim", "lora_dim", "lora", "dim", "lora",
           "LoRA rank r (DeepSpeed-Chat's --lora_dim): adapters W + (alpha / r) A @ B on the "
           "weights --lora-module-name matches, B zero so step 0 is the base model; default "
           "{default}: no LoRA", type=non_negative_int, metavar="R", fixed=True),
    Option("--lora-alpha", "lora_alpha", "lora", "alpha", "lora",
           "LoRA alpha: the adapters are scaled by alpha / r (PEFT's lora_alpha; "
           "DeepSpeed-Chat's lora_scaling is alpha / r); default {default}",
           type=positive_float, fixed=True),
    Option("--lora-module-name", "lora_module_name", "lora", "module_name", "lora",
           "regular expression searched in each weight's '/'-joined path (blocks/layers/wq): "
           "the weights that get adapters (DeepSpeed-Chat's --lora_module_name); one matching "
           "nothing is refused; default {default}", metavar="REGEX", fixed=True),
    Option("--only-optimize-lora", "only_optimize_lora", "lora", "only_optimize_lora", "lora",
           "train the adapters alone: the base is frozen and optimizer state exists for the "
           "adapters only (needs --lora-dim > 0)", action="store_true", fixed=True),
)



def packing_option(section: str | None, theme: str, what: str) -> Option:
    """The `--[no-]packing` row of the RL jobs (`zeroxla.rlhf.packed_rollout`, `packed_pairs`):
    `what` is packed into rows with segment ids, on by default (every packing is exact)."""
    return Option("--packing", "packing", section, "packing", theme,
                  f"train on {what} packed: each sequence whole in rows with segment ids, the "
                  "rows balanced over the data replicas (the padded rows' loss without their "
                  "padding; docs/rl.md); --no-packing: padded rows; default on",
                  action=argparse.BooleanOptionalAction)


# What every job's data option reads (`zeroxla.app.data_files`), for its help.
DATA_FORMS = ("a .jsonl (or a .json array; .gz ok), a .parquet file or a directory of .parquet "
              "shards, or a directory saved by datasets' save_to_disk (with --split for a "
              "DatasetDict)")


def split_option(option: str) -> Option:
    """The `--split` row of a job whose data option is `option` (its tree field `split`)."""
    return Option("--split", "split", None, "split", "job", f"the split of a {option} "
                  "directory saved by a datasets DatasetDict (train, test, ...)", metavar="NAME")


def token_budget_option(section: str, theme: str) -> Option:
    """The `--ppo-max-token-len-per-gpu` row of the RL jobs (verl's name and meaning, its
    `use_dynamic_bsz`): packed rows of N tokens per device, each replica's rows micro-batches."""
    return Option("--ppo-max-token-len-per-gpu", "ppo_max_token_len_per_gpu", section,
                  "ppo_max_token_len_per_gpu", theme,
                  "a token budget per device (verl's): with --packing, rows of N tokens per "
                  "device, each data replica's rows its micro-batches, their gradients "
                  "accumulated into one update (the same mean); at least the longest sequence "
                  "over the sequence devices; default none: one micro-batch of every row",
                  type=positive_int, metavar="N")


def rollout_correction_options(theme: str) -> tuple[Option, ...]:
    """The RL jobs' rows of verl's rollout correction (section "rollout_corr":
    `zeroxla.rlhf.rollout_correction.RolloutCorrection`'s fields), verl's names."""
    return tuple(Option(flag, dest, "rollout_corr", field, theme, help, **kw)
                 for flag, dest, field, help, kw in (
        ("--rollout-is", "rollout_is", "is_level", "importance weights of the train/rollout "
         "log-ratio per token, per answer (sequence: its sum) or geometric (its mean); "
         "default none", dict(choices=IS_LEVELS)),
        ("--rollout-is-threshold", "rollout_is_threshold", "is_threshold", "the weights' upper "
         "bound U (truncated to it); default {default}", dict(type=positive_float, metavar="U")),
        ("--rollout-is-threshold-lower", "rollout_is_threshold_lower", "is_threshold_lower",
         "with it, IcePop's band: weights outside [L, U] are 0, inside unchanged; default none",
         dict(type=positive_float, metavar="L")),
        ("--rollout-rs", "rollout_rs", "rs", f"rejection sampling: LEVEL "
         f"({' | '.join(RS_LEVELS)}) over STAT ({' | '.join(RS_STATISTICS)}); rejected tokens "
         "leave the loss and its count; default none",
         dict(nargs=2, metavar=("LEVEL", "STAT"), to_tree=tuple)),
        ("--rollout-rs-threshold", "rollout_rs_threshold", "rs_threshold", "the statistic's "
         "upper bound (k1: a ratio bound, compared in log); required with --rollout-rs",
         dict(type=positive_float, metavar="T")),
        ("--rollout-rs-threshold-lower", "rollout_rs_threshold_lower", "rs_threshold_lower",
         "k1's lower ratio bound; default 1 / --rollout-rs-threshold",
         dict(type=positive_float, metavar="L")),
        ("--rollout-bypass", "rollout_bypass", "bypass", "the rollout's log-probs are pi_old "
         "(the ratio is the importance weight: no weight applied)",
         dict(action="store_true"))))


def named_correction_options(section: str | None, theme: str,
                             corrections: tuple[str, ...]) -> tuple[Option, ...]:
    """The RL jobs' named corrections: `--rollout-correction` (one of `corrections`), the cap
    of "decoupled" (AReaL's `behav_imp_weight_cap`) and, with "tis", `--tis-cap`; `section`
    holds the fields `rollout_correction`, `behav_imp_weight_cap` (and `tis_cap`)."""
    tis = ("tis: truncated importance sampling of the train/rollout log-prob gap (TRL's "
           "vllm_importance_sampling_correction); " if "tis" in corrections else "")
    rows = (
        ("--rollout-correction", "rollout_correction", f"{tis}decoupled: AReaL's decoupled PPO "
         "objective (--behav-imp-weight-cap); default {default}", dict(choices=corrections)),
        ("--tis-cap", "tis_cap", "the largest importance weight of --rollout-correction tis; "
         "default {default}", dict(type=positive_float, metavar="C")),
        ("--behav-imp-weight-cap", "behav_imp_weight_cap", "with --rollout-correction "
         "decoupled (AReaL's decoupled PPO: pi_old the current weights, each token weighted by "
         "pi_prox / pi_behav of the version that drew it): weights above C are 0 (AReaL's); "
         "default {default}", dict(type=positive_float, metavar="C")))
    return tuple(Option(flag, field, section, field, theme, help, **kw)
                 for flag, field, help, kw in rows if field != "tis_cap" or tis)


def check_one_correction(named: str | None, rollout_corr: Any) -> None:
    """ValueError naming the options where `--rollout-correction` meets verl's `--rollout-is`,
    `--rollout-rs` or `--rollout-bypass` (`rollout_corr` active): two corrections of one loss."""
    if named and rollout_corr.active:
        raise ValueError(f"--rollout-correction {named} with --rollout-is, --rollout-rs or "
                         "--rollout-bypass: two corrections; accepted: one of them (tis is "
                         "--rollout-is token --rollout-is-threshold C)")


__all__ = ["DATA_FORMS", "LORA_OPTIONS", "Option", "OptionTable", "RUN_OPTIONS",
           "SHARDING_OPTIONS", "check_one_correction", "named_correction_options",
           "packing_option", "rollout_correction_options", "split_option", "token_budget_option"]
