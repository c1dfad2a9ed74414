"""DeepSpeed's JSON config, read into zeroxla: the loader.

`load_deepspeed_config(path_or_dict, world_size=..., mesh_local_size=...)` returns a frozen
`DeepSpeedConfig`: `.zero` (a `ZeroConfig`), the batch sizes after DeepSpeed's batch arithmetic,
`.learning_rate` (an optax schedule that reproduces DeepSpeed's `lr_schedules.py` step for step,
built by `zeroxla.deepspeed.lr_schedules`) and `.optimizer` (the optax transformation for the
`optimizer` section, built by `zeroxla.deepspeed.optimizers`) and `.hybrid_engine` (the
`HybridEngineConfig`, when the section is given): each section read once, into typed values.
`zero_config_from_json(path)` is the `ZeroConfig` alone.

Every key DeepSpeed defines falls in one of two groups:
  * mapped: it has exactly one destination (a `ZeroConfig` field, a `DeepSpeedConfig` field, or a
    parameter of the optimizer or schedule built from the config);
  * ignored: it configures something that has no meaning on XLA (bucket sizes, CUDA streams,
    offload, monitors, ...). Each ignored key present raises a `DeepSpeedConfigWarning` naming it
    and saying why.
A key DeepSpeed does not define is an error naming the closest valid key, and a value of the wrong
type or range is an error naming the key and the accepted values (`DeepSpeedConfigError`); so is a
combination of keys that does not fit together. Errors name the JSON key, not the zeroxla field.

Where each part lives:
    keys.py         the key table (`KEY_MAP`, `describe_key_map()`): each key's check and destination
    checks.py       the value checks and the two exception classes
    zero_config.py  the ZeroConfig keys checked together and against the mesh (the hpZ clamp)
    config.py       this loader: sections read against the table, batch arithmetic, assembly
The public names of `keys.py` and `checks.py` are re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import optax

from zeroxla.deepspeed.checks import DeepSpeedConfigError, DeepSpeedConfigWarning, checked
from zeroxla.deepspeed.keys import (BF16, FP16, KEY_MAP, NO_GRAD_NORM, OPTIMIZER_NAMES, OPTIMIZERS,
                                    REQUIRED_SCHEDULER_PARAMS, SCHEDULERS, TOP_LEVEL,
                                    TYPED_SECTION, UNSUPPORTED_OPTIMIZERS, UNSUPPORTED_SCHEDULERS,
                                    ZERO, Section, describe_key_map)
from zeroxla.deepspeed.lr_schedules import Schedule
from zeroxla.deepspeed.optimizers import optimizer_and_schedule
from zeroxla.deepspeed.overrides import BATCH_KEYS, Overrides, apply_overrides
from zeroxla.deepspeed.zero_config import (build_zero_config, check_mesh_local_size,
                                           data_parallel_world, keys_of_field, zero_fields)
from zeroxla.inference.config import HybridEngineConfig, hybrid_engine_config_from_section
from zeroxla.sharding.config import ZeroConfig


# ------------------------------------------------------------------------------------------------
# Reading sections.


def _read_section(raw: Any, path: str, section: Section, source: str,
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
        out[canonical] = checked(dotted, value, section.keys[canonical].check, source)
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
    hybrid_engine: the `hybrid_engine` section (None without one).
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
    hybrid_engine: HybridEngineConfig | None = None
    given: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = ()
    source: str = "DeepSpeed config"

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.zero.gradient_accumulation_steps

    def sets(self, field: str) -> bool:
        """Whether the JSON gives a key that sets ZeroConfig `field` (in any spelling)."""
        return bool(keys_of_field(field) & self.given)

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


def _batch_sizes(batch: Mapping[str, Any], data_parallel_size: int | None,
                 source: str) -> tuple[int | None, int | None, int, int | None]:
    """DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion` over the batch keys
    (`overrides.BATCH_KEYS`, those given).

    Returns (train_batch_size, micro_batch_size, gradient_accumulation_steps, dp size). Without
    either batch key the batch sizes stay None (a config snippet such as ZeRO++'s).
    """
    train = batch.get("train_batch_size")
    micro = batch.get("train_micro_batch_size_per_gpu")
    accum = batch.get("gradient_accumulation_steps")
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


def _read_optimizer(top: Mapping[str, Any], src: str, ignored: list[str]
                    ) -> tuple[str | None, dict[str, Any]]:
    """The `optimizer` section: (type, checked params); (None, {}) without the section."""
    if "optimizer" not in top:
        return None, {}
    sec = _read_section(top["optimizer"], "optimizer.", TYPED_SECTION, src, ignored)
    if "type" not in sec:
        raise DeepSpeedConfigError(f"{src}: optimizer.type is missing; accepted: "
                                   + ", ".join(OPTIMIZER_NAMES.values()))
    opt_name = _read_type(sec["type"], "optimizer.", OPTIMIZER_NAMES, UNSUPPORTED_OPTIMIZERS,
                          src)
    params_raw = sec.get("params", {})
    if isinstance(params_raw, Mapping) and "max_grad_norm" in params_raw:
        raise DeepSpeedConfigError(f"{src}: optimizer.params.max_grad_norm is not accepted: "
                                   f"{NO_GRAD_NORM}")
    opt_params = _read_section(params_raw, "optimizer.params.", OPTIMIZERS[opt_name], src,
                               ignored)
    return opt_name, opt_params


def _read_scheduler(top: Mapping[str, Any], src: str, ignored: list[str]
                    ) -> tuple[str | None, dict[str, Any]]:
    """The `scheduler` section: (type, checked params); (None, {}) without the section."""
    if "scheduler" not in top:
        return None, {}
    sec = _read_section(top["scheduler"], "scheduler.", TYPED_SECTION, src, ignored)
    if "type" not in sec:
        raise DeepSpeedConfigError(f"{src}: scheduler.type is missing; accepted: "
                                   + ", ".join(SCHEDULERS))
    sched_name = _read_type(sec["type"], "scheduler.", {n: n for n in SCHEDULERS},
                            UNSUPPORTED_SCHEDULERS, src)
    sched_params = _read_section(sec.get("params", {}), "scheduler.params.",
                                 SCHEDULERS[sched_name], src, ignored)
    for key in REQUIRED_SCHEDULER_PARAMS.get(sched_name, ()):
        if key not in sched_params:
            raise DeepSpeedConfigError(f"{src}: scheduler.params.{key} is required by "
                                       f"{sched_name}; accepted: an integer >= 1")
    return sched_name, sched_params


def load_deepspeed_config(source: str | os.PathLike | Mapping[str, Any], *,
                          data_parallel_size: int | None = None,
                          world_size: int | None = None,
                          mesh_local_size: int | None = None,
                          name: str | None = None,
                          overrides: Overrides = Overrides(),
                          default_train_batch_size: int | None = None) -> DeepSpeedConfig:
    """Reads a DeepSpeed JSON config (a path or a dict) into a `DeepSpeedConfig`.

    `data_parallel_size` is the data-parallel size of the batch arithmetic (train_batch_size =
    micro x accumulation x dp: the mesh's data replicas), as given. Or give `world_size`, the
    devices the config runs on (the mesh's nodes x local, sequence devices included): the dp is
    then world_size / sequence_parallel_size (the JSON's key or the override; 1 without), as
    DeepSpeed's config divides its world size by it (DeepSpeed-Ulysses' dp = world / sp).
    Without either, the world is `jax.device_count()`; either is only needed when the JSON sets
    a batch size. `mesh_local_size` is the number of devices per node of the mesh the config will
    run on (its "local" axis, sequence devices included): when given, a
    `zero_hpz_partition_size` that does not divide it is clamped to it, with a
    `DeepSpeedConfigWarning` naming the key, the given and the used value, and a
    sequence_parallel_size that does not divide it is an error (a sequence's devices lie inside
    a node).
    Raises `DeepSpeedConfigError` for unknown keys (naming the closest valid one), wrong types or
    ranges (naming the accepted values), keys that do not fit together (ZeRO++ without stage 3,
    fp16 with bf16) and inconsistent batch sizes; warns with `DeepSpeedConfigWarning` for each
    key that has no effect in zeroxla. Messages name the source as `name` (default: the path, or
    "DeepSpeed config" for a dict).

    `overrides` (`zeroxla.deepspeed.overrides.Overrides`: a job's command-line options) are
    applied to the checked values before the cross-key checks and the batch arithmetic; one that
    contradicts a key of the JSON is a `DeepSpeedConfigError` naming both. Where neither the JSON
    nor an override sets train_batch_size or train_micro_batch_size_per_gpu,
    `default_train_batch_size` (if given) is the global batch.
    """
    check_mesh_local_size(mesh_local_size)
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
    # ZeroConfig fields, each from exactly one key. Without zero_optimization.stage DeepSpeed runs
    # stage 0 (its default); build_zero_config fills that in.
    fields = zero_fields(top, fp16, bf16, zero_raw, bf16_prefix=bf16_name, source=src)
    batch = {key: top[key] for key in BATCH_KEYS if key in top}
    apply_overrides(overrides, fields=fields, batch=batch, fp16=fp16, bf16=bf16,
                    bf16_prefix=bf16_name, source=src)
    if ("train_batch_size" not in batch and "train_micro_batch_size_per_gpu" not in batch
            and default_train_batch_size is not None):
        batch["train_batch_size"] = default_train_batch_size
    data_parallel_size = data_parallel_world(
        fields, batch, overrides.written("sequence_parallel_size")
        if overrides.sequence_parallel_size is not None else None, src, data_parallel_size,
        world_size, mesh_local_size)
    train, micro, accum, dp = _batch_sizes(batch, data_parallel_size, src)
    fields["gradient_accumulation_steps"] = accum
    zero = build_zero_config(fields, mesh_local_size=mesh_local_size, source=src)

    opt_name, opt_params = _read_optimizer(top, src, ignored)
    sched_name, sched_params = _read_scheduler(top, src, ignored)
    optimizer, learning_rate = optimizer_and_schedule(opt_name, opt_params, sched_name,
                                                      sched_params)
    hybrid_engine = (hybrid_engine_config_from_section(top["hybrid_engine"], where=src)
                     if "hybrid_engine" in top else None)

    return DeepSpeedConfig(
        zero=zero, train_batch_size=train, micro_batch_size=micro, data_parallel_size=dp,
        optimizer_name=opt_name, optimizer_params=types.MappingProxyType(opt_params),
        optimizer=optimizer, scheduler_name=sched_name,
        scheduler_params=types.MappingProxyType(sched_params), learning_rate=learning_rate,
        hybrid_engine=hybrid_engine,
        given=frozenset(_dotted_keys(raw)), ignored=tuple(ignored), source=src)


def zero_config_from_json(source: str | os.PathLike | Mapping[str, Any], *,
                          data_parallel_size: int | None = None,
                          mesh_local_size: int | None = None,
                          name: str | None = None) -> ZeroConfig:
    """The `ZeroConfig` of a DeepSpeed JSON (a path or a dict): `load_deepspeed_config(...).zero`,
    with the same arguments, checks and warnings."""
    return load_deepspeed_config(source, data_parallel_size=data_parallel_size,
                                 mesh_local_size=mesh_local_size, name=name).zero


__all__ = ["BF16", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigWarning", "FP16",
           "KEY_MAP", "OPTIMIZERS", "OPTIMIZER_NAMES", "SCHEDULERS", "TOP_LEVEL",
           "UNSUPPORTED_OPTIMIZERS", "UNSUPPORTED_SCHEDULERS", "ZERO", "describe_key_map",
           "load_deepspeed_config", "read_deepspeed_json", "zero_config_from_json"]
