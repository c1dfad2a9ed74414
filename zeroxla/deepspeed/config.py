"""DeepSpeed's JSON config, read into zeroxla: the one place where DeepSpeed keys are mapped.

`load_deepspeed_config(path_or_dict, data_parallel_size=...)` returns a frozen `DeepSpeedConfig`:
`.zero` (a `ZeroConfig`), the batch sizes after DeepSpeed's batch arithmetic, `.learning_rate`
(an optax schedule that reproduces DeepSpeed's `lr_schedules.py` step for step, built by
`zeroxla.lr_schedules`) and `.optimizer` (the optax transformation for the `optimizer` section,
built by `zeroxla.optimizers`). `KEY_MAP` is the table of every mapped key and its destination;
`describe_key_map()` prints it.

Every key DeepSpeed defines falls in one of two groups:
  * mapped: it has exactly one destination (a `ZeroConfig` field, a `DeepSpeedConfig` field, or a
    parameter of the optimizer or schedule built from the config);
  * ignored: it configures something that has no meaning on XLA (bucket sizes, CUDA streams,
    offload, monitors, ...). Each ignored key present raises a `DeepSpeedConfigWarning` naming it
    and saying why.
A key DeepSpeed does not define is an error naming the closest valid key, and a value of the wrong
type or range is an error naming the key and the accepted values (`DeepSpeedConfigError`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import optax

from zeroxla.engine.config import ZeroConfig
from zeroxla.deepspeed.lr_schedules import Schedule, build_schedule
from zeroxla.deepspeed.optimizers import DEFAULT_LR, build_optimizer


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that zeroxla cannot use; the message names the key and the fix."""


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed key that is accepted but has no effect in zeroxla; the message says why."""


# ------------------------------------------------------------------------------------------------
# Value checks. Each returns the normalised value or raises _Invalid; `accepted` is what the error
# message lists.


class _Invalid(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Check:
    accepted: str
    fn: Callable[[Any], Any]

    def __call__(self, value: Any) -> Any:
        return self.fn(value)


def _integer(lo: int | None = None, hi: int | None = None) -> _Check:
    if lo is not None and hi is not None:
        accepted = f"an integer in [{lo}, {hi}]"
    elif lo is not None:
        accepted = f"an integer >= {lo}"
    else:
        accepted = "an integer"

    def fn(v):
        # JSON writes 5e8 as a float; DeepSpeed (pydantic) accepts integral floats for int keys.
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Invalid
        if isinstance(v, float):
            if not v.is_integer():
                raise _Invalid
            v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _Invalid
        return v

    return _Check(accepted, fn)


def _number(lo: float | None = None, *, positive: bool = False, hi: float | None = None,
            hi_open: bool = False) -> _Check:
    parts = []
    if positive:
        parts.append("> 0")
    elif lo is not None:
        parts.append(f">= {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    accepted = "a number" + (" " + " and ".join(parts) if parts else "")

    def fn(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _Invalid
        if positive and v <= 0 or lo is not None and v < lo:
            raise _Invalid
        if hi is not None and (v >= hi if hi_open else v > hi):
            raise _Invalid
        return float(v)

    return _Check(accepted, fn)


def _boolean() -> _Check:
    def fn(v):
        if not isinstance(v, bool):
            raise _Invalid
        return v

    return _Check("true or false", fn)


def _only(value: Any, why: str) -> _Check:
    """A key zeroxla accepts only at one value (DeepSpeed's default); `why` explains."""

    def fn(v):
        if v != value or isinstance(v, bool) != isinstance(value, bool):
            raise _Invalid
        return v

    return _Check(f"{json.dumps(value)} ({why})", fn)


def _choice(*options: str) -> _Check:
    def fn(v):
        if v not in options:
            raise _Invalid
        return v

    return _Check(", ".join(repr(o) for o in options), fn)


def _betas() -> _Check:
    def fn(v):
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1
                       for b in v)):
            raise _Invalid
        return (float(v[0]), float(v[1]))

    return _Check("a list of two numbers in [0, 1), e.g. [0.9, 0.999]", fn)


def _any() -> _Check:
    return _Check("any value", lambda v: v)


def _checked(key: str, value: Any, check: _Check, source: str) -> Any:
    try:
        return check(value)
    except _Invalid:
        hint = (" ('auto' is a Hugging Face Trainer placeholder that it fills in before DeepSpeed "
                "sees the config; write the value)") if value == "auto" else ""
        raise DeepSpeedConfigError(f"{source}: {key}={json.dumps(value)} is invalid; accepted: "
                                   f"{check.accepted}{hint}") from None


# ------------------------------------------------------------------------------------------------
# The key table. A `_Key` says how one key is checked and where its value goes:
#   dest "zero.<field>"       -> that ZeroConfig field
#   dest "<field>"            -> that DeepSpeedConfig field
#   dest "optimizer.<name>"   -> that argument of the optax optimizer (zeroxla.optimizers)
#   dest "scheduler.<name>"   -> that argument of the schedule (zeroxla.lr_schedules)
# `convert` turns the DeepSpeed value into the zeroxla one.


@dataclasses.dataclass(frozen=True)
class _Key:
    check: _Check
    dest: str
    convert: Callable[[Any], Any] | None = None
    note: str = ""


def _section(check_keys: Mapping[str, _Key], ignored: Mapping[str, str],
             aliases: Mapping[str, str] | None = None) -> "_Section":
    return _Section(types.MappingProxyType(dict(check_keys)), types.MappingProxyType(dict(ignored)),
                    types.MappingProxyType(dict(aliases or {})))


class _Section(NamedTuple):
    keys: Mapping[str, _Key]
    ignored: Mapping[str, str]          # key -> why it has no effect here
    aliases: Mapping[str, str]          # DeepSpeed's alternative spelling -> canonical key


_NO_OVERLAP = ("XLA schedules collectives and overlaps them with compute itself (latency-hiding "
               "scheduler); there is no separate communication stream or bucket to configure")
_MONITOR = ("zeroxla train prints progress and writes metrics.jsonl itself; DeepSpeed's monitors "
            "and profilers are not read")
_NO_OFFLOAD = ("zeroxla keeps parameters, gradients and optimizer state in device memory; "
               "CPU/NVMe offload is not implemented")
_NOT_HERE = "that DeepSpeed feature has no counterpart in zeroxla"

TOP_LEVEL = _section(
    {
        "train_batch_size": _Key(_integer(1), "train_batch_size"),
        "train_micro_batch_size_per_gpu": _Key(_integer(1), "micro_batch_size"),
        "gradient_accumulation_steps": _Key(_integer(1), "zero.gradient_accumulation_steps"),
        "gradient_clipping": _Key(_number(0), "zero.gradient_clipping"),
        "optimizer": _Key(_any(), "optimizer"),
        "scheduler": _Key(_any(), "learning_rate"),
        "fp16": _Key(_any(), "fp16"),
        "bf16": _Key(_any(), "bf16"),
        "zero_optimization": _Key(_any(), "zero"),
    },
    {
        "steps_per_print": _MONITOR,
        "wall_clock_breakdown": _MONITOR,
        "memory_breakdown": _MONITOR + " (use zeroxla.memory_report)",
        "dump_state": _MONITOR,
        "tensorboard": _MONITOR,
        "wandb": _MONITOR,
        "csv_monitor": _MONITOR,
        "comet": _MONITOR,
        "comms_logger": _MONITOR,
        "flops_profiler": _MONITOR,
        "timers": _MONITOR,
        "log_level": _MONITOR,
        "communication_data_type": ("collectives move the compute dtype (or int8/int4 blocks "
                                    "under zero_quantized_weights/zero_quantized_gradients)"),
        "seq_parallel_communication_data_type": _NOT_HERE + " (sequence parallelism)",
        "prescale_gradients": "gradients are averaged in one reduction; there is no pre-scaling",
        "gradient_predivide_factor": "gradients are averaged in one reduction; there is no "
                                     "pre-division",
        "gradient_allreduce_op": "gradients are always averaged over the data-parallel devices",
        "sparse_gradients": "JAX gradients are dense",
        "disable_allgather": _NO_OVERLAP,
        "zero_allow_untested_optimizer": "every optax optimizer works with every ZeRO stage here",
        "zero_force_ds_cpu_optimizer": _NO_OFFLOAD,
        "amp": "NVIDIA apex AMP has no JAX counterpart; use the fp16 or bf16 section",
        "torch_autocast": "torch.autocast has no JAX counterpart; use the fp16 or bf16 section",
        "activation_checkpointing": ("activation rematerialisation is an engine option "
                                     "(jax.checkpoint), not read from the DeepSpeed config"),
        "aio": _NO_OFFLOAD,
        "checkpoint": "checkpoints are written by zeroxla's own checkpoint module (orbax)",
        "nebula": "checkpoints are written by zeroxla's own checkpoint module (orbax)",
        "datastates": "checkpoints are written by zeroxla's own checkpoint module (orbax)",
        "elasticity": _NOT_HERE + " (elastic training)",
        "autotuning": _NOT_HERE + " (autotuning)",
        "compression_training": _NOT_HERE + " (compression training)",
        "quantize_training": _NOT_HERE + " (MoQ quantize training)",
        "weight_quantization": _NOT_HERE + " (inference weight quantization)",
        "sparse_attention": _NOT_HERE + " (sparse attention kernels)",
        "data_efficiency": "the data pipeline is zeroxla.data",
        "curriculum_learning": "the data pipeline is zeroxla.data",
        "dataloader_drop_last": "the data pipeline is zeroxla.data",
        "progressive_layer_drop": _NOT_HERE + " (progressive layer drop)",
        "eigenvalue": _NOT_HERE + " (eigenvalue-based MoQ)",
        "hybrid_engine": "the hybrid engine is configured in code, not from the DeepSpeed config",
        "pipeline": "pipeline parallelism is configured in code, not from the DeepSpeed config",
        "tensor_parallel": _NOT_HERE + " (AutoTP tensor parallelism)",
        "expert_parallel": _NOT_HERE + " (AutoEP expert parallelism)",
        "use_data_before_expert_parallelism": _NOT_HERE + " (expert parallelism)",
        "compile": "every step is compiled by XLA already",
        "graph_harvesting": "every step is compiled by XLA already",
        "data_types": ("gradients are accumulated in float32 and parameters kept in float32; "
                       "the compute dtype comes from the fp16/bf16 sections"),
        "managed_gradient_accumulation": ("gradient accumulation is always managed by the "
                                          "compiled step"),
    },
    aliases={"bfloat16": "bf16"},   # DeepSpeed's older name for the bf16 section
)

FP16 = _section(
    {
        "enabled": _Key(_boolean(), "zero.compute_dtype", note='true -> "float16"'),
        "loss_scale": _Key(_number(0), "zero.loss_scale", note="0 = dynamic"),
        "initial_scale_power": _Key(_integer(0, 64), "zero.initial_scale_power"),
        "loss_scale_window": _Key(_integer(1), "zero.loss_scale_window"),
        "hysteresis": _Key(_integer(1), "zero.hysteresis"),
        "min_loss_scale": _Key(_number(positive=True), "zero.min_loss_scale"),
    },
    {
        "auto_cast": "the model computes in ZeroConfig.compute_dtype throughout; inputs are "
                     "integer token ids",
        "consecutive_hysteresis": ("zeroxla's loss scaler uses DeepSpeed's default "
                                   "(non-consecutive) hysteresis"),
        "fp16_master_weights_and_grads": "master weights, gradients and optimizer state stay "
                                         "float32",
    },
)

BF16 = _section(
    {
        "enabled": _Key(_boolean(), "zero.compute_dtype", note='true -> "bfloat16"'),
    },
    {
        "immediate_grad_update": "gradients are applied once per step by the compiled step",
        "check_grad_overflow": "bf16 has float32's range; only fp16 checks for overflow",
        "bf16_master_weights_and_grads": "master weights, gradients and optimizer state stay "
                                         "float32",
        "bf16_optimizer_states": "optimizer state stays float32",
    },
)

ZERO = _section(
    {
        "stage": _Key(_integer(0, 3), "zero.stage"),
        "stage3_param_persistence_threshold": _Key(_integer(0), "zero.persistence_threshold"),
        "stage3_prefetch_bucket_size": _Key(_integer(0), "zero.prefetch",
                                            convert=lambda n: n > 0,
                                            note="> 0 -> True (XLA sizes the prefetch)"),
        "zero_hpz_partition_size": _Key(_integer(0), "zero.hpz_partition_size",
                                        convert=lambda n: max(n, 1), note="0 or 1 = off"),
        "zero_quantized_weights": _Key(_boolean(), "zero.quantized_weights"),
        "zero_quantized_nontrainable_weights": _Key(_boolean(),
                                                    "zero.quantized_nontrainable_weights"),
        "zero_quantized_gradients": _Key(_boolean(), "zero.quantized_gradients"),
    },
    {
        "overlap_comm": _NO_OVERLAP,
        "contiguous_gradients": "XLA allocates gradient buffers; there is no fragmentation to "
                                "avoid by copying into a contiguous buffer",
        "reduce_scatter": ("the reduction follows from the stage: stages 2-3 reduce-scatter, "
                           "stages 0-1 all-reduce"),
        "reduce_bucket_size": _NO_OVERLAP,
        "allgather_partitions": "the gather follows from the stage and the sharding plan",
        "allgather_bucket_size": _NO_OVERLAP,
        "use_multi_rank_bucket_allreduce": _NO_OVERLAP,
        "round_robin_gradients": _NO_OVERLAP,
        "stage3_max_live_parameters": ("XLA frees each gathered layer after use; liveness is "
                                       "decided by the compiler"),
        "stage3_max_reuse_distance": ("XLA frees each gathered layer after use; liveness is "
                                      "decided by the compiler"),
        "stage3_model_persistence_threshold": "only the per-parameter persistence threshold is "
                                              "supported",
        "stage3_module_granularity_threshold": "layers are gathered one stacked layer at a time",
        "stage3_use_all_reduce_for_fetch_params": "parameters are gathered with all-gather",
        "stage3_allgather_sequential": _NO_OVERLAP,
        "stage3_gather_16bit_weights_on_model_save": ("zeroxla checkpoints always hold the full "
                                                      "float32 parameters"),
        "stage3_gather_fp16_weights_on_model_save": ("zeroxla checkpoints always hold the full "
                                                     "float32 parameters"),
        "sub_group_size": "the optimizer updates each shard in one fused XLA computation",
        "load_from_fp32_weights": "checkpoints hold float32 master weights only",
        "elastic_checkpoint": "checkpoints are written by zeroxla's own checkpoint module",
        "ignore_unused_parameters": "unused parameters simply get zero gradients in JAX",
        "legacy_stage1": "there is one implementation per stage",
        "grad_hooks": "JAX has no gradient hooks; reductions are in the compiled step",
        "offload_param": _NO_OFFLOAD,
        "offload_optimizer": _NO_OFFLOAD,
        "cpu_offload": _NO_OFFLOAD,
        "cpu_offload_param": _NO_OFFLOAD,
        "cpu_offload_use_pin_memory": _NO_OFFLOAD,
        "zenflow": _NO_OFFLOAD,
        "mics_shard_size": _NOT_HERE + " (MiCS)",
        "mics_hierarchical_params_gather": _NOT_HERE + " (MiCS)",
        "zeropp_loco_param": _NOT_HERE + " (LoCo error feedback for qgZ)",
        "memory_efficient_linear": "XLA decides what to save for backward",
        "pipeline_loading_checkpoint": "checkpoints are written by zeroxla's own checkpoint module",
        "override_module_apply": "there are no torch module hooks to override",
        "log_trace_cache_warnings": "there are no torch module hooks to trace",
        "enable_sanity_checks": "the step is checked by the compiler",
        "save_muon_momentum_buffer_in_memory": _NO_OFFLOAD,
        "leaf_module": "layers are gathered one stacked layer at a time",
    },
    # pydantic aliases DeepSpeed accepts under their field names too
    aliases={
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential": "stage3_allgather_sequential",
    },
)

# The `optimizer` and `scheduler` sections: {"type": ..., "params": {...}}.
_TYPED_SECTION = _section(
    {"type": _Key(_any(), "type"), "params": _Key(_any(), "params")},
    {"legacy_fusion": "there is one (XLA-fused) implementation of each optimizer"},
)

_TORCH_IMPL = "selects a torch kernel implementation; XLA compiles one"
_NO_GRAD_NORM = ("DeepSpeed rejects max_grad_norm in optimizer params too; use the top-level "
                 "gradient_clipping key")

# Optimizer types (case-insensitive, as DeepSpeed lowercases its own) -> their params.
_ADAM_PARAMS = {
    "lr": _Key(_number(0), "optimizer.learning_rate"),
    "betas": _Key(_betas(), "optimizer.b1, b2"),
    "eps": _Key(_number(positive=True), "optimizer.eps"),
    "weight_decay": _Key(_number(0), "optimizer.weight_decay"),
    "adam_w_mode": _Key(_boolean(), "optimizer.decoupled",
                        note="true (default) -> decoupled weight decay (AdamW)"),
    "bias_correction": _Key(_only(True, "optax.scale_by_adam always corrects the bias"),
                            "optimizer.bias_correction"),
    "amsgrad": _Key(_only(False, "DeepSpeed's FusedAdam has no AMSGrad either"),
                    "optimizer.amsgrad"),
    "torch_adam": _Key(_boolean(), "optimizer.torch_adam",
                       note="true with AdamW -> torch.optim.AdamW's default weight_decay 0.01"),
    "maximize": _Key(_only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
}
_TORCH_IGNORED = {"foreach": _TORCH_IMPL, "fused": _TORCH_IMPL, "capturable": _TORCH_IMPL,
                  "differentiable": _TORCH_IMPL, "set_grad_none": _TORCH_IMPL}
_ADAM = _section(_ADAM_PARAMS, _TORCH_IGNORED)
OPTIMIZERS: Mapping[str, _Section] = types.MappingProxyType({
    "adam": _ADAM,
    "adamw": _ADAM,
    "lion": _section({
        "lr": _Key(_number(0), "optimizer.learning_rate"),
        "betas": _Key(_betas(), "optimizer.b1, b2"),
        "weight_decay": _Key(_number(0), "optimizer.weight_decay"),
    }, _TORCH_IGNORED),
    "sgd": _section({
        "lr": _Key(_number(0), "optimizer.learning_rate"),
        "momentum": _Key(_number(0, hi=1, hi_open=True), "optimizer.momentum"),
        "dampening": _Key(_only(0, "optax.trace has no dampening"), "optimizer.dampening"),
        "weight_decay": _Key(_number(0), "optimizer.weight_decay"),
        "nesterov": _Key(_boolean(), "optimizer.nesterov"),
        "maximize": _Key(_only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
    }, _TORCH_IGNORED),
    "adagrad": _section({
        "lr": _Key(_number(0), "optimizer.learning_rate"),
        "lr_decay": _Key(_only(0, "use a scheduler section instead"), "optimizer.lr_decay"),
        "weight_decay": _Key(_number(0), "optimizer.weight_decay"),
        "initial_accumulator_value": _Key(_number(0), "optimizer.initial_accumulator_value"),
        "eps": _Key(_number(positive=True), "optimizer.eps"),
        "maximize": _Key(_only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
    }, _TORCH_IGNORED),
    "rmsprop": _section({
        "lr": _Key(_number(0), "optimizer.learning_rate"),
        "alpha": _Key(_number(0, hi=1, hi_open=True), "optimizer.decay"),
        "eps": _Key(_number(positive=True), "optimizer.eps"),
        "weight_decay": _Key(_number(0), "optimizer.weight_decay"),
        "momentum": _Key(_number(0, hi=1, hi_open=True), "optimizer.momentum"),
        "centered": _Key(_boolean(), "optimizer.centered"),
        "maximize": _Key(_only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
    }, _TORCH_IGNORED),
})
# How DeepSpeed's docs spell the optimizer types (matching is case-insensitive, as in DeepSpeed).
OPTIMIZER_NAMES = types.MappingProxyType({"adam": "Adam", "adamw": "AdamW", "lion": "Lion",
                                          "sgd": "SGD", "adagrad": "Adagrad",
                                          "rmsprop": "RMSprop"})
# DeepSpeed optimizers zeroxla does not build. zeroxla's step updates flat per-device partitions,
# so an optimizer must be elementwise: LAMB's per-tensor trust ratio (and Muon's per-matrix
# orthogonalisation) would be computed per partition; the 1-bit/0-1 variants are communication
# schemes of DeepSpeed's engine.
UNSUPPORTED_OPTIMIZERS = ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon", "MuAdam",
                          "MuAdamW", "MuSGD")

_WARMUP_TYPE = _choice("log", "linear")
_LAST_ITERATION_IGNORED = ("the schedule follows TrainState.step, which a restored checkpoint "
                           "carries; there is no separate scheduler state to resume")
SCHEDULERS: Mapping[str, _Section] = types.MappingProxyType({
    "WarmupLR": _section({
        "warmup_min_lr": _Key(_number(0), "scheduler.warmup_min_lr"),
        "warmup_max_lr": _Key(_number(0), "scheduler.warmup_max_lr"),
        "warmup_num_steps": _Key(_integer(1), "scheduler.warmup_num_steps"),
        "warmup_type": _Key(_WARMUP_TYPE, "scheduler.warmup_type"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
    "WarmupDecayLR": _section({
        "total_num_steps": _Key(_integer(1), "scheduler.total_num_steps"),
        "warmup_min_lr": _Key(_number(0), "scheduler.warmup_min_lr"),
        "warmup_max_lr": _Key(_number(0), "scheduler.warmup_max_lr"),
        "warmup_num_steps": _Key(_integer(1), "scheduler.warmup_num_steps"),
        "warmup_type": _Key(_WARMUP_TYPE, "scheduler.warmup_type"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
    "WarmupCosineLR": _section({
        "total_num_steps": _Key(_integer(1), "scheduler.total_num_steps"),
        "warmup_min_ratio": _Key(_number(0), "scheduler.warmup_min_ratio"),
        "warmup_num_steps": _Key(_integer(1), "scheduler.warmup_num_steps"),
        "cos_min_ratio": _Key(_number(0), "scheduler.cos_min_ratio"),
        "warmup_type": _Key(_WARMUP_TYPE, "scheduler.warmup_type"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
    "LRRangeTest": _section({
        "lr_range_test_min_lr": _Key(_number(0), "scheduler.lr_range_test_min_lr"),
        "lr_range_test_step_size": _Key(_integer(1), "scheduler.lr_range_test_step_size"),
        "lr_range_test_step_rate": _Key(_number(0), "scheduler.lr_range_test_step_rate"),
        "lr_range_test_staircase": _Key(_boolean(), "scheduler.lr_range_test_staircase"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
})
_REQUIRED_SCHEDULER_PARAMS = {"WarmupDecayLR": ("total_num_steps",),
                              "WarmupCosineLR": ("total_num_steps",)}
UNSUPPORTED_SCHEDULERS = ("OneCycle",)


def _flatten_key_map() -> dict[str, str]:
    table: dict[str, str] = {}
    for prefix, section in (("", TOP_LEVEL), ("fp16.", FP16), ("bf16.", BF16),
                            ("zero_optimization.", ZERO)):
        for key, spec in section.keys.items():
            if spec.check.accepted != "any value" or prefix:
                table[prefix + key] = spec.dest + (f"  ({spec.note})" if spec.note else "")
    groups: dict[int, list[str]] = {}
    for name, section in OPTIMIZERS.items():
        groups.setdefault(id(section), []).append(OPTIMIZER_NAMES[name])
    for name, section in OPTIMIZERS.items():
        label = "|".join(groups.pop(id(section), []))
        for key, spec in section.keys.items() if label else ():
            table[f"optimizer[{label}].params.{key}"] = spec.dest + (
                f"  ({spec.note})" if spec.note else "")
    for name, section in SCHEDULERS.items():
        for key, spec in section.keys.items():
            table[f"scheduler[{name}].params.{key}"] = spec.dest
    table["optimizer.type"] = "optimizer (the optax transformation built here)"
    table["scheduler.type"] = "learning_rate (the optax schedule built here)"
    return table


# Every mapped DeepSpeed key -> its one destination in zeroxla.
KEY_MAP: Mapping[str, str] = types.MappingProxyType(_flatten_key_map())


def describe_key_map() -> str:
    """The mapping table as text: DeepSpeed key, then where its value goes."""
    width = max(map(len, KEY_MAP))
    lines = [f"{'DeepSpeed key':<{width}}  zeroxla destination", "-" * (width + 22)]
    lines += [f"{key:<{width}}  {dest}" for key, dest in KEY_MAP.items()]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Reading sections.


def _read_section(raw: Any, path: str, section: _Section, source: str,
                  ignored_out: list[str]) -> dict[str, Any]:
    """Checks one JSON object against `section`: canonical key -> checked value.

    Ignored keys warn (and are recorded in `ignored_out`); unknown keys raise with a suggestion.
    """
    where = path.rstrip(".") or "the top level"
    if not isinstance(raw, Mapping):
        raise DeepSpeedConfigError(f"{source}: {where} must be a JSON object (a dict), got "
                                   f"{json.dumps(raw)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        canonical = section.aliases.get(key, key)
        dotted = path + key
        if canonical in section.ignored:
            ignored_out.append(dotted)
            warnings.warn(f"DeepSpeed key {dotted!r} is ignored: {section.ignored[canonical]}",
                          DeepSpeedConfigWarning, stacklevel=3)
            continue
        if canonical not in section.keys:
            valid = sorted(set(section.keys) | set(section.ignored) | set(section.aliases))
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = (f"did you mean {path + close[0]!r}?" if close
                    else "valid keys here: " + ", ".join(valid))
            raise DeepSpeedConfigError(f"{source}: unknown DeepSpeed key {dotted!r}; {hint}")
        if canonical in out:
            raise DeepSpeedConfigError(f"{source}: {dotted!r} is given twice (as {key!r} and an "
                                       "alias of it); give it once")
        out[canonical] = _checked(dotted, value, section.keys[canonical].check, source)
    return out


def _read_type(raw: Any, path: str, known: Mapping[str, str], unsupported: tuple[str, ...],
               source: str) -> str:
    """The section's `type` as a key of `known` (canonical -> display name), matched
    case-insensitively; errors name the closest supported type."""
    accepted = ", ".join(known.values())
    if not isinstance(raw, str):
        raise DeepSpeedConfigError(f"{source}: {path}type={json.dumps(raw)} is invalid; "
                                   f"accepted: {accepted}")
    by_lower = {display.lower(): name for name, display in known.items()}
    if raw.lower() in by_lower:
        return by_lower[raw.lower()]
    if raw.lower() in (u.lower() for u in unsupported):
        raise DeepSpeedConfigError(f"{source}: {path}type={raw!r} is a DeepSpeed {path[:-1]} that "
                                   f"zeroxla does not support; accepted: {accepted}")
    close = difflib.get_close_matches(raw, list(known.values()), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise DeepSpeedConfigError(f"{source}: unknown {path}type {raw!r}; {hint}accepted: "
                               f"{accepted}")


# ------------------------------------------------------------------------------------------------
# The config.


@dataclasses.dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed JSON config read into zeroxla.

    zero: the ZeroConfig (stage, ZeRO++, precision, loss scaling, clipping, accumulation).
    train_batch_size / micro_batch_size: after DeepSpeed's batch arithmetic
        (train_batch_size = micro_batch_size x gradient_accumulation_steps x data_parallel_size);
        None when the JSON sets neither.
    optimizer: the optax transformation for the `optimizer` section (None without one).
    learning_rate: the optax schedule for the `scheduler` section, or the optimizer's constant lr;
        None when the JSON has neither section.
    given: the dotted keys present in the JSON; ignored: those that warned and have no effect.
    """

    zero: ZeroConfig
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    data_parallel_size: int | None = None
    optimizer_name: str | None = None
    optimizer_params: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    optimizer: optax.GradientTransformation | None = None
    scheduler_name: str | None = None
    scheduler_params: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    learning_rate: float | Schedule | None = None
    given: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = ()
    source: str = "DeepSpeed config"

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.zero.gradient_accumulation_steps

    def lr_at(self, count: int) -> float | None:
        """The learning rate of update `count` (0 = the first), or None without one."""
        if self.learning_rate is None:
            return None
        if callable(self.learning_rate):
            return float(self.learning_rate(count))
        return float(self.learning_rate)


def read_deepspeed_json(source: Any) -> tuple[dict, str]:
    """(the JSON object, a name for messages) from a path or a dict (copied)."""
    if isinstance(source, Mapping):
        return dict(source), "DeepSpeed config"
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise DeepSpeedConfigError(f"DeepSpeed config {path!r}: no such file; accepted: a "
                                       "path to a JSON file or a dict")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as err:
                raise DeepSpeedConfigError(f"{path}: not valid JSON (line {err.lineno}, column "
                                           f"{err.colno}: {err.msg})") from None
        if not isinstance(raw, dict):
            raise DeepSpeedConfigError(f"{path}: the top level must be a JSON object")
        return raw, path
    raise DeepSpeedConfigError(f"DeepSpeed config {source!r} is invalid; accepted: a path to a "
                               "JSON file or a dict")


def _dotted_keys(raw: Mapping, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in raw.items():
        keys.add(prefix + key)
        if isinstance(value, Mapping):
            keys |= _dotted_keys(value, prefix + key + ".")
    return keys


def _batch_sizes(top: Mapping[str, Any], data_parallel_size: int | None,
                 source: str) -> tuple[int | None, int | None, int, int | None]:
    """DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion`.

    Returns (train_batch_size, micro_batch_size, gradient_accumulation_steps, dp size). Without
    either batch key the batch sizes stay None (a config snippet such as ZeRO++'s).
    """
    train = top.get("train_batch_size")
    micro = top.get("train_micro_batch_size_per_gpu")
    accum = top.get("gradient_accumulation_steps")
    if train is None and micro is None:
        return None, None, 1 if accum is None else accum, data_parallel_size
    if data_parallel_size is None:
        data_parallel_size = jax.device_count()   # the default mesh spans every device
    dp = data_parallel_size
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise DeepSpeedConfigError(f"data_parallel_size={dp!r} is invalid; accepted: an integer "
                                   ">= 1 (the number of data-parallel devices)")
    # Fill the missing one(s) exactly as DeepSpeed does (floor division), then check.
    if train is not None and micro is not None and accum is None:
        accum = train // micro // dp
    elif train is not None and accum is not None and micro is None:
        micro = train // dp // accum
    elif micro is not None and accum is not None and train is None:
        train = micro * accum * dp
    elif train is not None and micro is None and accum is None:
        accum, micro = 1, train // dp
    elif micro is not None and train is None and accum is None:
        train, accum = micro * dp, 1
    for key, value in (("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accum)):
        if value < 1:
            raise DeepSpeedConfigError(
                f"{source}: batch arithmetic gives {key}={value} (train_batch_size={train}, "
                f"train_micro_batch_size_per_gpu={micro}, gradient_accumulation_steps={accum}, "
                f"data-parallel size {dp}); accepted: train_batch_size >= "
                f"{(micro or 1) * (accum or 1) * dp}, a multiple of the data-parallel size {dp}")
    if train != micro * accum * dp:
        raise DeepSpeedConfigError(
            f"{source}: train_batch_size={train} != train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accum} x data-parallel size {dp} (= "
            f"{micro * accum * dp}); accepted: values with train_batch_size = micro x "
            f"accumulation x {dp}, e.g. train_batch_size={micro * accum * dp}")
    return train, micro, accum, dp


_ZERO_KEY_OF_FIELD = {spec.dest.removeprefix("zero."): f"{prefix}{key}"
                      for prefix, section in (("", TOP_LEVEL), ("fp16.", FP16), ("bf16.", BF16),
                                              ("zero_optimization.", ZERO))
                      for key, spec in section.keys.items() if spec.dest.startswith("zero.")}


def load_deepspeed_config(source: str | os.PathLike | Mapping[str, Any], *,
                          data_parallel_size: int | None = None,
                          name: str | None = None) -> DeepSpeedConfig:
    """Reads a DeepSpeed JSON config (a path or a dict) into a `DeepSpeedConfig`.

    `data_parallel_size` is DeepSpeed's world size for the batch arithmetic (the mesh's
    nodes x local); it defaults to `jax.device_count()` and is only needed when the JSON sets a
    batch size. Raises `DeepSpeedConfigError` for unknown keys (naming the closest valid one),
    wrong types or ranges (naming the accepted values) and inconsistent batch sizes; warns with
    `DeepSpeedConfigWarning` for each key that has no effect in zeroxla. Messages name the
    source as `name` (default: the path, or "DeepSpeed config" for a dict).
    """
    raw, src = read_deepspeed_json(source)
    src = name or src
    ignored: list[str] = []
    top = _read_section(raw, "", TOP_LEVEL, src, ignored)
    if "bf16" in raw and "bfloat16" in raw:
        raise DeepSpeedConfigError(f"{src}: both 'bf16' and its old name 'bfloat16' are given; "
                                   "keep 'bf16'")
    fp16 = _read_section(top.get("fp16", {}), "fp16.", FP16, src, ignored)
    bf16_name = "bfloat16." if "bfloat16" in raw else "bf16."
    bf16 = _read_section(top.get("bf16", {}), bf16_name, BF16, src, ignored)
    zero_raw = _read_section(top.get("zero_optimization", {}), "zero_optimization.", ZERO, src,
                             ignored)

    # ZeroConfig fields, each from exactly one key. Without a zero_optimization section DeepSpeed
    # runs stage 0 (its default), so that is the default here too.
    fields: dict[str, Any] = {"stage": 0}
    for section, values in ((TOP_LEVEL, top), (FP16, fp16), (ZERO, zero_raw)):
        for key, value in values.items():
            spec = section.keys[key]
            if spec.dest.startswith("zero.") and spec.dest != "zero.compute_dtype":
                fields[spec.dest.removeprefix("zero.")] = (spec.convert(value) if spec.convert
                                                           else value)
    if fp16.get("enabled") and bf16.get("enabled"):
        raise DeepSpeedConfigError(f"{src}: fp16.enabled and {bf16_name}enabled are both true; "
                                   "accepted: at most one (DeepSpeed asserts the same)")
    if fp16.get("enabled"):
        fields["compute_dtype"] = "float16"
    elif bf16.get("enabled"):
        fields["compute_dtype"] = "bfloat16"

    train, micro, accum, dp = _batch_sizes(top, data_parallel_size, src)
    fields["gradient_accumulation_steps"] = accum
    try:
        zero = ZeroConfig(**fields)
    except ValueError as err:
        field = str(err).split("=", 1)[0].removeprefix("ZeroConfig.")
        key = _ZERO_KEY_OF_FIELD.get(field, field)
        raise DeepSpeedConfigError(f"{src}: {key} -> {err}") from None

    opt_name, opt_params, optimizer = None, {}, None
    base_lr = None
    if "optimizer" in top:
        sec = _read_section(top["optimizer"], "optimizer.", _TYPED_SECTION, src, ignored)
        if "type" not in sec:
            raise DeepSpeedConfigError(f"{src}: optimizer.type is missing; accepted: "
                                       + ", ".join(OPTIMIZER_NAMES.values()))
        opt_name = _read_type(sec["type"], "optimizer.", OPTIMIZER_NAMES, UNSUPPORTED_OPTIMIZERS,
                              src)
        params_raw = sec.get("params", {})
        if isinstance(params_raw, Mapping) and "max_grad_norm" in params_raw:
            raise DeepSpeedConfigError(f"{src}: optimizer.params.max_grad_norm is not accepted: "
                                       f"{_NO_GRAD_NORM}")
        opt_params = _read_section(params_raw, "optimizer.params.", OPTIMIZERS[opt_name], src,
                                   ignored)
        base_lr = opt_params.get("lr", DEFAULT_LR[opt_name])

    sched_name, sched_params, learning_rate = None, {}, base_lr
    if "scheduler" in top:
        sec = _read_section(top["scheduler"], "scheduler.", _TYPED_SECTION, src, ignored)
        if "type" not in sec:
            raise DeepSpeedConfigError(f"{src}: scheduler.type is missing; accepted: "
                                       + ", ".join(SCHEDULERS))
        sched_name = _read_type(sec["type"], "scheduler.", {n: n for n in SCHEDULERS},
                                UNSUPPORTED_SCHEDULERS, src)
        sched_params = _read_section(sec.get("params", {}), "scheduler.params.",
                                     SCHEDULERS[sched_name], src, ignored)
        for key in _REQUIRED_SCHEDULER_PARAMS.get(sched_name, ()):
            if key not in sched_params:
                raise DeepSpeedConfigError(f"{src}: scheduler.params.{key} is required by "
                                           f"{sched_name}; accepted: an integer >= 1")
        # Without an optimizer section DeepSpeed schedules the client's optimizer; its lr is
        # unknown here, so WarmupLR/WarmupCosineLR use FusedAdam's default 1e-3.
        learning_rate = build_schedule(sched_name, sched_params,
                                        DEFAULT_LR["adam"] if base_lr is None else base_lr)
    if opt_name is not None:
        optimizer = build_optimizer(opt_name, opt_params, learning_rate)

    return DeepSpeedConfig(
        zero=zero, train_batch_size=train, micro_batch_size=micro, data_parallel_size=dp,
        optimizer_name=opt_name, optimizer_params=types.MappingProxyType(opt_params),
        optimizer=optimizer, scheduler_name=sched_name,
        scheduler_params=types.MappingProxyType(sched_params), learning_rate=learning_rate,
        given=frozenset(_dotted_keys(raw)), ignored=tuple(ignored), source=src)


__all__ = ["BF16", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigWarning", "FP16",
           "KEY_MAP", "OPTIMIZERS", "OPTIMIZER_NAMES", "SCHEDULERS", "TOP_LEVEL", "ZERO",
           "describe_key_map", "load_deepspeed_config", "read_deepspeed_json"]
