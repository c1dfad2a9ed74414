"""The DeepSpeed keys that land in ZeroConfig: every error names the JSON key, never only the
ZeroConfig field; keys checked together (ZeRO++ needs stage 3) and against the mesh (hpZ clamp)."""

import warnings

import pytest

import zeroxla.deepspeed
from zeroxla.deepspeed import DeepSpeedConfigError, DeepSpeedConfigWarning
from zeroxla.deepspeed.config import KEY_MAP, load_deepspeed_config, zero_config_from_json
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD
from zeroxla.sharding.config import ZeroConfig

ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights",
               "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
# Every DeepSpeed key whose value lands in a ZeroConfig field.
ZERO_KEYS = sorted(key for key, dest in KEY_MAP.items() if dest.startswith("zero."))
# Values of every JSON type, in and out of every range the keys accept.
ODD_VALUES = [-1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 7, 64, 65, 1e9, float("inf"), "4", "auto", None,
              True, False, [], {}]


def load(cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return load_deepspeed_config(cfg, data_parallel_size=8, **kw)


def config_with(dotted, value):
    """The smallest JSON that sets `dotted` to `value`, with stage 3 beside the ZeRO++ keys."""
    section, _, key = dotted.rpartition(".")
    if not section:
        return {key: value}
    cfg = {section: {key: value}}
    if key in ZEROPP_KEYS:
        cfg[section]["stage"] = 3
    return cfg


def test_the_zero_keys_cover_the_fields_the_loader_sets():
    assert set(KEY_OF_FIELD) == {
        "stage", "persistence_threshold", "prefetch", "max_live_parameters", "compute_dtype",
        "loss_scale",
        "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
        "gradient_clipping", "check_grad_overflow", "gradient_accumulation_steps",
        "hpz_partition_size",
        "quantized_weights", "quantized_nontrainable_weights", "quantized_gradients",
        "offload_optimizer", "offload_param", "offload_pin_memory", "sequence_parallel_size"}
    assert "zero_optimization.zero_hpz_partition_size" in ZERO_KEYS


@pytest.mark.parametrize("mesh_local_size", [None, 1, 4])
@pytest.mark.parametrize("dotted", ZERO_KEYS)
def test_every_zero_key_is_checked_by_the_loader_naming_the_json_key(dotted, mesh_local_size):
    """A value either loads, or fails in the loader with the JSON key in the message; it never
    gets through to ZeroConfig's own checks (whose messages name the Python field)."""
    for value in ODD_VALUES:
        try:
            load(config_with(dotted, value), mesh_local_size=mesh_local_size)
        except DeepSpeedConfigError as err:
            assert dotted in str(err) and "ZeroConfig." not in str(err), (value, str(err))


@pytest.mark.parametrize("key", ZEROPP_KEYS)
@pytest.mark.parametrize("stage", [0, 1, 2, None])
def test_zeropp_without_stage_3_names_both_json_keys(key, stage):
    zero = {key: 4 if key == "zero_hpz_partition_size" else True}
    if stage is not None:
        zero["stage"] = stage
    default = r" \(DeepSpeed's default: zero_optimization.stage is not given\)" if stage is None \
        else ""
    with pytest.raises(DeepSpeedConfigError,
                       match=rf"zero_optimization.{key}=(4|true) needs zero_optimization.stage=3 "
                             rf".*, but zero_optimization.stage={stage or 0}{default}; accepted: "
                             rf"zero_optimization.stage=3, or zero_optimization.{key}=(1|false)"
                       ) as err:
        load({"zero_optimization": zero})
    assert "ZeroConfig" not in str(err.value)


def test_zeropp_error_lists_every_feature_that_is_on():
    cfg = {"zero_optimization": {"stage": 2, "zero_quantized_weights": True,
                                 "zero_quantized_gradients": True, "zero_hpz_partition_size": 1}}
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization.zero_quantized_weights=true "
                                                   r"and zero_optimization.zero_quantized_gradients"
                                                   r"=true need zero_optimization.stage=3"):
        load(cfg)


@pytest.mark.parametrize("zero", [
    {"stage": 2, "zero_hpz_partition_size": 1},
    {"stage": 2, "zero_hpz_partition_size": 0},
    {"stage": 1, "zero_quantized_weights": False, "zero_quantized_gradients": False},
    {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True},
], ids=["hpz-1", "hpz-0", "quantization-off", "stage-3"])
def test_zeropp_off_or_at_stage_3_loads(zero):
    assert load({"zero_optimization": zero}).zero.stage == zero["stage"]


def test_fp16_with_bf16_names_the_spelling_used():
    with pytest.raises(DeepSpeedConfigError, match=r"fp16.enabled and bfloat16.enabled are both "
                                                   r"true; accepted: at most one"):
        load({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})


# ---- hpZ against the mesh ------------------------------------------------------------------------

@pytest.mark.parametrize("given,local,used,how", [
    (16, 4, 4, "exceeds"),
    (8, 4, 4, "exceeds"),
    (3, 4, 4, "does not divide"),
    (6, 8, 8, "does not divide"),
    (4, 1, 1, "exceeds"),
    (4, 4, 4, None),
    (2, 4, 2, None),
    (4, 8, 4, None),
    (16, 16, 16, None),
    (1, 4, 1, None),
    (0, 4, 1, None),
])
def test_hpz_is_clamped_to_the_devices_per_node_with_a_warning(given, local, used, how):
    cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": given}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        zero = load_deepspeed_config(cfg, mesh_local_size=local).zero
    assert zero.hpz_partition_size == used
    zero.validate_for_mesh(local_devices=local, data_devices=2 * local)
    if how is None:
        assert not record
        return
    (warning,) = record
    assert warning.category is DeepSpeedConfigWarning
    assert warning.filename == __file__     # points at the caller of load_deepspeed_config
    off = " (hpZ off)" if used == 1 else ""
    assert str(warning.message).startswith(
        f"DeepSpeed config: zero_optimization.zero_hpz_partition_size={given} {how} the {local} "
        f"devices per node of the mesh; using zero_optimization.zero_hpz_partition_size={used}"
        f"{off}: ")


def test_hpz_is_kept_as_given_without_the_mesh():
    cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 16}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_deepspeed_config(cfg).zero.hpz_partition_size == 16


def test_mesh_local_size_does_not_touch_a_config_without_hpz():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_deepspeed_config({"zero_optimization": {"stage": 3}},
                                     mesh_local_size=4).zero == ZeroConfig(stage=3)


@pytest.mark.parametrize("bad", [0, -4, True, 4.0, "4"])
def test_invalid_mesh_local_size_is_an_error_naming_the_argument(bad):
    with pytest.raises(DeepSpeedConfigError, match=rf"mesh_local_size={bad!r} is invalid; "
                                                   r"accepted: None or an integer >= 1"):
        load_deepspeed_config({}, mesh_local_size=bad)


# ---- the ZeroConfig alone --------------------------------------------------------------------------

def test_zero_config_from_json_is_the_zero_of_the_loaded_config():
    cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 16}, "fp16": {
        "enabled": True}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        zero = zero_config_from_json(cfg, data_parallel_size=8, mesh_local_size=4)
    assert zero == load(cfg, mesh_local_size=4).zero == ZeroConfig(
        stage=3, hpz_partition_size=4, compute_dtype="float16", gradient_accumulation_steps=2)


def test_the_loader_is_importable_from_the_package():
    assert zeroxla.deepspeed.load_deepspeed_config is load_deepspeed_config
    assert zeroxla.deepspeed.zero_config_from_json is zero_config_from_json
