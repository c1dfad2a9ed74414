"""`zeroxla train`'s one option table: every job setting a user can give is one row, and the
parser, `--resume`'s given options, the names in messages, the config tree's sections and the
DeepSpeed overrides all come from it."""

import dataclasses

import pytest

from zeroxla.app import cli
from zeroxla.app.jobs.train import config
from zeroxla.app.jobs.train.options import (OPTION_NAMES, OPTIONS, deepspeed_overrides,
                                            given_options, section_changes)
from zeroxla.deepspeed.overrides import Overrides
from zeroxla.sharding.config import ZeroConfig

# Tree fields no option sets: the default recipe's constants, the --config JSON's optimizer and
# scheduler sections, and the ZeroConfig settings only a DeepSpeed JSON (or Python) gives.
NOT_OPTIONS = {("schedule", "min_lr_ratio"), ("schedule", "weight_decay"),
               ("schedule", "optimizer"), ("schedule", "scheduler"), ("data", "val_fraction"),
               ("sharding", "prefetch"), ("sharding", "max_live_parameters"),
               ("sharding", "remat"),
               ("numerics", "loss_scale"),
               ("numerics", "initial_scale_power"), ("numerics", "loss_scale_window"),
               ("numerics", "hysteresis"), ("numerics", "min_loss_scale"),
               ("offload", "offload_pin_memory")} | {
    ("zeropp", f.name) for f in dataclasses.fields(config.ZeroPP)}

# One command line that gives every option (flag -> text; --init-from apart, as it brings its
# own tokenizer), and the options it means.
GIVEN = {"--model": "llama-tiny", "--data": "x.txt", "--split": "train", "--tokenizer": "byte",
         "--steps": "7",
         "--batch-size": "16", "--seq-len": "64", "--learning-rate": "0.001", "--warmup-steps": "2",
         "--mesh": "1x8", "--sequence-parallel-size": "2", "--expert-parallel-size": "2",
         "--sequence-parallel-strategy": "allgather", "--pipeline-stages": "2",
         "--zero-stage": "2", "--dtype": "bf16",
         "--grad-accum": "2", "--persistence-threshold": "5", "--gradient-clipping": "0.5",
         "--no-check-grad-overflow": None, "--config": "ds.json",
         "--offload-optimizer": "cpu", "--offload-param": "none",
         "--out": "o", "--seed": "3", "--eval-every": "4", "--eval-batches": "5",
         "--save-every": "6", "--keep-last": "1", "--sample-tokens": "9", "--temperature": "0",
         "--no-progress": None, "--report-to": "tensorboard,mlflow", "--resume": "r",
         "--lora-dim": "8", "--lora-alpha": "16",
         "--lora-module-name": "wq", "--only-optimize-lora": None, "--no-packing": None}
EXPECTED = dict(model="llama-tiny", data="x.txt", split="train", tokenizer="byte", steps=7,
                batch_size=16,
                seq_len=64, lr=1e-3, warmup_steps=2, mesh=(1, 8), sequence_parallel_size=2,
                expert_parallel_size=2, sequence_parallel_strategy="allgather", pipeline_stages=2,
                zero_stage=2, dtype="bf16", grad_accum=2, persistence_threshold=5,
                gradient_clipping=0.5, check_grad_overflow=False,
                offload_optimizer="cpu", offload_param="none",
                deepspeed_config="ds.json", out_dir="o", seed=3, eval_every=4, eval_batches=5,
                save_every=6, keep_last=1, sample_tokens=9, temperature=0.0, progress=False,
                report_to=("tensorboard", "mlflow"), resume="r", lora_dim=8, lora_alpha=16.0,
                lora_module_name="wq",
                only_optimize_lora=True, packing=False)
# The tree fields those options land in, with the tree's values.
TREE = {("model", "preset"): "llama-tiny", ("data", "path"): "x.txt", ("data", "split"): "train",
        ("data", "tokenizer"): "byte", ("schedule", "steps"): 7,
        ("schedule", "batch_size"): 16, ("data", "seq_len"): 64, ("schedule", "lr"): 1e-3,
        ("schedule", "warmup_steps"): 2, ("sharding", "mesh"): (1, 8),
        ("sharding", "sequence_parallel_size"): 2, ("sharding", "expert_parallel_size"): 2,
        ("sharding", "sequence_parallel_strategy"): "allgather",
        ("pipeline", "stages"): 2, ("sharding", "stage"): 2,
        ("numerics", "compute_dtype"): "bfloat16",
        ("sharding", "gradient_accumulation_steps"): 2,
        ("sharding", "persistence_threshold"): 5, ("numerics", "gradient_clipping"): 0.5,
        ("numerics", "check_grad_overflow"): False, ("offload", "offload_optimizer"): "cpu",
        ("offload", "offload_param"): "none", ("run", "out_dir"): "o", ("run", "seed"): 3,
        ("run", "eval_every"): 4, ("run", "eval_batches"): 5, ("run", "save_every"): 6,
        ("run", "keep_last"): 1, ("run", "sample_tokens"): 9, ("run", "temperature"): 0.0,
        ("run", "progress"): False, ("run", "report_to"): ("tensorboard", "mlflow"),
        ("run", "resume"): "r", ("lora", "dim"): 8,
        ("lora", "alpha"): 16.0, ("lora", "module_name"): "wq",
        ("lora", "only_optimize_lora"): True, ("data", "packing"): False}


def _argv(given):
    return ["train"] + [t for flag, text in given.items() for t in (flag, text) if t is not None]


def test_every_tree_field_is_one_option_or_not_an_option():
    fields = {(name, f.name) for name, cls in config.SECTIONS.items()
              for f in dataclasses.fields(cls)}
    targets = [(o.section, o.field) for o in OPTIONS if o.section is not None]
    assert len(targets) == len(set(targets))
    assert set(targets) == fields - NOT_OPTIONS
    assert not NOT_OPTIONS - fields
    assert [(o.section, o.field) for o in OPTIONS if o.section is None] == [
        (None, "deepspeed_config")]
    flags = {o.flag for o in OPTIONS} | {"--no-check-grad-overflow", "--no-packing"}
    assert set(GIVEN) | {"--init-from", "--check-grad-overflow", "--packing"} == flags


def test_lr_is_the_learning_rate_options_other_spelling():
    """One option, two spellings: `--lr` (this command's older one) sets what `--learning-rate`
    sets, and messages name `--learning-rate`."""
    for flag in ("--lr", "--learning-rate"):
        given = given_options(cli.build_parser().parse_args(["train", flag, "0.002"]))
        assert given == {"lr": 0.002}
    assert OPTION_NAMES["lr"] == "--learning-rate"


def test_a_command_line_giving_every_option_is_that_job():
    given = given_options(cli.build_parser().parse_args(_argv(GIVEN)))
    assert given == EXPECTED
    changes = section_changes(config.TrainJobConfig(), given)
    assert changes["deepspeed_config"] == "ds.json"
    assert {(section, field): getattr(changes[section], field)
            for section, field in TREE} == TREE
    assert given_options(cli.build_parser().parse_args(["train"])) == {}


def test_init_from_brings_its_own_tokenizer_and_refuses_another():
    given = given_options(cli.build_parser().parse_args(["train", "--init-from", "hf"]))
    changes = section_changes(config.TrainJobConfig(), given)
    assert (changes["model"].init_from, changes["data"].tokenizer) == ("hf", config.PRETRAINED)
    with pytest.raises(ValueError, match="--tokenizer byte with --init-from hf: a pretrained "
                                         "model's vocabulary is its own tokenizer's"):
        section_changes(config.TrainJobConfig(), {**given, "tokenizer": "byte"})


def test_names_in_messages_are_the_flags():
    assert OPTION_NAMES["deepspeed_config"] == "--config"
    assert OPTION_NAMES["zero_stage"] == "--zero-stage"


def test_deepspeed_overrides_are_the_deepspeed_settings_given():
    overrides = deepspeed_overrides(EXPECTED)
    assert overrides == Overrides(
        train_batch_size=16, stage=2, compute_dtype="bfloat16", gradient_accumulation_steps=2,
        persistence_threshold=5, gradient_clipping=0.5, check_grad_overflow=False,
        offload_optimizer="cpu", offload_param="none", sequence_parallel_size=2,
        given_as=overrides.given_as)
    assert dict(overrides.given_as) == {
        "train_batch_size": "--batch-size 16", "stage": "--zero-stage 2",
        "compute_dtype": "--dtype bf16", "gradient_accumulation_steps": "--grad-accum 2",
        "persistence_threshold": "--persistence-threshold 5",
        "gradient_clipping": "--gradient-clipping 0.5",
        "check_grad_overflow": "--no-check-grad-overflow",
        "offload_optimizer": "--offload-optimizer cpu", "offload_param": "--offload-param none",
        "sequence_parallel_size": "--sequence-parallel-size 2"}
    assert deepspeed_overrides({"check_grad_overflow": True}).written(
        "check_grad_overflow") == "--check-grad-overflow"
    assert deepspeed_overrides({}) == Overrides()


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
