"""Every job's option table, walked: each option the parser accepts reaches the job's config tree
(no option is parsed and then read by nothing), and the options every job shares are declared
once (`zeroxla.app.run.options`), the same row object in every table.

The jobs are found as `zeroxla.app.cli` registers them (`add_job` with a `JobSpec`). For each row
the test writes a command line that gives it a value other than the tree's default, parses it
with the job's real parser, applies the given options to the job's default tree and reads the
row's field back.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import pytest

from zeroxla.app import cli
from zeroxla.app.run.command import JobSpec, add_job
from zeroxla.app.run.options import LORA_OPTIONS, RUN_OPTIONS, SHARDING_OPTIONS, Option

SPECS = {add.keywords["spec"].name: add.keywords["spec"] for add in cli.SUBCOMMANDS
         if isinstance(add, functools.partial) and add.func is add_job}
# Options whose value is only valid beside another one.
WITH = {"only_optimize_lora": ["--lora-dim", "4"], "lora_alpha": ["--lora-dim", "4"],
        "lora_module_name": ["--lora-dim", "4"], ("grpo", "prompts"): ["--reward-funcs", "x"],
        ("dpo", "split"): ["--data", "d"], ("grpo", "split"): ["--prompts", "p", "--reward-funcs",
                                                              "x"],
        "rollout_rs": ["--rollout-rs-threshold", "2.0"],
        "max_staleness": ["--rollout-devices", "4"],
        "partial_rollout": ["--rollout-devices", "4", "--max-staleness", "1"],
        "behav_imp_weight_cap": ["--rollout-correction", "decoupled"],
        "rollout_rs_threshold": ["--rollout-rs", "token", "k3"],
        "rollout_rs_threshold_lower": ["--rollout-rs", "token", "k1", "--rollout-rs-threshold",
                                       "8.0"]}
# Values the tree's checks accept alone, for options whose parser takes any text.
TEXT = {"mesh": "1x8", "model": "llama-tiny", "temperature": "0.5", "dtype": "bf16",
        "reward_funcs": "accuracy", "offload_param": "cpu", "packed_row_len": "64",
        "rollout_is_threshold_lower": "0.5", "report_to": "tensorboard,wandb"}
# Values of options that take several words.
WORDS = {"rollout_rs": ["token", "k3"]}


def _parser(spec: JobSpec) -> argparse.ArgumentParser:
    subparsers = argparse.ArgumentParser().add_subparsers()
    add_job(subparsers, spec)
    return subparsers.choices[spec.name]


def _value(spec: JobSpec, row: Option) -> list[str]:
    """Command-line words that give `row` a value other than the tree's default."""
    default = spec.table.default(row)
    default = None if default is dataclasses.MISSING else default
    if row.action in ("store_true", "store_false"):
        return [row.flag]
    if row.action is argparse.BooleanOptionalAction:
        return [f"--no-{row.flag[2:]}"] if default else [row.flag]
    if row.choices:
        return [row.flag, str(next(c for c in row.choices if row.tree_value(c) != default))]
    if row.dest in WORDS:
        return [row.flag, *WORDS[row.dest]]
    if row.dest in TEXT:
        return [row.flag, TEXT[row.dest]]
    if isinstance(default, bool) or row.type is None:
        return [row.flag, f"some/{row.dest}.jsonl"]
    if isinstance(default, int) and default > 0:
        return [row.flag, str(default * 2)]
    if isinstance(default, float) and default > 0:
        return [row.flag, repr(default / 2)]
    words = [row.flag, "4"]
    return words + ["2"] if row.nargs == "+" else words


def _read(tree, row: Option):
    section = tree if row.section is None else getattr(tree, row.section)
    return getattr(section, row.field)


def _tree(spec: JobSpec, given: dict):
    """The job's tree of `given` options, made as its command makes a fresh run's."""
    if spec.make_tree is not None:
        return spec.make_tree(given, None)[0]
    required = {field: f"some/{field}" for field in spec.required}
    return spec.table.apply(spec.table.tree(**required), given)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_parsed_option_reaches_the_jobs_tree(name, tmp_path):
    spec = SPECS[name]
    parser, base = _parser(spec), _tree(spec, {})
    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text("{}")                   # a DeepSpeed JSON is read with the options
    for row in spec.table.rows:
        argv = _value(spec, row) + WITH.get(row.dest, WITH.get((name, row.dest), []))
        if row.dest == "deepspeed_config":
            argv = [row.flag, str(deepspeed)]
        given = spec.table.given(parser.parse_args(argv))
        assert row.dest in given, (name, row.flag)
        tree = _tree(spec, given)
        assert _read(tree, row) == row.tree_value(given[row.dest]), (name, row.flag, argv)
        assert _read(tree, row) != _read(base, row), (name, row.flag, "not changed")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_shared_options_are_one_declaration(name):
    """--mesh, --seed, --out, the cadence and LoRA: the shared rows themselves, in every job
    that takes them (so one spelling, one help, one dest)."""
    rows = {row.flag: row for row in SPECS[name].table.rows}
    for shared in (*RUN_OPTIONS, *SHARDING_OPTIONS, *LORA_OPTIONS):
        if shared.flag in rows:
            assert rows[shared.flag] is shared, (name, shared.flag)
    for flag in ("--seed", "--out", "--resume", "--save-every", "--keep-last", "--mesh"):
        assert flag in rows, (name, flag)
