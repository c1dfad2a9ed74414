"""Where `zeroxla train`'s defaults come from: the API's, except where the job differs on purpose.

The engine-facing settings of a job (its ZeRO stage, persistence threshold, precision, clipping,
offload, ZeRO++) take `ZeroConfig`'s defaults, the library's, which follow DeepSpeed's.
`JOB_DEFAULTS` is the one table of the few the job sets otherwise, each with its reason; the job's
config tree (`zeroxla.app.jobs.train.config`), the options' `--help` (`zeroxla.app.jobs.train.options`)
and docs/zero.md all read it, and `zeroxla.app.jobs.train.defaults_table` prints the three sets of
defaults side by side (the API's, `zeroxla train`'s, a DeepSpeed JSON's).

A `--config` JSON fills the tree with its own values and, where it leaves a key out, DeepSpeed's
default (`JSON_DEFAULTS`: ZeroConfig's, but stage 0), not the job's; a `JobDefault` with
`with_config` still applies over a JSON that leaves its key out. Nothing here uses a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from zeroxla.deepspeed.zero_config import DEFAULT_STAGE
from zeroxla.sharding.config import ZeroConfig

# The API's defaults: what `ZeroConfig()` holds.
API_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}


@dataclasses.dataclass(frozen=True)
class JobDefault:
    """One ZeroConfig field whose `zeroxla train` default differs from the API's, and why.

    with_config: the job's value also applies over a `--config` JSON that does not set the
    field (else the JSON's DeepSpeed default applies).
    """

    field: str
    value: Any
    reason: str
    with_config: bool = False

    def __post_init__(self) -> None:
        if self.field not in API_DEFAULTS:
            raise ValueError(f"JobDefault.field={self.field!r} is invalid; accepted: a ZeroConfig "
                             "field")
        if self.value == API_DEFAULTS[self.field]:
            raise ValueError(f"JobDefault({self.field!r}) repeats ZeroConfig's default "
                             f"{self.value!r}; accepted: a value that differs from it")


JOB_DEFAULTS: tuple[JobDefault, ...] = (
    JobDefault(
        "persistence_threshold", 0,
        "the default model, gpt-tiny, has no leaf of more than 28,800 elements: at 100,000 "
        "(DeepSpeed's default too) every parameter would stay replicated and ZeRO-3 partition "
        "nothing; 0 partitions every leaf, and the summary shows ZeRO-3's 1/8 per device"),
    JobDefault(
        "gradient_clipping", 1.0,
        "the default recipe (AdamW at a peak learning rate of 1e-2) clips the global gradient "
        "norm at 1.0, as nanoGPT does by default; ZeroConfig keeps DeepSpeed's default, 0 "
        "(off), so that an API user's optimizer sees its gradients unclipped unless asked"),
    JobDefault(
        "check_grad_overflow", True,
        "a step whose gradients are not finite skips its update, so a diverging run stops "
        "(exit 1) with its last finite parameters and optimizer state saved for --resume; "
        "ZeroConfig keeps DeepSpeed's default, off, under which a non-finite gradient reaches "
        "the optimizer as in plain optax",
        with_config=True),
    JobDefault(
        "sequence_parallel_size", 1,
        "the job builds its mesh from --mesh and this value, so it is always a number: 1, no "
        "sequence axis (DeepSpeed's default too); ZeroConfig's None follows whatever mesh an API "
        "user builds",
        with_config=True),
)
_BY_FIELD = {d.field: d for d in JOB_DEFAULTS}

# DeepSpeed's defaults for what a JSON leaves out: ZeroConfig's (its defaults follow DeepSpeed's),
# but the stage, 0 in DeepSpeed (no zero_optimization.stage) and 3 in zeroxla's API.
JSON_DEFAULTS: dict[str, Any] = {**API_DEFAULTS, "stage": DEFAULT_STAGE}


def job_default(field: str) -> Any:
    """`zeroxla train`'s default for ZeroConfig `field`: JOB_DEFAULTS' value, else the API's."""
    return _BY_FIELD[field].value if field in _BY_FIELD else API_DEFAULTS[field]


def job_default_of(field: str) -> JobDefault | None:
    """The JOB_DEFAULTS row of ZeroConfig `field` (None where the job keeps the API's)."""
    return _BY_FIELD.get(field)


def _shown(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def describe_default(field: str, show: Callable[[Any], str] = _shown) -> str:
    """`--help`'s words for the default of ZeroConfig `field`: the value and, where the job
    differs from the API, the API's value and the reason (`show` writes a value as the option
    does)."""
    row = _BY_FIELD.get(field)
    if row is None:
        return f"default {show(API_DEFAULTS[field])}, ZeroConfig's"
    return (f"default {show(row.value)}, not ZeroConfig's {show(API_DEFAULTS[field])}: "
            f"{row.reason}")


__all__ = ["API_DEFAULTS", "JOB_DEFAULTS", "JSON_DEFAULTS", "JobDefault", "describe_default",
           "job_default", "job_default_of"]
