"""Value checks for DeepSpeed JSON keys, and the errors that name the key.

Each check (`integer(1)`, `number(0)`, `boolean()`, `choice("log", "linear")`, ...) returns the
normalised value or raises `Invalid`; its `accepted` text is what the error lists. `checked` runs
one check for one dotted JSON key and turns a failure into a `DeepSpeedConfigError` that names the
key, the value and the accepted values. The key table (`zeroxla.deepspeed.keys`) says which check
each key gets.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that zeroxla cannot use; the message names the key and the fix."""


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed key that has no effect in zeroxla, or a value changed to fit the mesh; the
    message names the key and says why."""


class Invalid(Exception):
    """A value a check rejects; `checked` turns it into a DeepSpeedConfigError."""


@dataclasses.dataclass(frozen=True)
class Check:
    """How one key's value is checked: `fn(value)` normalises or raises Invalid."""

    accepted: str
    fn: Callable[[Any], Any]

    def __call__(self, value: Any) -> Any:
        return self.fn(value)


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    """An integer in [lo, hi] (either bound optional); integral floats such as 5e8 count."""
    if lo is not None and hi is not None:
        accepted = f"an integer in [{lo}, {hi}]"
    elif lo is not None:
        accepted = f"an integer >= {lo}"
    else:
        accepted = "an integer"

    def fn(v):
        # JSON writes 5e8 as a float; DeepSpeed (pydantic) accepts integral floats for int keys.
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Invalid
        if isinstance(v, float):
            if not v.is_integer():
                raise Invalid
            v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise Invalid
        return v

    return Check(accepted, fn)


def number(lo: float | None = None, *, positive: bool = False, hi: float | None = None,
           hi_open: bool = False) -> Check:
    """A finite number >= lo (or > 0 when `positive`), <= hi (< hi when `hi_open`); as float."""
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
            raise Invalid
        if positive and v <= 0 or lo is not None and v < lo:
            raise Invalid
        if hi is not None and (v >= hi if hi_open else v > hi):
            raise Invalid
        return float(v)

    return Check(accepted, fn)


def boolean() -> Check:
    """true or false (not 0 or 1)."""
    def fn(v):
        if not isinstance(v, bool):
            raise Invalid
        return v

    return Check("true or false", fn)


def only(value: Any, why: str) -> Check:
    """A key zeroxla accepts only at one value (DeepSpeed's default); `why` explains."""

    def fn(v):
        if v != value or isinstance(v, bool) != isinstance(value, bool):
            raise Invalid
        return v

    return Check(f"{json.dumps(value)} ({why})", fn)


def choice(*options: str) -> Check:
    """One of `options`, exactly."""
    def fn(v):
        if v not in options:
            raise Invalid
        return v

    return Check(", ".join(repr(o) for o in options), fn)


def betas() -> Check:
    """Adam's (b1, b2): two numbers in [0, 1)."""
    def fn(v):
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1
                       for b in v)):
            raise Invalid
        return (float(v[0]), float(v[1]))

    return Check("a list of two numbers in [0, 1), e.g. [0.9, 0.999]", fn)


def any_value() -> Check:
    """Anything (a section, checked by its own table)."""
    return Check("any value", lambda v: v)


def checked(key: str, value: Any, check: Check, source: str) -> Any:
    """`check(value)` for the dotted JSON `key`; raises DeepSpeedConfigError naming the key, the
    value and the accepted values (`source` names the file in the message)."""
    try:
        return check(value)
    except Invalid:
        hint = (" ('auto' is a Hugging Face Trainer placeholder that it fills in before DeepSpeed "
                "sees the config; write the value)") if value == "auto" else ""
        raise DeepSpeedConfigError(f"{source}: {key}={json.dumps(value)} is invalid; accepted: "
                                   f"{check.accepted}{hint}") from None
