"""Settings given beside a DeepSpeed JSON (a job's command-line options), applied as typed
overrides while the JSON is read, once.

`zeroxla train --config ds.json --zero-stage 3 --batch-size 64` means: the JSON's recipe, with the
stage and the global batch from the command line. The loader (`load_deepspeed_config(...,
overrides=...)`) reads the JSON into checked values (its sections, the ZeroConfig fields they
set, the batch keys), then applies each `Override` before the cross-key checks and the batch
arithmetic run, so that `--zero-stage 3` beside a ZeRO++ JSON without a stage passes the ZeRO++
stage check, and `--grad-accum 4` beside `train_batch_size` re-derives the micro-batch size as
DeepSpeed would. A value the JSON also sets, differently, is an error naming both (the option
as written and the JSON key), never a silent choice of one.

Targets (`Override.target`):
    "zero.<field>"                  a ZeroConfig field a JSON key maps to (KEY_OF_FIELD)
    "zero.compute_dtype"            "float32", "bfloat16" or "float16" (fp16/bf16 `enabled`)
    one of BATCH_KEYS               a top-level batch key
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from zeroxla.deepspeed.checks import DeepSpeedConfigError
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Override:
    """One setting from outside the JSON.

    target: where it lands (see the module docstring); value: the zeroxla value (e.g. 3, or
    "float16" for compute_dtype); given_as: how the user wrote it, for messages ("--zero-stage 3").
    """

    target: str
    value: Any
    given_as: str

    def __post_init__(self) -> None:
        zero_targets = sorted("zero." + f for f in KEY_OF_FIELD)
        if self.target not in BATCH_KEYS and self.target not in zero_targets:
            raise ValueError(f"Override.target={self.target!r} is invalid; accepted: "
                             + ", ".join((*BATCH_KEYS, *zero_targets)))
        if self.target == "zero.compute_dtype" and self.value not in COMPUTE_DTYPES:
            raise ValueError(f"Override.value={self.value!r} for zero.compute_dtype is invalid; "
                             "accepted: " + ", ".join(COMPUTE_DTYPES))


def _conflict(override: Override, key: str, json_value: Any, source: str) -> DeepSpeedConfigError:
    shown = str(json_value).lower() if isinstance(json_value, bool) else json_value
    return DeepSpeedConfigError(f"{override.given_as} conflicts with {key}={shown} in {source}; "
                                "give one")


def _apply_precision(override: Override, fp16: Mapping[str, Any], bf16: Mapping[str, Any],
                     bf16_prefix: str, fields: dict[str, Any], source: str) -> None:
    """compute_dtype: refused where an fp16/bf16 `enabled` key in the JSON says otherwise."""
    for name, section, prefix in (("float16", fp16, "fp16."), ("bfloat16", bf16, bf16_prefix)):
        enabled = section.get("enabled")
        if (enabled is True and override.value != name) or (enabled is False
                                                            and override.value == name):
            raise _conflict(override, prefix + "enabled", enabled, source)
    fields["compute_dtype"] = override.value


def apply_overrides(overrides: Sequence[Override], *, fields: dict[str, Any],
                    batch: dict[str, Any], fp16: Mapping[str, Any], bf16: Mapping[str, Any],
                    bf16_prefix: str, source: str) -> None:
    """Applies `overrides` in place to the ZeroConfig `fields` and the `batch` keys the JSON
    gave (both from the checked JSON). Raises DeepSpeedConfigError on a conflict."""
    for override in overrides:
        if override.target in BATCH_KEYS:
            if override.target in batch and batch[override.target] != override.value:
                raise _conflict(override, override.target, batch[override.target], source)
            batch[override.target] = override.value
            continue
        field = override.target.removeprefix("zero.")
        if field == "compute_dtype":
            _apply_precision(override, fp16, bf16, bf16_prefix, fields, source)
        elif field in fields and fields[field] != override.value:
            raise _conflict(override, KEY_OF_FIELD[field], fields[field], source)
        else:
            fields[field] = override.value


__all__ = ["BATCH_KEYS", "COMPUTE_DTYPES", "Override", "apply_overrides"]
