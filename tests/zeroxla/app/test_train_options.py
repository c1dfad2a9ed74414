"""`zeroxla train`'s one option table: every job setting a user can give is one row, and the
parser, `--resume`'s explicit fields, the names in messages and the DeepSpeed overrides all come
from it."""

import dataclasses

import pytest

from zeroxla.app import cli
from zeroxla.app.job import TrainJobConfig
from zeroxla.app.train_options import (OPTION_NAMES, OPTIONS, deepspeed_overrides,
                                       explicit_fields)
from zeroxla.sharding.config import ZeroConfig

# TrainJobConfig fields that are fixed parts of the default recipe, not command-line options.
RECIPE_CONSTANTS = {"min_lr_ratio", "weight_decay", "gradient_clipping", "val_fraction"}

# One command line that gives every option (flag -> text), and the TrainJobConfig it means.
GIVEN = {"--model": "llama-tiny", "--data": "x.txt", "--tokenizer": "byte", "--steps": "7",
         "--batch-size": "16", "--seq-len": "64", "--lr": "0.001", "--warmup-steps": "2",
         "--mesh": "1x8", "--pipeline-stages": "2", "--zero-stage": "2", "--dtype": "bf16",
         "--grad-accum": "2", "--persistence-threshold": "5", "--config": "ds.json",
         "--offload-optimizer": "cpu", "--offload-param": "none",
         "--out": "o", "--seed": "3", "--eval-every": "4", "--eval-batches": "5",
         "--save-every": "6", "--keep-last": "1", "--sample-tokens": "9", "--temperature": "0",
         "--no-progress": None, "--resume": "r", "--init-from": "hf"}
EXPECTED = dict(model="llama-tiny", data="x.txt", tokenizer="byte", steps=7, batch_size=16,
                seq_len=64, lr=1e-3, warmup_steps=2, mesh=(1, 8), pipeline_stages=2,
                zero_stage=2, dtype="bf16", grad_accum=2, persistence_threshold=5,
                offload_optimizer="cpu", offload_param="none",
                deepspeed_config="ds.json", out_dir="o", seed=3, eval_every=4, eval_batches=5,
                save_every=6, keep_last=1, sample_tokens=9, temperature=0.0, progress=False,
                resume="r", init_from="hf")


def test_every_job_field_is_one_option_or_a_recipe_constant():
    fields = {f.name for f in dataclasses.fields(TrainJobConfig)}
    options = [o.field for o in OPTIONS]
    assert len(options) == len(set(options))
    assert set(options) == fields - RECIPE_CONSTANTS
    assert set(GIVEN) == {o.flag for o in OPTIONS}


def test_a_command_line_giving_every_option_is_that_job():
    argv = ["train"] + [t for flag, text in GIVEN.items() for t in (flag, text) if t is not None]
    explicit = explicit_fields(cli.build_parser().parse_args(argv))
    assert explicit == EXPECTED
    assert TrainJobConfig(**explicit) == TrainJobConfig(**EXPECTED)
    assert explicit_fields(cli.build_parser().parse_args(["train"])) == {}


def test_names_in_messages_are_the_flags():
    assert OPTION_NAMES["deepspeed_config"] == "--config"
    assert OPTION_NAMES["zero_stage"] == "--zero-stage"


def test_deepspeed_overrides_are_the_deepspeed_settings_given():
    overrides = deepspeed_overrides(TrainJobConfig(**EXPECTED))
    assert {(o.target, o.value, o.given_as) for o in overrides} == {
        ("train_batch_size", 16, "--batch-size 16"), ("zero.stage", 2, "--zero-stage 2"),
        ("zero.compute_dtype", "bfloat16", "--dtype bf16"),
        ("gradient_accumulation_steps", 2, "--grad-accum 2"),
        ("zero.persistence_threshold", 5, "--persistence-threshold 5"),
        ("zero.offload_optimizer", "cpu", "--offload-optimizer cpu"),
        ("zero.offload_param", "none", "--offload-param none")}
    assert deepspeed_overrides(TrainJobConfig()) == ()


def test_offload_param_help_says_what_the_engine_does():
    """The help's claims against ZeroConfig: 'cpu' runs at stage 3 with the partitions in pinned
    host memory, and is refused below stage 3 (the pipeline refusal: engine/test_offload.py)."""
    text = " ".join(next(o for o in OPTIONS if o.flag == "--offload-param").help.split())
    assert "not built" not in text and "refused" not in text
    for claim in ("ZeRO-Infinity", "pinned host memory", "just before its all-gather",
                  "needs --zero-stage 3", "not with --pipeline-stages"):
        assert claim in text
    assert ZeroConfig(stage=3, offload_param="cpu").param_offload_memory_kind == "pinned_host"
    with pytest.raises(ValueError, match="offload_param"):
        ZeroConfig(stage=2, offload_param="cpu")
