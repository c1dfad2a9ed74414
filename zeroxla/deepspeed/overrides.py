"""Settings given beside a DeepSpeed JSON (a job's command-line options), applied while the JSON
is read, once.

`zeroxla train --config ds.json --zero-stage 3 --batch-size 64` means: the JSON's recipe, with the
stage and the global batch from the command line. The loader (`load_deepspeed_config(...,
overrides=Overrides(stage=3, train_batch_size=64))`) reads the JSON into checked values (its
sections, the ZeroConfig fields they set, the batch keys), then applies the overrides before the
cross-key checks and the batch arithmetic run, so that `--zero-stage 3` beside a ZeRO++ JSON
without a stage passes the ZeRO++ stage check, and `--grad-accum 4` beside `train_batch_size`
re-derives the micro-batch size as DeepSpeed would. A value the JSON also sets, differently, is
an error naming both (the option as written and the JSON key), never a silent choice of one.

`Overrides` has one typed field per setting a job can give beside a JSON: the `ZeroConfig` field
of the same name, or the global batch (`train_batch_size`); None is "not given".
`--sequence-parallel-size 2` is `Overrides(sequence_parallel_size=2)`: it also sets the batch
arithmetic's dp (world / sp) when the loader is given the world size. `given_as` says
how the user wrote each one (`{"stage": "--zero-stage 3"}`), for messages.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from zeroxla.deepspeed.checks import DeepSpeedConfigError
from zeroxla.deepspeed.zero_config import KEY_OF_FIELD

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Overrides:
    """Settings from outside the JSON, each None when not given (see the module docstring).

    Every field but `train_batch_size` and `given_as` is the ZeroConfig field of that name;
    `gradient_accumulation_steps` and `train_batch_size` take part in DeepSpeed's batch
    arithmetic as the JSON's batch keys would.
    """

    stage: int | None = None
    persistence_threshold: int | None = None
    gradient_accumulation_steps: int | None = None
    compute_dtype: str | None = None
    gradient_clipping: float | None = None
    check_grad_overflow: bool | None = None
    offload_optimizer: str | None = None
    offload_param: str | None = None
    sequence_parallel_size: int | None = None
    train_batch_size: int | None = None
    given_as: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"Overrides.compute_dtype={self.compute_dtype!r} is invalid; "
                             "accepted: " + ", ".join(COMPUTE_DTYPES))
        names = [f.name for f in dataclasses.fields(self) if f.name != "given_as"]
        unknown = sorted(set(self.given_as) - set(names))
        if unknown:
            raise ValueError(f"Overrides.given_as names {', '.join(unknown)}, which are not "
                             f"settings; accepted: {', '.join(names)}")
        object.__setattr__(self, "given_as", types.MappingProxyType(dict(self.given_as)))

    def given(self) -> dict[str, Any]:
        """The settings given (name -> value), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "given_as" and getattr(self, f.name) is not None}

    def written(self, name: str) -> str:
        """How the user wrote setting `name` ("--zero-stage 3"), else "stage=3"."""
        return self.given_as.get(name, f"{name}={getattr(self, name)}")


def _conflict(given_as: str, key: str, json_value: Any, source: str) -> DeepSpeedConfigError:
    shown = str(json_value).lower() if isinstance(json_value, bool) else json_value
    return DeepSpeedConfigError(f"{given_as} conflicts with {key}={shown} in {source}; give one")


def _apply_precision(value: str, given_as: str, fp16: Mapping[str, Any],
                     bf16: Mapping[str, Any], bf16_prefix: str, fields: dict[str, Any],
                     source: str) -> None:
    """compute_dtype: refused where an fp16/bf16 `enabled` key in the JSON says otherwise."""
    for name, section, prefix in (("float16", fp16, "fp16."), ("bfloat16", bf16, bf16_prefix)):
        enabled = section.get("enabled")
        if (enabled is True and value != name) or (enabled is False and value == name):
            raise _conflict(given_as, prefix + "enabled", enabled, source)
    fields["compute_dtype"] = value


def apply_overrides(overrides: Overrides, *, fields: dict[str, Any], batch: dict[str, Any],
                    fp16: Mapping[str, Any], bf16: Mapping[str, Any], bf16_prefix: str,
                    source: str) -> None:
    """Applies `overrides` in place to the ZeroConfig `fields` and the `batch` keys the JSON
    gave (both from the checked JSON). Raises DeepSpeedConfigError on a conflict."""
    for name, value in overrides.given().items():
        given_as = overrides.written(name)
        if name in BATCH_KEYS:
            if name in batch and batch[name] != value:
                raise _conflict(given_as, name, batch[name], source)
            batch[name] = value
        elif name == "compute_dtype":
            _apply_precision(value, given_as, fp16, bf16, bf16_prefix, fields, source)
        elif name in fields and fields[name] != value:
            key = KEY_OF_FIELD[name]
            key = bf16_prefix + key.removeprefix("bf16.") if key.startswith("bf16.") else key
            raise _conflict(given_as, key, fields[name], source)
        else:
            fields[name] = value


__all__ = ["BATCH_KEYS", "COMPUTE_DTYPES", "Overrides", "apply_overrides"]
