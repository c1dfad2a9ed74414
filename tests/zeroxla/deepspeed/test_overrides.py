"""A job's options applied to a DeepSpeed JSON as typed overrides while it is read once: each
lands where the JSON key would, a contradiction names both, and an override takes part in the
cross-key checks and DeepSpeed's batch arithmetic as if the JSON had said it (the expected
values are DeepSpeed's rules: train = micro x accumulation x dp; ZeRO++ needs stage 3)."""

import warnings

import pytest

from zeroxla.deepspeed.config import (DeepSpeedConfigError, DeepSpeedConfigWarning,
                                      load_deepspeed_config)
from zeroxla.deepspeed.overrides import Overrides


def given(name, value, written):
    """One setting given beside the JSON, as the user wrote it."""
    return {name: value, "given_as": {name: written}}


def load(cfg, *settings, dp=8, **kw):
    merged = {k: v for one in settings for k, v in one.items() if k != "given_as"}
    written = {k: v for one in settings for k, v in one["given_as"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return load_deepspeed_config(cfg, data_parallel_size=dp,
                                     overrides=Overrides(**merged, given_as=written), **kw)


def test_an_override_lands_where_its_json_key_would():
    by_json = load({"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 7},
                    "fp16": {"enabled": True}, "train_batch_size": 64})
    by_override = load({}, given("stage", 2, "--zero-stage 2"),
                       given("persistence_threshold", 7, "--persistence-threshold 7"),
                       given("compute_dtype", "float16", "--dtype fp16"),
                       given("train_batch_size", 64, "--batch-size 64"))
    assert by_override.zero == by_json.zero
    assert (by_override.train_batch_size, by_override.micro_batch_size) == (64, 8)


def test_an_override_that_agrees_with_the_json_is_accepted():
    cfg = load({"zero_optimization": {"stage": 3}}, given("stage", 3, "--zero-stage 3"))
    assert cfg.zero.stage == 3


@pytest.mark.parametrize("cfg,override,message", [
    ({"zero_optimization": {"stage": 2}}, given("stage", 3, "--zero-stage 3"),
     "--zero-stage 3 conflicts with zero_optimization.stage=2 in DeepSpeed config; give one"),
    ({"train_batch_size": 32}, given("train_batch_size", 16, "--batch-size 16"),
     "--batch-size 16 conflicts with train_batch_size=32"),
    ({"gradient_accumulation_steps": 2}, given("gradient_accumulation_steps", 4,
                                               "--grad-accum 4"),
     "--grad-accum 4 conflicts with gradient_accumulation_steps=2"),
    ({"fp16": {"enabled": True}}, given("compute_dtype", "bfloat16", "--dtype bf16"),
     "--dtype bf16 conflicts with fp16.enabled=true"),
    ({"bf16": {"enabled": False}}, given("compute_dtype", "bfloat16", "--dtype bf16"),
     "--dtype bf16 conflicts with bf16.enabled=false"),
    ({"bfloat16": {"enabled": True}}, given("compute_dtype", "float32", "--dtype fp32"),
     "--dtype fp32 conflicts with bfloat16.enabled=true"),
])
def test_a_contradiction_names_the_option_and_the_key(cfg, override, message):
    with pytest.raises(DeepSpeedConfigError, match=message.replace(".", r"\.")):
        load(cfg, override)


def test_a_stage_override_takes_part_in_the_zeropp_stage_check():
    zeropp = {"zero_optimization": {"zero_quantized_weights": True}}
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage=3"):
        load(zeropp)                                    # DeepSpeed's default stage 0
    assert load(zeropp, given("stage", 3, "--zero-stage 3")).zero.quantized_weights


def test_a_batch_override_goes_through_deepspeeds_batch_arithmetic():
    cfg = load({"train_batch_size": 64}, given("gradient_accumulation_steps", 4,
                                               "--grad-accum 4"))
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (
        64, 64 // 4 // 8, 4)
    with pytest.raises(DeepSpeedConfigError, match="train_micro_batch_size_per_gpu=0"):
        load({"train_batch_size": 16}, given("gradient_accumulation_steps", 4,
                                             "--grad-accum 4"))


def test_the_default_batch_applies_only_where_nothing_sets_one():
    assert load({}, default_train_batch_size=32).train_batch_size == 32
    assert load({"train_micro_batch_size_per_gpu": 2},
                default_train_batch_size=32).train_batch_size == 16
    assert load({}, given("train_batch_size", 8, "--batch-size 8"),
                default_train_batch_size=32).train_batch_size == 8
    assert load({}).train_batch_size is None


def test_overrides_refuse_an_unknown_setting_or_dtype():
    """Typed: a setting Overrides does not have is a TypeError at construction, a message for
    one it does not have is refused by name, and a dtype must be a ZeroConfig compute dtype."""
    with pytest.raises(TypeError, match="no_such_field"):
        Overrides(no_such_field=1)
    with pytest.raises(ValueError, match="given_as names micro_batch, which are not settings; "
                                         "accepted: stage"):
        Overrides(stage=2, given_as={"micro_batch": "--x"})
    with pytest.raises(ValueError, match="compute_dtype='fp16' is invalid; accepted"):
        Overrides(compute_dtype="fp16")


@pytest.mark.parametrize("cfg,setting,message", [
    ({"gradient_clipping": 0.5}, given("gradient_clipping", 1.0, "--gradient-clipping 1.0"),
     "--gradient-clipping 1.0 conflicts with gradient_clipping=0.5"),
    ({"bf16": {"check_grad_overflow": False}},
     given("check_grad_overflow", True, "--check-grad-overflow"),
     "--check-grad-overflow conflicts with bf16.check_grad_overflow=false"),
    ({"bfloat16": {"check_grad_overflow": False}},
     given("check_grad_overflow", True, "--check-grad-overflow"),
     "--check-grad-overflow conflicts with bfloat16.check_grad_overflow=false")])
def test_clipping_and_overflow_overrides_conflict_with_their_keys(cfg, setting, message):
    with pytest.raises(DeepSpeedConfigError, match=message.replace(".", r"\.")):
        load(cfg, setting)
    # Without the conflicting key, the override lands where the key would.
    name = next(k for k in setting if k != "given_as")
    key = ({"gradient_clipping": 1.0} if name == "gradient_clipping"
           else {"bf16": {"check_grad_overflow": True}})
    assert load({}, setting).zero == load(key).zero


def test_the_hybrid_engine_section_is_read_with_the_rest():
    from zeroxla.inference import HybridEngineConfig

    cfg = load({"train_batch_size": 8, "hybrid_engine": {"enabled": True,
                                                         "inference_tp_size": 2}})
    assert cfg.hybrid_engine == HybridEngineConfig(enabled=True, inference_tp_size=2)
    assert load({}).hybrid_engine is None
    with pytest.raises(ValueError, match=r"hybrid_engine\.inference_tp_size=0 is invalid"):
        load({"hybrid_engine": {"inference_tp_size": 0}})
