"""DeepSpeed JSON -> zeroxla: every key mapped, batch arithmetic, errors, warnings, schedules.

The expected values are computed here independently: learning rates from the formulas of
DeepSpeed's deepspeed/runtime/lr_schedules.py, optimizer updates from numpy re-implementations of
the torch/DeepSpeed update rules (FusedAdam, FusedLion, torch SGD/Adagrad/RMSprop).
"""

import json
import math
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zeroxla.sharding.config import ZeroConfig
from zeroxla.deepspeed.config import (BF16, FP16, KEY_MAP, OPTIMIZERS, SCHEDULERS, TOP_LEVEL, ZERO,
                                      DeepSpeedConfigError, DeepSpeedConfigWarning,
                                      describe_key_map, load_deepspeed_config,
                                      zero_config_from_json)

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"


def load(cfg, dp=8, **kw):
    """load_deepspeed_config with warnings for ignored keys silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return load_deepspeed_config(cfg, data_parallel_size=dp, **kw)


# ---- numpy references for the optimizer update rules -------------------------------------------

def ref_adam(p, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
             decoupled=True):
    """DeepSpeed FusedAdam (adam_w_mode) / torch Adam (L2)."""
    b1, b2 = betas
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if not decoupled:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        update = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        if decoupled:
            update = update + weight_decay * p
        p = p - lr * update
    return p


def ref_lion(p, grads, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0):
    """DeepSpeed FusedLion."""
    b1, b2 = betas
    m = np.zeros_like(p)
    for g in grads:
        update = np.sign(b1 * m + (1 - b1) * g)
        p = p * (1 - lr * weight_decay) - lr * update
        m = b2 * m + (1 - b2) * g
    return p


def ref_sgd(p, grads, lr=1e-3, momentum=0.0, weight_decay=0.0, nesterov=False):
    """torch.optim.SGD (dampening 0)."""
    buf = None
    for g in grads:
        g = g + weight_decay * p
        if momentum:
            buf = g if buf is None else momentum * buf + g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adagrad(p, grads, lr=1e-2, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
    """torch.optim.Adagrad (lr_decay 0)."""
    s = np.full_like(p, initial_accumulator_value)
    for g in grads:
        g = g + weight_decay * p
        s = s + g * g
        p = p - lr * g / (np.sqrt(s) + eps)
    return p


def ref_rmsprop(p, grads, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                centered=False):
    """torch.optim.RMSprop."""
    v, gavg, buf = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    for g in grads:
        g = g + weight_decay * p
        v = alpha * v + (1 - alpha) * g * g
        if centered:
            gavg = alpha * gavg + (1 - alpha) * g
            avg = np.sqrt(v - gavg * gavg) + eps
        else:
            avg = np.sqrt(v) + eps
        if momentum:
            buf = momentum * buf + g / avg
            p = p - lr * buf
        else:
            p = p - lr * g / avg
    return p


REFERENCES = {"Adam": ref_adam, "AdamW": ref_adam, "Lion": ref_lion, "SGD": ref_sgd,
              "Adagrad": ref_adagrad, "RMSprop": ref_rmsprop}
RNG = np.random.default_rng(0)
P0 = RNG.normal(size=(3, 5)).astype(np.float64)
GRADS = [RNG.normal(size=(3, 5)) for _ in range(4)]


def run_optax(optimizer, p0=P0, grads=GRADS):
    params = {"w": jnp.asarray(p0, jnp.float32)}
    state = optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params["w"], np.float64)


# ---- ds learning-rate formulas (deepspeed/runtime/lr_schedules.py), by last_batch_iteration ----

def ds_warmup_gamma(it, n, kind):
    n = max(2, n)
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def ds_warmup_lr(it, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):
    if it < 0:
        return warmup_min_lr
    n = max(2, warmup_num_steps)
    gamma = ds_warmup_gamma(it, n, warmup_type) if it < n else 1.0
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_decay_lr(it, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                       warmup_num_steps=1000, warmup_type="log"):
    if it < 0:
        return warmup_min_lr
    n = max(2, warmup_num_steps)
    if it < n:
        gamma = ds_warmup_gamma(it, n, warmup_type)
    else:
        gamma = max(0.0, (total_num_steps - it) / max(1.0, total_num_steps - n))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def ds_warmup_cosine_lr(it, base_lr, total_num_steps, warmup_min_ratio=0.0,
                        warmup_num_steps=1000, cos_min_ratio=0.0001, warmup_type="log"):
    if it < 0:
        return 0.0
    n = max(2, warmup_num_steps)
    if it < n:
        ratio = warmup_min_ratio + ds_warmup_gamma(it, n, warmup_type) * (1 - warmup_min_ratio)
    else:
        progress = min(1.0, (it - n + 1) / max(1, total_num_steps - n))
        ratio = max(0.0, cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi * progress))
                    / 2)
    return base_lr * ratio


def ds_lr_range_test(it, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                     lr_range_test_step_rate=1.0, lr_range_test_staircase=False):
    interval = (it + 1) / lr_range_test_step_size
    if lr_range_test_staircase:
        interval = math.floor(interval)
    return lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)


COUNTS = [0, 1, 2, 3, 7, 9, 10, 11, 25, 49, 50, 51, 99, 100, 101, 150, 500]


def assert_schedule(cfg, expected_by_iteration, counts=COUNTS):
    """optax count n runs with DeepSpeed's lr at last_batch_iteration n - 1 (scheduler steps
    after the optimizer; the constructor set the lr for iteration -1)."""
    schedule = load(cfg).learning_rate
    got = [float(schedule(jnp.int32(n))) for n in counts]
    want = [expected_by_iteration(n - 1) for n in counts]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12)


# ---- every mapped key, one assertion each -------------------------------------------------------

def zero_case(key, value, field, expected, extra=None):
    section, _, name = key.rpartition(".")
    if section:
        cfg = {section: {name: value}}
    else:
        cfg = {name: value}
    for k, v in (extra or {}).items():
        cfg.setdefault(k, {}).update(v) if isinstance(v, dict) else cfg.setdefault(k, v)
    return pytest.param(cfg, field, expected, id=key)


ZERO_CASES = [
    zero_case("gradient_accumulation_steps", 4, "gradient_accumulation_steps", 4,
              extra={"train_batch_size": 64}),
    zero_case("gradient_clipping", 1.5, "gradient_clipping", 1.5),
    zero_case("sequence_parallel_size", 2, "sequence_parallel_size", 2),
    zero_case("fp16.enabled", True, "compute_dtype", "float16"),
    zero_case("fp16.loss_scale", 128, "loss_scale", 128.0),
    zero_case("fp16.initial_scale_power", 12, "initial_scale_power", 12),
    zero_case("fp16.loss_scale_window", 200, "loss_scale_window", 200),
    zero_case("fp16.hysteresis", 3, "hysteresis", 3),
    zero_case("fp16.min_loss_scale", 0.5, "min_loss_scale", 0.5),
    zero_case("bf16.enabled", True, "compute_dtype", "bfloat16"),
    zero_case("bf16.check_grad_overflow", True, "check_grad_overflow", True),
    zero_case("zero_optimization.stage", 2, "stage", 2),
    zero_case("zero_optimization.stage3_param_persistence_threshold", 1234,
              "persistence_threshold", 1234),
    zero_case("zero_optimization.stage3_prefetch_bucket_size", 0, "prefetch", False),
    zero_case("zero_optimization.stage3_max_live_parameters", 3e6, "max_live_parameters",
              3_000_000),
    zero_case("zero_optimization.zero_hpz_partition_size", 4, "hpz_partition_size", 4,
              extra={"zero_optimization": {"stage": 3}}),
    zero_case("zero_optimization.zero_quantized_weights", True, "quantized_weights", True,
              extra={"zero_optimization": {"stage": 3}}),
    zero_case("zero_optimization.zero_quantized_nontrainable_weights", True,
              "quantized_nontrainable_weights", True,
              extra={"zero_optimization": {"stage": 3}}),
    zero_case("zero_optimization.zero_quantized_gradients", True, "quantized_gradients", True,
              extra={"zero_optimization": {"stage": 3}}),
    zero_case("zero_optimization.offload_optimizer", {"device": "cpu"}, "offload_optimizer",
              "cpu", extra={"zero_optimization": {"stage": 2}}),
    zero_case("zero_optimization.offload_param", {"device": "cpu", "pin_memory": True},
              "offload_pin_memory", True, extra={"zero_optimization": {"stage": 3}}),
    zero_case("zero_optimization.cpu_offload", True, "offload_optimizer", "cpu",
              extra={"zero_optimization": {"stage": 1}}),
    zero_case("zero_optimization.cpu_offload_param", True, "offload_param", "cpu",
              extra={"zero_optimization": {"stage": 3}}),
    zero_case("zero_optimization.cpu_offload_use_pin_memory", True, "offload_pin_memory", True,
              extra={"zero_optimization": {"stage": 2, "cpu_offload": True}}),
]


@pytest.mark.parametrize("cfg,field,expected", ZERO_CASES)
def test_zero_key_maps_to_its_zeroconfig_field(cfg, field, expected):
    assert getattr(load(cfg).zero, field) == expected


def test_train_batch_size_maps_to_train_batch_size():
    assert load({"train_batch_size": 64}).train_batch_size == 64


def test_train_micro_batch_size_per_gpu_maps_to_micro_batch_size():
    assert load({"train_micro_batch_size_per_gpu": 3}).micro_batch_size == 3


def test_bfloat16_is_an_alias_of_bf16():
    assert load({"bfloat16": {"enabled": True}}).zero.compute_dtype == "bfloat16"


def test_prefetch_bucket_size_positive_means_prefetch():
    assert load({"zero_optimization": {"stage3_prefetch_bucket_size": 5e7}}).zero.prefetch is True


def test_pydantic_field_names_are_accepted_like_in_deepspeed():
    cfg = {"zero_optimization": {"param_persistence_threshold": 77}}
    assert load(cfg).zero.persistence_threshold == 77


def test_no_zero_section_is_stage_0_as_in_deepspeed():
    assert load({}).zero == ZeroConfig(stage=0)


def test_zero_hpz_partition_size_0_means_off():
    assert load({"zero_optimization": {"zero_hpz_partition_size": 0}}).zero.hpz_partition_size == 1


def optimizer_case(type_, key, value, ref_kwargs, params=None):
    params = {**(params or {}), key: value}
    return pytest.param(type_, params, ref_kwargs, id=f"{type_}.{key}")


OPTIMIZER_CASES = [
    optimizer_case("AdamW", "lr", 0.01, {"lr": 0.01}),
    optimizer_case("AdamW", "betas", [0.8, 0.95], {"betas": (0.8, 0.95)}),
    optimizer_case("AdamW", "eps", 1e-3, {"eps": 1e-3}),
    optimizer_case("AdamW", "weight_decay", 0.1, {"weight_decay": 0.1}),
    optimizer_case("Adam", "adam_w_mode", False, {"weight_decay": 0.1, "decoupled": False},
                   params={"weight_decay": 0.1}),
    optimizer_case("Adam", "bias_correction", True, {}),
    optimizer_case("Adam", "amsgrad", False, {}),
    optimizer_case("AdamW", "torch_adam", True, {"weight_decay": 0.01}),   # torch AdamW default
    optimizer_case("Adam", "maximize", False, {}),
    optimizer_case("Lion", "lr", 0.01, {"lr": 0.01}),
    optimizer_case("Lion", "betas", [0.8, 0.9], {"betas": (0.8, 0.9)}),
    optimizer_case("Lion", "weight_decay", 0.5, {"weight_decay": 0.5}),
    optimizer_case("SGD", "lr", 0.1, {"lr": 0.1}),
    optimizer_case("SGD", "momentum", 0.9, {"momentum": 0.9}),
    optimizer_case("SGD", "dampening", 0, {}),
    optimizer_case("SGD", "weight_decay", 0.1, {"weight_decay": 0.1}),
    optimizer_case("SGD", "nesterov", True, {"momentum": 0.9, "nesterov": True},
                   params={"momentum": 0.9}),
    optimizer_case("SGD", "maximize", False, {}),
    optimizer_case("Adagrad", "lr", 0.1, {"lr": 0.1}),
    optimizer_case("Adagrad", "lr_decay", 0, {}),
    optimizer_case("Adagrad", "weight_decay", 0.1, {"weight_decay": 0.1}),
    optimizer_case("Adagrad", "initial_accumulator_value", 0.5, {"initial_accumulator_value": 0.5}),
    optimizer_case("Adagrad", "eps", 1e-3, {"eps": 1e-3}),
    optimizer_case("Adagrad", "maximize", False, {}),
    optimizer_case("RMSprop", "lr", 0.05, {"lr": 0.05}),
    optimizer_case("RMSprop", "alpha", 0.9, {"alpha": 0.9}),
    optimizer_case("RMSprop", "eps", 1e-3, {"eps": 1e-3}),
    optimizer_case("RMSprop", "weight_decay", 0.1, {"weight_decay": 0.1}),
    optimizer_case("RMSprop", "momentum", 0.9, {"momentum": 0.9}),
    optimizer_case("RMSprop", "centered", True, {"centered": True}),
    optimizer_case("RMSprop", "maximize", False, {}),
]


@pytest.mark.parametrize("type_,params,ref_kwargs", OPTIMIZER_CASES)
def test_optimizer_param_maps_to_the_optax_update(type_, params, ref_kwargs):
    ds = load({"optimizer": {"type": type_, "params": params}})
    want = REFERENCES[type_](P0, GRADS, **ref_kwargs)
    np.testing.assert_allclose(run_optax(ds.optimizer), want, rtol=2e-5, atol=2e-6)


def test_adam_defaults_to_decoupled_weight_decay_like_deepspeed():
    """DeepSpeed's "Adam" is FusedAdam with adam_w_mode=True: AdamW, not L2."""
    ds = load({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}}})
    decoupled = ref_adam(P0, GRADS, weight_decay=0.1, decoupled=True)
    assert np.allclose(run_optax(ds.optimizer), decoupled, rtol=2e-5, atol=2e-6)
    assert not np.allclose(decoupled, ref_adam(P0, GRADS, weight_decay=0.1, decoupled=False))


def test_optimizer_type_is_case_insensitive_and_recorded():
    ds = load({"optimizer": {"type": "adamw", "params": {"lr": 0.02}}})
    assert ds.optimizer_name == "adamw" and ds.lr_at(0) == pytest.approx(0.02)


def test_optimizer_without_params_uses_deepspeed_defaults():
    ds = load({"optimizer": {"type": "AdamW"}})
    np.testing.assert_allclose(run_optax(ds.optimizer), ref_adam(P0, GRADS), rtol=2e-5, atol=2e-6)
    assert ds.lr_at(0) == pytest.approx(1e-3)


SCHEDULE_CASES = [
    pytest.param({"type": "WarmupLR", "params": {"warmup_min_lr": 0.001}},
                 lambda it: ds_warmup_lr(it, warmup_min_lr=0.001, warmup_max_lr=0.1),
                 id="WarmupLR.warmup_min_lr"),
    pytest.param({"type": "WarmupLR", "params": {"warmup_max_lr": 0.3}},
                 lambda it: ds_warmup_lr(it, warmup_max_lr=0.3), id="WarmupLR.warmup_max_lr"),
    pytest.param({"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                 lambda it: ds_warmup_lr(it, warmup_max_lr=0.1, warmup_num_steps=10),
                 id="WarmupLR.warmup_num_steps"),
    pytest.param({"type": "WarmupLR", "params": {"warmup_type": "linear",
                                                 "warmup_num_steps": 50}},
                 lambda it: ds_warmup_lr(it, warmup_max_lr=0.1, warmup_num_steps=50,
                                         warmup_type="linear"), id="WarmupLR.warmup_type"),
    pytest.param({"type": "WarmupDecayLR", "params": {"total_num_steps": 120,
                                                      "warmup_num_steps": 10}},
                 lambda it: ds_warmup_decay_lr(it, 120, warmup_num_steps=10),
                 id="WarmupDecayLR.total_num_steps"),
    pytest.param({"type": "WarmupDecayLR", "params": {"total_num_steps": 100,
                                                      "warmup_min_lr": 1e-4}},
                 lambda it: ds_warmup_decay_lr(it, 100, warmup_min_lr=1e-4),
                 id="WarmupDecayLR.warmup_min_lr"),
    pytest.param({"type": "WarmupDecayLR", "params": {"total_num_steps": 100,
                                                      "warmup_max_lr": 0.02,
                                                      "warmup_num_steps": 5}},
                 lambda it: ds_warmup_decay_lr(it, 100, warmup_max_lr=0.02, warmup_num_steps=5),
                 id="WarmupDecayLR.warmup_max_lr"),
    pytest.param({"type": "WarmupDecayLR", "params": {"total_num_steps": 100,
                                                      "warmup_num_steps": 1}},
                 lambda it: ds_warmup_decay_lr(it, 100, warmup_num_steps=1),
                 id="WarmupDecayLR.warmup_num_steps"),
    pytest.param({"type": "WarmupDecayLR", "params": {"total_num_steps": 100,
                                                      "warmup_num_steps": 20,
                                                      "warmup_type": "linear"}},
                 lambda it: ds_warmup_decay_lr(it, 100, warmup_num_steps=20,
                                               warmup_type="linear"),
                 id="WarmupDecayLR.warmup_type"),
    pytest.param({"type": "WarmupCosineLR", "params": {"total_num_steps": 150,
                                                       "warmup_num_steps": 10}},
                 lambda it: ds_warmup_cosine_lr(it, 0.1, 150, warmup_num_steps=10),
                 id="WarmupCosineLR.total_num_steps"),
    pytest.param({"type": "WarmupCosineLR", "params": {"total_num_steps": 150,
                                                       "warmup_min_ratio": 0.1}},
                 lambda it: ds_warmup_cosine_lr(it, 0.1, 150, warmup_min_ratio=0.1),
                 id="WarmupCosineLR.warmup_min_ratio"),
    pytest.param({"type": "WarmupCosineLR", "params": {"total_num_steps": 150,
                                                       "warmup_num_steps": 50}},
                 lambda it: ds_warmup_cosine_lr(it, 0.1, 150, warmup_num_steps=50),
                 id="WarmupCosineLR.warmup_num_steps"),
    pytest.param({"type": "WarmupCosineLR", "params": {"total_num_steps": 120,
                                                       "warmup_num_steps": 10,
                                                       "cos_min_ratio": 0.2}},
                 lambda it: ds_warmup_cosine_lr(it, 0.1, 120, warmup_num_steps=10,
                                                cos_min_ratio=0.2),
                 id="WarmupCosineLR.cos_min_ratio"),
    pytest.param({"type": "WarmupCosineLR", "params": {"total_num_steps": 120,
                                                       "warmup_num_steps": 10,
                                                       "warmup_type": "linear"}},
                 lambda it: ds_warmup_cosine_lr(it, 0.1, 120, warmup_num_steps=10,
                                                warmup_type="linear"),
                 id="WarmupCosineLR.warmup_type"),
    pytest.param({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01}},
                 lambda it: ds_lr_range_test(it, lr_range_test_min_lr=0.01),
                 id="LRRangeTest.lr_range_test_min_lr"),
    pytest.param({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 10}},
                 lambda it: ds_lr_range_test(it, lr_range_test_step_size=10),
                 id="LRRangeTest.lr_range_test_step_size"),
    pytest.param({"type": "LRRangeTest", "params": {"lr_range_test_step_rate": 3.0}},
                 lambda it: ds_lr_range_test(it, lr_range_test_step_rate=3.0),
                 id="LRRangeTest.lr_range_test_step_rate"),
    pytest.param({"type": "LRRangeTest", "params": {"lr_range_test_staircase": True,
                                                    "lr_range_test_step_size": 10}},
                 lambda it: ds_lr_range_test(it, lr_range_test_staircase=True,
                                             lr_range_test_step_size=10),
                 id="LRRangeTest.lr_range_test_staircase"),
]


@pytest.mark.parametrize("scheduler,expected", SCHEDULE_CASES)
def test_scheduler_param_follows_deepspeeds_formula(scheduler, expected):
    assert_schedule({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                     "scheduler": scheduler}, expected)


def test_schedule_drives_the_optimizer_step_for_step():
    """The optimizer really uses the schedule: SGD's update at update n is -lr(n) * g."""
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 1.0}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6,
                                                             "warmup_num_steps": 2,
                                                             "warmup_max_lr": 0.5}}}
    ds = load(cfg)
    params = {"w": jnp.zeros(())}
    state = ds.optimizer.init(params)
    for n in range(8):
        updates, state = ds.optimizer.update({"w": jnp.ones(())}, state, params)
        assert float(updates["w"]) == pytest.approx(
            -ds_warmup_decay_lr(n - 1, 6, warmup_num_steps=2, warmup_max_lr=0.5), abs=1e-7)


def test_warmup_lr_max_defaults_to_the_optimizer_lr():
    assert_schedule({"optimizer": {"type": "AdamW", "params": {"lr": 0.07}},
                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
                    lambda it: ds_warmup_lr(it, warmup_max_lr=0.07, warmup_num_steps=10))


def test_warmup_decay_lr_max_defaults_to_0_001_not_the_optimizer_lr():
    assert_schedule({"optimizer": {"type": "AdamW", "params": {"lr": 0.07}},
                     "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}},
                    lambda it: ds_warmup_decay_lr(it, 50, warmup_max_lr=0.001))


def test_known_values_of_the_schedules():
    """A few values worked out by hand from DeepSpeed's formulas."""
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupDecayLR",
                         "params": {"total_num_steps": 110, "warmup_num_steps": 10,
                                    "warmup_max_lr": 0.1, "warmup_type": "linear"}}}
    lr = load(cfg).lr_at
    assert lr(0) == 0.0                          # iteration -1: warmup_min_lr
    assert lr(1) == 0.0                          # iteration 0: 0 / 10
    assert lr(6) == pytest.approx(0.05)          # iteration 5: 5 / 10
    assert lr(11) == pytest.approx(0.1)          # iteration 10: (110 - 10) / 100
    assert lr(61) == pytest.approx(0.05)         # iteration 60: (110 - 60) / 100
    assert lr(200) == 0.0
    cosine = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupCosineLR",
                            "params": {"total_num_steps": 12, "warmup_num_steps": 2,
                                       "cos_min_ratio": 0.0, "warmup_type": "linear"}}}
    lr = load(cosine).lr_at
    assert lr(0) == 0.0                          # WarmupCosineLR starts at 0
    assert lr(7) == pytest.approx(0.05)          # iteration 6: progress 5/10, cos = 0
    assert lr(100) == pytest.approx(0.0, abs=1e-9)


def test_scheduler_without_optimizer_section_still_gives_a_schedule():
    ds = load({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 4}}})
    assert ds.optimizer is None
    assert ds.lr_at(10) == pytest.approx(0.01)


def test_every_mapped_key_is_tested_above():
    tested = {p.id for p in ZERO_CASES}
    tested |= {"train_batch_size", "train_micro_batch_size_per_gpu", "optimizer.type",
               "scheduler.type"}
    names = {"Adam": "Adam|AdamW", "AdamW": "Adam|AdamW"}
    for case in OPTIMIZER_CASES:
        type_, key = case.id.split(".", 1)
        tested.add(f"optimizer[{names.get(type_, type_)}].params.{key}")
    for case in SCHEDULE_CASES:
        type_, key = case.id.split(".", 1)
        tested.add(f"scheduler[{type_}].params.{key}")
    assert set(KEY_MAP) == tested


def test_describe_key_map_lists_every_key():
    text = describe_key_map()
    assert all(key in text for key in KEY_MAP)


# ---- batch arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("given,expected", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, (64, 4, 2)),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, (64, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (64, 4, 2)),
    ({"train_batch_size": 32}, (32, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, (32, 4, 1)),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, (64, 4, 2)),
], ids=["fill-accumulation", "fill-micro", "fill-train", "train-only", "micro-only", "all-three"])
def test_batch_arithmetic_fills_the_missing_values_like_deepspeed(given, expected):
    ds = load(given, dp=8)
    assert (ds.train_batch_size, ds.micro_batch_size, ds.gradient_accumulation_steps) == expected


def test_batch_arithmetic_mismatch_names_the_keys_and_a_fix():
    with pytest.raises(DeepSpeedConfigError,
                       match=r"train_batch_size=60 != train_micro_batch_size_per_gpu=4 x "
                             r"gradient_accumulation_steps=2 x data-parallel size 8 \(= 64\).*"
                             r"e.g. train_batch_size=64"):
        load({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2}, dp=8)


def test_batch_arithmetic_floor_division_mismatch_is_caught():
    # DeepSpeed fills accumulation = 30 // 2 // 8 = 1, then its assertion fails: 30 != 16
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size=30 != .*\(= 16\)"):
        load({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2}, dp=8)


def test_batch_arithmetic_that_gives_zero_is_an_error():
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps=0"):
        load({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}, dp=8)


def test_batch_sizes_stay_unset_without_batch_keys():
    ds = load({"gradient_accumulation_steps": 2}, dp=None)
    assert (ds.train_batch_size, ds.micro_batch_size, ds.gradient_accumulation_steps) == (
        None, None, 2)


def test_data_parallel_size_defaults_to_the_device_count(devices):
    ds = load({"train_micro_batch_size_per_gpu": 2}, dp=None)
    assert ds.data_parallel_size == len(devices) and ds.train_batch_size == 2 * len(devices)


# ---- unknown keys, wrong types and ranges --------------------------------------------------------

@pytest.mark.parametrize("cfg,message", [
    ({"train_batch_sise": 8}, r"unknown DeepSpeed key 'train_batch_sise'; did you mean "
                              r"'train_batch_size'\?"),
    ({"zero_optimisation": {}}, r"'zero_optimisation'; did you mean 'zero_optimization'\?"),
    ({"zero_optimization": {"stage3_param_persistance_threshold": 1}},
     r"'zero_optimization.stage3_param_persistance_threshold'; did you mean "
     r"'zero_optimization.stage3_param_persistence_threshold'\?"),
    ({"zero_optimization": {"zero_quantize_weights": True}},
     r"did you mean 'zero_optimization.zero_quantized_weights'\?"),
    ({"fp16": {"intial_scale_power": 8}}, r"did you mean 'fp16.initial_scale_power'\?"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     r"'optimizer.params.weight_decy'; did you mean 'optimizer.params.weight_decay'\?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 0.1}}},
     r"did you mean 'scheduler.params.warmup_max_lr'\?"),
    ({"optimizer": {"type": "AdamW", "parms": {}}}, r"did you mean 'optimizer.params'\?"),
    ({"optimizer": {"type": "Adamm"}}, r"unknown optimizer.type 'Adamm'; did you mean 'Adam'\?"),
    ({"scheduler": {"type": "WarmupCosine", "params": {}}},
     r"did you mean 'WarmupCosineLR'\?"),
], ids=["top", "section", "zero", "zeropp", "fp16", "optimizer-params", "scheduler-params",
        "optimizer-section", "optimizer-type", "scheduler-type"])
def test_unknown_keys_name_the_closest_valid_key(cfg, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        load(cfg)


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    with pytest.raises(DeepSpeedConfigError, match="valid keys here: .*enabled"):
        load({"bf16": {"xyzzy": 1}})


@pytest.mark.parametrize("cfg,message", [
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage=4 is invalid; accepted: an "
                                          r"integer in \[0, 3\]"),
    ({"zero_optimization": {"stage": "3"}}, r"zero_optimization.stage=\"3\" is invalid"),
    ({"zero_optimization": {"stage": True}}, r"zero_optimization.stage=true is invalid"),
    ({"fp16": {"enabled": "yes"}}, r"fp16.enabled=\"yes\" is invalid; accepted: true or false"),
    ({"fp16": {"enabled": "auto"}}, r"Hugging Face Trainer placeholder"),
    ({"fp16": {"hysteresis": 0}}, r"fp16.hysteresis=0 is invalid; accepted: an integer >= 1"),
    ({"fp16": {"initial_scale_power": 65}}, r"an integer in \[0, 64\]"),
    ({"gradient_clipping": -1}, r"gradient_clipping=-1 is invalid; accepted: a number >= 0"),
    ({"train_batch_size": 0}, r"train_batch_size=0 is invalid; accepted: an integer >= 1"),
    ({"train_batch_size": 8.5}, r"train_batch_size=8.5 is invalid"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
     r"optimizer.params.betas=\[0.9\] is invalid; accepted: a list of two numbers in \[0, 1\)"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, r"optimizer.params.lr=-1"),
    ({"optimizer": {"type": "SGD", "params": {"dampening": 0.5}}},
     r"optimizer.params.dampening=0.5 is invalid; accepted: 0 \(optax.trace has no dampening\)"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
     r"bias_correction=false is invalid; accepted: true"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, r"gradient_clipping"),
    ({"optimizer": {"type": "OneBitAdam"}}, r"zeroxla does not support; accepted: Adam, AdamW"),
    ({"optimizer": {"type": "Lamb"}}, r"'Lamb' is a DeepSpeed optimizer that zeroxla does not"),
    ({"optimizer": {"params": {}}}, r"optimizer.type is missing"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, r"does not support"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
     r"warmup_type=\"cosine\" is invalid; accepted: 'log', 'linear'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
     r"warmup_num_steps=0 is invalid; accepted: an integer >= 1"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}},
     r"scheduler.params.total_num_steps is required by WarmupDecayLR"),
    ({"zero_optimization": [1]}, r"zero_optimization must be a JSON object"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"at most one"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
     r"zero_optimization.zero_quantized_weights=true needs zero_optimization.stage=3 .*, but "
     r"zero_optimization.stage=2; accepted: zero_optimization.stage=3, or "
     r"zero_optimization.zero_quantized_weights=false"),
], ids=lambda v: None if isinstance(v, str) else json.dumps(v)[:60])
def test_wrong_type_or_range_names_the_key_and_the_accepted_values(cfg, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        load(cfg)


def test_json_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 8,}')
    with pytest.raises(DeepSpeedConfigError, match="ds.json: not valid JSON"):
        load(bad)
    with pytest.raises(DeepSpeedConfigError, match="no such file"):
        load(tmp_path / "missing.json")
    good = tmp_path / "ok.json"
    good.write_text('{"zero_optimization": {"stage": 4}}')
    with pytest.raises(DeepSpeedConfigError, match=r"ok.json: zero_optimization.stage=4"):
        load(good)


# ---- ignored keys warn ---------------------------------------------------------------------------

def _ignored_cases():
    for prefix, section in (("", TOP_LEVEL), ("fp16.", FP16), ("bf16.", BF16),
                            ("zero_optimization.", ZERO)):
        for key in section.ignored:
            yield pytest.param(prefix, key, id=prefix + key)
    for key in OPTIMIZERS["adamw"].ignored:
        yield pytest.param("optimizer.params.", key, id="optimizer.params." + key)
    yield pytest.param("optimizer.", "legacy_fusion", id="optimizer.legacy_fusion")
    for key in SCHEDULERS["WarmupLR"].ignored:
        yield pytest.param("scheduler.params.", key, id="scheduler.params." + key)


def _config_with(prefix, key):
    if prefix == "":
        return {key: True}
    if prefix == "optimizer.params.":
        return {"optimizer": {"type": "AdamW", "params": {key: True}}}
    if prefix == "optimizer.":
        return {"optimizer": {"type": "AdamW", key: True}}
    if prefix == "scheduler.params.":
        return {"scheduler": {"type": "WarmupLR", "params": {key: -1}}}
    return {prefix[:-1]: {key: True}}


@pytest.mark.parametrize("prefix,key", list(_ignored_cases()))
def test_ignored_key_warns_naming_it_and_why(prefix, key):
    with pytest.warns(DeepSpeedConfigWarning, match=rf"DeepSpeed key '{prefix}{key}' is ignored: "
                                                    r"\w+"):
        ds = load_deepspeed_config(_config_with(prefix, key), data_parallel_size=8)
    assert prefix + key in ds.ignored


def test_mapped_keys_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_deepspeed_config(EXAMPLES / "ds_zero3_adamw_warmupdecay.json", data_parallel_size=8)


# ---- examples ------------------------------------------------------------------------------------

ZEROPP_TUTORIAL = {   # docs/_tutorials/zeropp.md in deepspeedai/DeepSpeed, verbatim
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 10000000,
        "reduce_scatter": False,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
}


def test_zeropp_tutorial_config_loads_unchanged():
    with pytest.warns(DeepSpeedConfigWarning) as record:
        zero = zero_config_from_json(ZEROPP_TUTORIAL)
    assert zero == ZeroConfig(stage=3, quantized_weights=True, hpz_partition_size=16,
                              quantized_gradients=True)
    assert sorted(str(w.message).split("'")[1] for w in record) == [
        "zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size", "zero_optimization.reduce_scatter"]


def test_zeropp_example_is_the_tutorial_with_a_persistence_threshold_for_gpt_tiny():
    """examples/ds_zeropp.json = the tutorial's config + stage3_param_persistence_threshold (see
    docs/zeropp.md): DeepSpeed's default threshold, 1e5, would keep every gpt-tiny parameter
    replicated."""
    example = json.loads((EXAMPLES / "ds_zeropp.json").read_text())
    threshold = example["zero_optimization"].pop("stage3_param_persistence_threshold")
    assert example == ZEROPP_TUTORIAL and threshold == 1000


def test_zeropp_example_partitions_and_quantizes_gpt_tiny_on_the_default_mesh():
    """The train job's default mesh is 2 nodes x 4 local devices: hpZ 16 is clamped to 4, and
    every weight matrix of gpt-tiny is over the persistence threshold, so it is partitioned and
    gathered with qwZ."""
    from flax import nnx

    from zeroxla.models import GPTConfig, abstract_model
    from zeroxla.models.axes import EMBED

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", DeepSpeedConfigWarning)
        zero = load_deepspeed_config(EXAMPLES / "ds_zeropp.json", mesh_local_size=4).zero
    assert [str(w.message) for w in record if "exceeds" in str(w.message)] == [
        f"{EXAMPLES / 'ds_zeropp.json'}: zero_optimization.zero_hpz_partition_size=16 exceeds the "
        "4 devices per node of the mesh; using zero_optimization.zero_hpz_partition_size=4: hpZ's "
        "secondary partition must lie inside a node, and DeepSpeed's ZeRO++ tutorial sets it to "
        "the devices per node"]
    assert zero.stage == 3 and zero.quantized_weights and zero.quantized_gradients
    assert zero.hpz_partition_size == 4
    zero.validate_for_mesh(local_devices=4, data_devices=8)
    # Weight matrices: the leaves over d_model with two or more dims per layer (biases and norm
    # scales are vectors per layer, or not over d_model). The threshold applies per layer.
    params = nnx.to_flat_state(nnx.state(abstract_model(GPTConfig.tiny()), nnx.Param))
    matrices = {}
    for path, var in params:
        axes = var.get_metadata()["logical_axes"]
        shape = var.get_value().shape
        shape = shape[1:] if axes[0] == "layers" else shape
        if EMBED in axes and len(shape) >= 2:
            matrices["/".join(map(str, path))] = math.prod(shape)
    assert {"embed/wte", "blocks/layers/wq", "blocks/layers/w_fc"} <= set(matrices)
    assert zero.persistence_threshold < min(matrices.values()), matrices


def test_zero3_adamw_warmupdecay_example():
    ds = load(EXAMPLES / "ds_zero3_adamw_warmupdecay.json")
    assert ds.zero == ZeroConfig(stage=3, persistence_threshold=0, gradient_clipping=1.0)
    assert (ds.train_batch_size, ds.micro_batch_size, ds.gradient_accumulation_steps) == (32, 4, 1)
    assert ds.optimizer_name == "adamw" and ds.scheduler_name == "WarmupDecayLR"
    assert ds.lr_at(51) == pytest.approx(0.003)


def test_fp16_example():
    ds = load(EXAMPLES / "ds_fp16.json")
    assert ds.zero == ZeroConfig(stage=2, compute_dtype="float16", initial_scale_power=12,
                                 loss_scale_window=100, gradient_clipping=1.0,
                                 gradient_accumulation_steps=2)
    assert ds.zero.uses_loss_scaling
    assert (ds.train_batch_size, ds.micro_batch_size) == (32, 2)
    assert ds.ignored == ("steps_per_print", "zero_optimization.overlap_comm",
                          "zero_optimization.contiguous_gradients")


def test_loaded_config_is_frozen():
    ds = load({"train_batch_size": 8})
    with pytest.raises(AttributeError):
        ds.train_batch_size = 16
    with pytest.raises(TypeError):
        ds.optimizer_params["lr"] = 1.0


def test_optimizer_runs_inside_jit():
    ds = load(EXAMPLES / "ds_zero3_adamw_warmupdecay.json")
    params = {"w": jnp.ones((4,))}
    state = ds.optimizer.init(params)
    updates, _ = jax.jit(ds.optimizer.update)({"w": jnp.ones((4,))}, state, params)
    assert updates["w"].shape == (4,)
