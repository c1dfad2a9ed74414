"""The DeepSpeed keys that configure ZeRO, checked together and turned into a `ZeroConfig`.

The key table (`keys.py`) checks each key on its own. What depends on more than one key, or on the
mesh, is checked here, so that every error names the JSON key a DeepSpeed user wrote
(`zero_optimization.zero_hpz_partition_size`), never only the `ZeroConfig` field it lands in:
  * fp16 and bf16 cannot both be enabled (DeepSpeed asserts the same);
  * ZeRO++ (zero_hpz_partition_size > 1, zero_quantized_weights, zero_quantized_gradients,
    zero_quantized_nontrainable_weights) needs zero_optimization.stage 3: it works on the
    partitioned parameters of ZeRO-3 (Wang et al. 2023, §3);
  * hpZ's secondary partition lies inside a node (ZeRO++ §3.2), so once the mesh's devices per
    node are known, a zero_hpz_partition_size that does not divide them is clamped to them, with a
    `DeepSpeedConfigWarning`. The ZeRO++ tutorial's value, 16, assumes 16 GPUs per node; on a mesh
    of 4 local devices it becomes 4;
  * the offload keys (`offload_optimizer`, `offload_param`, their old boolean spellings and
    pin_memory) against each other and the stage (`zeroxla.deepspeed.offload`);
  * sequence_parallel_size (DeepSpeed-Ulysses) divides the mesh's devices per node and the world,
    and the batch arithmetic's dp is world / sequence_parallel_size, as DeepSpeed's config
    divides its world by it (`data_parallel_world`).
`ZeroConfig.__post_init__` checks the result again; after the checks here it does not fail, and if
it ever does, the error still names the JSON key.
"""

from __future__ import annotations

import json
import types
import warnings
from collections.abc import Mapping
from typing import Any

import jax

from zeroxla.deepspeed.checks import DeepSpeedConfigError, DeepSpeedConfigWarning
from zeroxla.deepspeed.keys import BF16, FP16, MAPPED_SECTIONS, TOP_LEVEL, ZERO
from zeroxla.deepspeed.offload import offload_fields
from zeroxla.sharding.config import ZeroConfig

# ZeroConfig field -> the DeepSpeed key that sets it (compute_dtype: fp16.enabled or bf16.enabled).
KEY_OF_FIELD: Mapping[str, str] = types.MappingProxyType({
    spec.dest.removeprefix("zero."): prefix + key
    for prefix, section in MAPPED_SECTIONS
    for key, spec in section.keys.items() if spec.dest.startswith("zero.")})

# DeepSpeed's default stage when zero_optimization.stage (or the whole section) is absent.
DEFAULT_STAGE = 0


def keys_of_field(field: str) -> frozenset[str]:
    """Every dotted JSON key that sets ZeroConfig `field`, in each spelling DeepSpeed accepts
    (an alias, the bf16 section's older name `bfloat16`), e.g. "check_grad_overflow" ->
    {"bf16.check_grad_overflow", "bfloat16.check_grad_overflow"}."""
    keys = set()
    for prefix, section in MAPPED_SECTIONS:
        prefixes = (prefix, "bfloat16.") if prefix == "bf16." else (prefix,)
        names = [k for k, spec in section.keys.items() if spec.dest == "zero." + field]
        names += [alias for alias, canonical in section.aliases.items() if canonical in names]
        keys |= {p + name for p in prefixes for name in names}
    return frozenset(keys)
_ZEROPP_FIELDS = ("hpz_partition_size", "quantized_weights", "quantized_nontrainable_weights",
                  "quantized_gradients")


def zero_fields(top: Mapping[str, Any], fp16: Mapping[str, Any], bf16: Mapping[str, Any],
                zero: Mapping[str, Any], *, bf16_prefix: str, source: str) -> dict[str, Any]:
    """The ZeroConfig fields the JSON sets, from its checked sections (canonical key -> value).

    Only the fields whose key is given are returned; `bf16_prefix` is "bf16." or "bfloat16.",
    whichever the JSON used, for messages.
    """
    fields: dict[str, Any] = {}
    for section, values in ((TOP_LEVEL, top), (FP16, fp16), (BF16, bf16), (ZERO, zero)):
        for key, value in values.items():
            spec = section.keys[key]
            if spec.dest.startswith("zero.") and spec.dest != "zero.compute_dtype":
                fields[spec.dest.removeprefix("zero.")] = (spec.convert(value) if spec.convert
                                                           else value)
    offload_fields(zero, fields, source)       # pin_memory, old spellings, stages
    if fp16.get("enabled") and bf16.get("enabled"):
        raise DeepSpeedConfigError(f"{source}: fp16.enabled and {bf16_prefix}enabled are both "
                                   "true; accepted: at most one (DeepSpeed asserts the same)")
    if fp16.get("enabled"):
        fields["compute_dtype"] = "float16"
    elif bf16.get("enabled"):
        fields["compute_dtype"] = "bfloat16"
    return fields


def build_zero_config(fields: Mapping[str, Any], *, mesh_local_size: int | None,
                      source: str) -> ZeroConfig:
    """The ZeroConfig of `fields` (from `zero_fields`), after the cross-key checks and, when
    `mesh_local_size` (devices per node) is given, the hpZ clamp. Errors name the JSON keys."""
    fields = dict(fields)
    _check_zeropp_stage(fields, source)
    fields.setdefault("stage", DEFAULT_STAGE)
    if mesh_local_size is not None and "hpz_partition_size" in fields:
        fields["hpz_partition_size"] = _clamp_hpz(fields["hpz_partition_size"], mesh_local_size,
                                                  source)
    try:
        return ZeroConfig(**fields)
    except ValueError as err:   # not reached after the checks above; kept so errors name a key
        field = str(err).split("=", 1)[0].removeprefix("ZeroConfig.")
        raise DeepSpeedConfigError(f"{source}: {KEY_OF_FIELD.get(field, field)} -> {err}") from None


def check_mesh_local_size(mesh_local_size: Any) -> None:
    """Raises unless `mesh_local_size` is None or an integer >= 1."""
    if mesh_local_size is None:
        return
    if (not isinstance(mesh_local_size, int) or isinstance(mesh_local_size, bool)
            or mesh_local_size < 1):
        raise DeepSpeedConfigError(f"mesh_local_size={mesh_local_size!r} is invalid; accepted: "
                                   "None or an integer >= 1 (the devices per node of the mesh, "
                                   "its 'local' axis)")


def _check_sequence_degree(sequence: int, devices: int | None, what: str, given_as: str) -> None:
    """Raises unless the sequence-parallel degree divides the `devices` (None: not known)."""
    if devices is None:
        return
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise DeepSpeedConfigError(f"world_size={devices!r} is invalid; accepted: an integer >= 1 "
                                   "(the devices the config runs on)")
    if devices % sequence:
        divisors = ", ".join(str(d) for d in range(1, devices + 1) if devices % d == 0)
        raise DeepSpeedConfigError(f"{given_as} does not divide the {devices} {what}; accepted: "
                                   f"one of {divisors}")


def data_parallel_world(fields: Mapping[str, Any], batch: Mapping[str, Any],
                        given_as: str | None, source: str, data_parallel_size: int | None,
                        world_size: int | None, mesh_local_size: int | None) -> int | None:
    """The batch arithmetic's dp: `data_parallel_size` as given, else the world (`world_size`,
    or every device when the `batch` keys need one) over the sequence-parallel degree of the
    ZeroConfig `fields`, as DeepSpeed's config divides its world by `sequence_parallel_size`.
    Raises, naming the key (or the option as `given_as` writes it), for a degree that does not
    divide a node's devices or the world."""
    sequence = fields.get("sequence_parallel_size", 1)
    given_as = given_as or f"sequence_parallel_size={sequence} in {source}"
    _check_sequence_degree(sequence, mesh_local_size, "devices per node of the mesh", given_as)
    if data_parallel_size is not None:
        if world_size is not None:
            raise DeepSpeedConfigError(f"data_parallel_size={data_parallel_size!r} and "
                                       f"world_size={world_size!r} are both given; accepted: "
                                       "one of them")
        return data_parallel_size
    if world_size is None and not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(
            batch):
        return None
    world = jax.device_count() if world_size is None else world_size
    _check_sequence_degree(sequence, world, "devices (the world size)", given_as)
    return world // sequence


def _check_zeropp_stage(fields: Mapping[str, Any], source: str) -> None:
    """Raises unless the ZeRO++ keys that are on come with zero_optimization.stage 3."""
    on = [f for f in _ZEROPP_FIELDS
          if f in fields and (fields[f] is True or (f == "hpz_partition_size" and fields[f] > 1))]
    stage = fields.get("stage", DEFAULT_STAGE)
    if not on or stage == 3:
        return
    stage_key = KEY_OF_FIELD["stage"]
    given = "" if "stage" in fields else f" (DeepSpeed's default: {stage_key} is not given)"
    on_text = " and ".join(f"{KEY_OF_FIELD[f]}={json.dumps(fields[f])}" for f in on)
    off_text = " and ".join(f"{KEY_OF_FIELD[f]}={1 if f == 'hpz_partition_size' else 'false'}"
                            for f in on)
    raise DeepSpeedConfigError(
        f"{source}: {on_text} need{'s' if len(on) == 1 else ''} {stage_key}=3 (ZeRO++ works on "
        f"ZeRO-3's partitioned parameters), but {stage_key}={stage}{given}; accepted: "
        f"{stage_key}=3, or {off_text}")


def _clamp_hpz(hpz: int, local: int, source: str) -> int:
    """`hpz` if it divides the `local` devices per node (or is 1, off); else `local`, warning."""
    if hpz <= 1 or local % hpz == 0:
        return hpz
    key = KEY_OF_FIELD["hpz_partition_size"]
    how = "exceeds" if hpz > local else "does not divide"
    off = " (hpZ off)" if local == 1 else ""
    warnings.warn(
        f"{source}: {key}={hpz} {how} the {local} devices per node of the mesh; using "
        f"{key}={local}{off}: hpZ's secondary partition must lie inside a node, and DeepSpeed's "
        f"ZeRO++ tutorial sets it to the devices per node", DeepSpeedConfigWarning, stacklevel=4)
    return local
