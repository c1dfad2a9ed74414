"""The ZeRO stage, persistence threshold, clipping and overflow-check defaults of the API
(`ZeroConfig()`), of `zeroxla train` with no options, and of a DeepSpeed JSON with an empty
`zero_optimization`: exactly the documented table, and each difference explained, with its
reason, in `zeroxla train --help`. References: DeepSpeed's own defaults as its documentation
states them, and the job's documented choices (docs/zero.md). No devices."""

import dataclasses
from pathlib import Path

import pytest

from zeroxla.app import cli
from zeroxla.app.jobs.train import config
from zeroxla.app.jobs.train.defaults import API_DEFAULTS, JOB_DEFAULTS, job_default
from zeroxla.app.jobs.train.defaults_table import OPTION_OF_FIELD, defaults_table, format_table
from zeroxla.app.jobs.train.options import OPTION_NAMES, OPTIONS, json_default_text
from zeroxla.deepspeed.config import load_deepspeed_config
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD

ROOT = Path(__file__).resolve().parents[3]
# field: (API, zeroxla train, a JSON with an empty zero_optimization)
DOCUMENTED = {"stage": (3, 3, 0),
              "persistence_threshold": (100_000, 0, 100_000),
              "gradient_clipping": (0.0, 1.0, 0.0),
              "check_grad_overflow": (False, True, True)}
# DeepSpeed's defaults for the keys a JSON leaves out (docs: zero_optimization.stage 0,
# stage3_param_persistence_threshold 1e5, gradient_clipping 0 (off), bf16.check_grad_overflow
# false).
DEEPSPEED = {"stage": 0, "persistence_threshold": 100_000, "gradient_clipping": 0.0,
             "check_grad_overflow": False}


@pytest.fixture(scope="module")
def table():
    return {row.field: row for row in defaults_table()}


@pytest.fixture
def train_help(capsys, monkeypatch):
    """`zeroxla train --help` as printed, on one line per option (no wrapping)."""
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_defaults_are_the_documented_table(table):
    assert {field: (row.api, row.cli, row.json) for field, row in table.items()} == DOCUMENTED
    # docs/zero.md shows the table as the one-liner prints it, reasons included.
    assert format_table(list(table.values())) in (ROOT / "docs" / "zero.md").read_text()


def test_a_json_that_leaves_the_keys_out_gets_deepspeeds_defaults():
    zero = load_deepspeed_config({"zero_optimization": {}}).zero
    assert {field: getattr(zero, field) for field in DEEPSPEED} == DEEPSPEED


def test_every_difference_is_in_the_options_help_with_its_reason(table, train_help):
    for field, row in table.items():
        option = next(o for o in OPTIONS if o.dest == OPTION_OF_FIELD[field])
        own_help = " ".join(option.help.split())
        job = next((d for d in JOB_DEFAULTS if d.field == field), None)
        if row.cli != row.api:               # the job's own default: the option says why
            assert job is not None and job.reason in own_help and job.reason in train_help
            assert f"({OPTION_NAMES[option.dest]})" in row.reason and job.reason in row.reason
        else:
            assert job is None
        if row.json != row.cli and not (job is not None and job.with_config):
            # DeepSpeed's default for a key the JSON leaves out: --config's help says so.
            assert json_default_text(field) in train_help and json_default_text(field) in row.reason
        if row.json == row.cli != row.api:   # the job's default holds over a JSON too
            assert job.with_config and f"unless it sets {KEY_OF_FIELD[field]}" in own_help
        assert bool(row.reason) == (len({row.api, row.cli, row.json}) > 1)


def test_the_job_default_table_is_what_the_tree_uses():
    """Every engine-facing default of the tree is ZeroConfig's, or the JOB_DEFAULTS row's."""
    for cls in config.ENGINE_SECTIONS:
        for field in dataclasses.fields(cls):
            if field.name in ("mesh", "expert_parallel_size"):      # the mesh's, not ZeroConfig's
                continue
            row = next((d for d in JOB_DEFAULTS if d.field == field.name), None)
            expected = row.value if row is not None else API_DEFAULTS[field.name]
            assert field.default == expected == job_default(field.name), field.name
    # sequence_parallel_size: 1 (the job builds its mesh), ZeroConfig's None follows the mesh.
    assert {d.field for d in JOB_DEFAULTS} == {"persistence_threshold", "gradient_clipping",
                                               "check_grad_overflow", "sequence_parallel_size"}
