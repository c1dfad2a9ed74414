"""A job's options applied to a DeepSpeed JSON as typed overrides while it is read once: each
lands where the JSON key would, a contradiction names both, and an override takes part in the
cross-key checks and DeepSpeed's batch arithmetic as if the JSON had said it (the expected
values are DeepSpeed's rules: train = micro x accumulation x dp; ZeRO++ needs stage 3)."""

import warnings

import pytest

from zeroxla.deepspeed.config import (DeepSpeedConfigError, DeepSpeedConfigWarning,
                                      load_deepspeed_config)
from zeroxla.deepspeed.overrides import Override


def load(cfg, *overrides, dp=8, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return load_deepspeed_config(cfg, data_parallel_size=dp, overrides=overrides, **kw)


def test_an_override_lands_where_its_json_key_would():
    by_json = load({"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 7},
                    "fp16": {"enabled": True}, "train_batch_size": 64})
    by_override = load({}, Override("zero.stage", 2, "--zero-stage 2"),
                       Override("zero.persistence_threshold", 7, "--persistence-threshold 7"),
                       Override("zero.compute_dtype", "float16", "--dtype fp16"),
                       Override("train_batch_size", 64, "--batch-size 64"))
    assert by_override.zero == by_json.zero
    assert (by_override.train_batch_size, by_override.micro_batch_size) == (64, 8)


def test_an_override_that_agrees_with_the_json_is_accepted():
    cfg = load({"zero_optimization": {"stage": 3}}, Override("zero.stage", 3, "--zero-stage 3"))
    assert cfg.zero.stage == 3


@pytest.mark.parametrize("cfg,override,message", [
    ({"zero_optimization": {"stage": 2}}, Override("zero.stage", 3, "--zero-stage 3"),
     "--zero-stage 3 conflicts with zero_optimization.stage=2 in DeepSpeed config; give one"),
    ({"train_batch_size": 32}, Override("train_batch_size", 16, "--batch-size 16"),
     "--batch-size 16 conflicts with train_batch_size=32"),
    ({"gradient_accumulation_steps": 2}, Override("gradient_accumulation_steps", 4,
                                                  "--grad-accum 4"),
     "--grad-accum 4 conflicts with gradient_accumulation_steps=2"),
    ({"fp16": {"enabled": True}}, Override("zero.compute_dtype", "bfloat16", "--dtype bf16"),
     "--dtype bf16 conflicts with fp16.enabled=true"),
    ({"bf16": {"enabled": False}}, Override("zero.compute_dtype", "bfloat16", "--dtype bf16"),
     "--dtype bf16 conflicts with bf16.enabled=false"),
    ({"bfloat16": {"enabled": True}}, Override("zero.compute_dtype", "float32", "--dtype fp32"),
     "--dtype fp32 conflicts with bfloat16.enabled=true"),
])
def test_a_contradiction_names_the_option_and_the_key(cfg, override, message):
    with pytest.raises(DeepSpeedConfigError, match=message.replace(".", r"\.")):
        load(cfg, override)


def test_a_stage_override_takes_part_in_the_zeropp_stage_check():
    zeropp = {"zero_optimization": {"zero_quantized_weights": True}}
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage=3"):
        load(zeropp)                                    # DeepSpeed's default stage 0
    assert load(zeropp, Override("zero.stage", 3, "--zero-stage 3")).zero.quantized_weights


def test_a_batch_override_goes_through_deepspeeds_batch_arithmetic():
    cfg = load({"train_batch_size": 64}, Override("gradient_accumulation_steps", 4,
                                                  "--grad-accum 4"))
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (
        64, 64 // 4 // 8, 4)
    with pytest.raises(DeepSpeedConfigError, match="train_micro_batch_size_per_gpu=0"):
        load({"train_batch_size": 16}, Override("gradient_accumulation_steps", 4,
                                                "--grad-accum 4"))


def test_the_default_batch_applies_only_where_nothing_sets_one():
    assert load({}, default_train_batch_size=32).train_batch_size == 32
    assert load({"train_micro_batch_size_per_gpu": 2},
                default_train_batch_size=32).train_batch_size == 16
    assert load({}, Override("train_batch_size", 8, "--batch-size 8"),
                default_train_batch_size=32).train_batch_size == 8
    assert load({}).train_batch_size is None


@pytest.mark.parametrize("target,value", [("zero.no_such_field", 1), ("micro_batch", 2),
                                          ("zero.compute_dtype", "fp16")])
def test_override_refuses_an_unknown_target_or_dtype(target, value):
    with pytest.raises(ValueError, match="accepted"):
        Override(target, value, "--x")


def test_the_hybrid_engine_section_is_read_with_the_rest():
    from zeroxla.inference import HybridEngineConfig

    cfg = load({"train_batch_size": 8, "hybrid_engine": {"enabled": True,
                                                         "inference_tp_size": 2}})
    assert cfg.hybrid_engine == HybridEngineConfig(enabled=True, inference_tp_size=2)
    assert load({}).hybrid_engine is None
    with pytest.raises(ValueError, match=r"hybrid_engine\.inference_tp_size=0 is invalid"):
        load({"hybrid_engine": {"inference_tp_size": 0}})
