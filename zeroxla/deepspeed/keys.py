"""The DeepSpeed key table: every key DeepSpeed defines, how it is checked and where it goes.

A `Section` holds, for one JSON object (the top level, `fp16`, `bf16`, `zero_optimization`, an
optimizer's or a scheduler's `params`), the mapped keys (`Key`: a check, a destination and an
optional conversion), the ignored keys with the reason each has no effect in zeroxla, and
DeepSpeed's alternative spellings. `KEY_MAP` flattens the mapped keys into one table of
DeepSpeed key -> zeroxla destination; `describe_key_map()` prints it. Reading a JSON against
these tables is `zeroxla.deepspeed.config`'s job.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from zeroxla.deepspeed.checks import (Check, any_value, betas, boolean, choice, integer, number,
                                      only)
from zeroxla.deepspeed.offload import cpu_if, device_of, offload_section

# A `Key` says how one key is checked and where its value goes:
#   dest "zero.<field>"       -> that ZeroConfig field
#   dest "<field>"            -> that DeepSpeedConfig field
#   dest "optimizer.<name>"   -> that argument of the optax optimizer (zeroxla.optimizers)
#   dest "scheduler.<name>"   -> that argument of the schedule (zeroxla.lr_schedules)
# `convert` turns the DeepSpeed value into the zeroxla one.


@dataclasses.dataclass(frozen=True)
class Key:
    """One mapped DeepSpeed key: its check, its destination (see above), an optional conversion
    of the checked value, and a note for the printed table."""

    check: Check
    dest: str
    convert: Callable[[Any], Any] | None = None
    note: str = ""


def section(check_keys: Mapping[str, Key], ignored: Mapping[str, str],
            aliases: Mapping[str, str] | None = None) -> "Section":
    """A read-only Section from plain dicts."""
    return Section(types.MappingProxyType(dict(check_keys)), types.MappingProxyType(dict(ignored)),
                   types.MappingProxyType(dict(aliases or {})))


class Section(NamedTuple):
    """The keys of one JSON object: mapped, ignored (with why) and aliased."""

    keys: Mapping[str, Key]
    ignored: Mapping[str, str]          # key -> why it has no effect here
    aliases: Mapping[str, str]          # DeepSpeed's alternative spelling -> canonical key


_NO_OVERLAP = ("XLA schedules collectives and overlaps them with compute itself (latency-hiding "
               "scheduler); there is no separate communication stream or bucket to configure")
_MONITOR = ("zeroxla train prints progress and writes metrics.jsonl itself; DeepSpeed's monitors "
            "and profilers are not read")
_NO_OFFLOAD = ("zeroxla offloads to host memory only (offload_optimizer / offload_param with "
               "device 'cpu'); NVMe offload and its tuning are not implemented")
_NOT_HERE = "that DeepSpeed feature has no counterpart in zeroxla"

TOP_LEVEL = section(
    {
        "train_batch_size": Key(integer(1), "train_batch_size"),
        "train_micro_batch_size_per_gpu": Key(integer(1), "micro_batch_size"),
        "gradient_accumulation_steps": Key(integer(1), "zero.gradient_accumulation_steps"),
        "gradient_clipping": Key(number(0), "zero.gradient_clipping"),
        "sequence_parallel_size": Key(integer(1), "zero.sequence_parallel_size",  # Ulysses
                                      note="the mesh's 'sequence' axis; dp = world / sp"),
        "optimizer": Key(any_value(), "optimizer"),
        "scheduler": Key(any_value(), "learning_rate"),
        "fp16": Key(any_value(), "fp16"),
        "bf16": Key(any_value(), "bf16"),
        "zero_optimization": Key(any_value(), "zero"),
        "hybrid_engine": Key(any_value(), "hybrid_engine"),
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
        "seq_parallel_communication_data_type": ("sequence parallelism's all-to-alls move the "
                                                 "compute dtype (the fp16/bf16 sections)"),
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
        "pipeline": ("read by zeroxla.deepspeed.pipeline_config_from_json into a PipelineConfig "
                     "(pass it to make_step(pipeline=...)); the stage count is the mesh's"),
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

FP16 = section(
    {
        "enabled": Key(boolean(), "zero.compute_dtype", note='true -> "float16"'),
        "loss_scale": Key(number(0), "zero.loss_scale", note="0 = dynamic"),
        "initial_scale_power": Key(integer(0, 64), "zero.initial_scale_power"),
        "loss_scale_window": Key(integer(1), "zero.loss_scale_window"),
        "hysteresis": Key(integer(1), "zero.hysteresis"),
        "min_loss_scale": Key(number(positive=True), "zero.min_loss_scale"),
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

BF16 = section(
    {
        "enabled": Key(boolean(), "zero.compute_dtype", note='true -> "bfloat16"'),
        "check_grad_overflow": Key(boolean(), "zero.check_grad_overflow",
                                   note="skip the update on a non-finite gradient"),
    },
    {
        "immediate_grad_update": "gradients are applied once per step by the compiled step",
        "bf16_master_weights_and_grads": "master weights, gradients and optimizer state stay "
                                         "float32",
        "bf16_optimizer_states": "optimizer state stays float32",
    },
)

ZERO = section(
    {
        "stage": Key(integer(0, 3), "zero.stage"),
        "stage3_param_persistence_threshold": Key(integer(0), "zero.persistence_threshold"),
        "stage3_prefetch_bucket_size": Key(integer(0), "zero.prefetch",
                                           convert=lambda n: n > 0,
                                           note="> 0 -> True (one layer ahead)"),
        "stage3_max_live_parameters": Key(integer(1), "zero.max_live_parameters",
                                          note="prefetch only while two layers fit"),
        "zero_hpz_partition_size": Key(integer(0), "zero.hpz_partition_size",
                                       convert=lambda n: max(n, 1), note="0 or 1 = off"),
        "zero_quantized_weights": Key(boolean(), "zero.quantized_weights"),
        "zero_quantized_nontrainable_weights": Key(boolean(),
                                                   "zero.quantized_nontrainable_weights"),
        "zero_quantized_gradients": Key(boolean(), "zero.quantized_gradients"),
        # ZeRO-Offload (`zeroxla.engine.offload`). The pre-0.6 boolean spellings first, so that
        # messages name the current keys; pin_memory is read by `zero_config.offload_fields`.
        "cpu_offload": Key(boolean(), "zero.offload_optimizer", convert=cpu_if,
                           note="old name: true -> offload_optimizer.device 'cpu'"),
        "cpu_offload_param": Key(boolean(), "zero.offload_param", convert=cpu_if,
                                 note="old name: true -> offload_param.device 'cpu'"),
        "cpu_offload_use_pin_memory": Key(boolean(), "zero.offload_pin_memory",
                                          note="old name of pin_memory"),
        "offload_optimizer": Key(offload_section("offload_optimizer"), "zero.offload_optimizer",
                                 convert=device_of, note="device; pin_memory -> pinned_host"),
        "offload_param": Key(offload_section("offload_param"), "zero.offload_param",
                             convert=device_of, note="device; pin_memory -> pinned_host"),
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
        "zenflow": _NO_OFFLOAD + " (ZenFlow's stall-free offload)",
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
TYPED_SECTION = section(
    {"type": Key(any_value(), "type"), "params": Key(any_value(), "params")},
    {"legacy_fusion": "there is one (XLA-fused) implementation of each optimizer"},
)

_TORCH_IMPL = "selects a torch kernel implementation; XLA compiles one"
NO_GRAD_NORM = ("DeepSpeed rejects max_grad_norm in optimizer params too; use the top-level "
                "gradient_clipping key")

# Optimizer types (case-insensitive, as DeepSpeed lowercases its own) -> their params.
_ADAM_PARAMS = {
    "lr": Key(number(0), "optimizer.learning_rate"),
    "betas": Key(betas(), "optimizer.b1, b2"),
    "eps": Key(number(positive=True), "optimizer.eps"),
    "weight_decay": Key(number(0), "optimizer.weight_decay"),
    "adam_w_mode": Key(boolean(), "optimizer.decoupled",
                       note="true (default) -> decoupled weight decay (AdamW)"),
    "bias_correction": Key(only(True, "optax.scale_by_adam always corrects the bias"),
                           "optimizer.bias_correction"),
    "amsgrad": Key(only(False, "DeepSpeed's FusedAdam has no AMSGrad either"),
                   "optimizer.amsgrad"),
    "torch_adam": Key(boolean(), "optimizer.torch_adam",
                      note="true with AdamW -> torch.optim.AdamW's default weight_decay 0.01"),
    "maximize": Key(only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
}
_TORCH_IGNORED = {"foreach": _TORCH_IMPL, "fused": _TORCH_IMPL, "capturable": _TORCH_IMPL,
                  "differentiable": _TORCH_IMPL, "set_grad_none": _TORCH_IMPL}
_ADAM = section(_ADAM_PARAMS, _TORCH_IGNORED)
OPTIMIZERS: Mapping[str, Section] = types.MappingProxyType({
    "adam": _ADAM,
    "adamw": _ADAM,
    "lion": section({
        "lr": Key(number(0), "optimizer.learning_rate"),
        "betas": Key(betas(), "optimizer.b1, b2"),
        "weight_decay": Key(number(0), "optimizer.weight_decay"),
    }, _TORCH_IGNORED),
    "sgd": section({
        "lr": Key(number(0), "optimizer.learning_rate"),
        "momentum": Key(number(0, hi=1, hi_open=True), "optimizer.momentum"),
        "dampening": Key(only(0, "optax.trace has no dampening"), "optimizer.dampening"),
        "weight_decay": Key(number(0), "optimizer.weight_decay"),
        "nesterov": Key(boolean(), "optimizer.nesterov"),
        "maximize": Key(only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
    }, _TORCH_IGNORED),
    "adagrad": section({
        "lr": Key(number(0), "optimizer.learning_rate"),
        "lr_decay": Key(only(0, "use a scheduler section instead"), "optimizer.lr_decay"),
        "weight_decay": Key(number(0), "optimizer.weight_decay"),
        "initial_accumulator_value": Key(number(0), "optimizer.initial_accumulator_value"),
        "eps": Key(number(positive=True), "optimizer.eps"),
        "maximize": Key(only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
    }, _TORCH_IGNORED),
    "rmsprop": section({
        "lr": Key(number(0), "optimizer.learning_rate"),
        "alpha": Key(number(0, hi=1, hi_open=True), "optimizer.decay"),
        "eps": Key(number(positive=True), "optimizer.eps"),
        "weight_decay": Key(number(0), "optimizer.weight_decay"),
        "momentum": Key(number(0, hi=1, hi_open=True), "optimizer.momentum"),
        "centered": Key(boolean(), "optimizer.centered"),
        "maximize": Key(only(False, "zeroxla minimises the loss"), "optimizer.maximize"),
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

_WARMUP_TYPE = choice("log", "linear")
_LAST_ITERATION_IGNORED = ("the schedule follows TrainState.step, which a restored checkpoint "
                           "carries; there is no separate scheduler state to resume")
SCHEDULERS: Mapping[str, Section] = types.MappingProxyType({
    "WarmupLR": section({
        "warmup_min_lr": Key(number(0), "scheduler.warmup_min_lr"),
        "warmup_max_lr": Key(number(0), "scheduler.warmup_max_lr"),
        "warmup_num_steps": Key(integer(1), "scheduler.warmup_num_steps"),
        "warmup_type": Key(_WARMUP_TYPE, "scheduler.warmup_type"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
    "WarmupDecayLR": section({
        "total_num_steps": Key(integer(1), "scheduler.total_num_steps"),
        "warmup_min_lr": Key(number(0), "scheduler.warmup_min_lr"),
        "warmup_max_lr": Key(number(0), "scheduler.warmup_max_lr"),
        "warmup_num_steps": Key(integer(1), "scheduler.warmup_num_steps"),
        "warmup_type": Key(_WARMUP_TYPE, "scheduler.warmup_type"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
    "WarmupCosineLR": section({
        "total_num_steps": Key(integer(1), "scheduler.total_num_steps"),
        "warmup_min_ratio": Key(number(0), "scheduler.warmup_min_ratio"),
        "warmup_num_steps": Key(integer(1), "scheduler.warmup_num_steps"),
        "cos_min_ratio": Key(number(0), "scheduler.cos_min_ratio"),
        "warmup_type": Key(_WARMUP_TYPE, "scheduler.warmup_type"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
    "LRRangeTest": section({
        "lr_range_test_min_lr": Key(number(0), "scheduler.lr_range_test_min_lr"),
        "lr_range_test_step_size": Key(integer(1), "scheduler.lr_range_test_step_size"),
        "lr_range_test_step_rate": Key(number(0), "scheduler.lr_range_test_step_rate"),
        "lr_range_test_staircase": Key(boolean(), "scheduler.lr_range_test_staircase"),
    }, {"last_batch_iteration": _LAST_ITERATION_IGNORED}),
})
REQUIRED_SCHEDULER_PARAMS = {"WarmupDecayLR": ("total_num_steps",),
                             "WarmupCosineLR": ("total_num_steps",)}
UNSUPPORTED_SCHEDULERS = ("OneCycle",)


# The sections whose keys map onto ZeroConfig and DeepSpeedConfig fields, with their JSON prefix.
MAPPED_SECTIONS = (("", TOP_LEVEL), ("fp16.", FP16), ("bf16.", BF16),
                   ("zero_optimization.", ZERO))


def _flatten_key_map() -> dict[str, str]:
    table: dict[str, str] = {}
    for prefix, sec in MAPPED_SECTIONS:
        for key, spec in sec.keys.items():
            if spec.check.accepted != "any value" or prefix:
                table[prefix + key] = spec.dest + (f"  ({spec.note})" if spec.note else "")
    groups: dict[int, list[str]] = {}
    for name, sec in OPTIMIZERS.items():
        groups.setdefault(id(sec), []).append(OPTIMIZER_NAMES[name])
    for name, sec in OPTIMIZERS.items():
        label = "|".join(groups.pop(id(sec), []))
        for key, spec in sec.keys.items() if label else ():
            table[f"optimizer[{label}].params.{key}"] = spec.dest + (
                f"  ({spec.note})" if spec.note else "")
    for name, sec in SCHEDULERS.items():
        for key, spec in sec.keys.items():
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
