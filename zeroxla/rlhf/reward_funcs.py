"""Reward functions of the GRPO family: plain callables
`fn(prompts, completions, **row_fields) -> list[float]`, one reward per completion (TRL's
`reward_funcs` signature; `row_fields` are the prompt rows' other columns, one list each, e.g.
`answer`), combined by `RewardFunctions` into one weighted reward per answer.

Built in, for math-style data:
  accuracy_reward   1.0 when the completion's final number (after `####`, or inside `\\boxed{}`)
                    equals the row's `answer`, else 0.0
  format_reward     1.0 when the completion states a final answer in that form, else 0.0

A function that raises, returns the wrong number of rewards, or returns a NaN, an infinity or
None stops the run with a `RewardFunctionError` naming the function and the sample: a reward
that silently drops out would train on the others alone. `load_reward_func("module:function")`
resolves the command line's `--reward-funcs`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

RewardFunc = Callable[..., Sequence[float | None]]

_HASH_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_BOXED_ANSWER = re.compile(r"\\boxed\{\s*(-?[\d,]*\.?\d+)\s*\}")


class RewardFunctionError(ValueError):
    """A reward function failed or returned an unusable value (the message names it)."""


def extract_answer(text: str) -> str | None:
    """The final answer a completion states: the number after its last `####`, else inside its
    last `\\boxed{...}`; commas removed. None when it states none."""
    for pattern in (_HASH_ANSWER, _BOXED_ANSWER):
        found = pattern.findall(text)
        if found:
            return found[-1].replace(",", "")
    return None


def _same_number(a: str, b: Any) -> bool:
    try:
        return float(a) == float(str(b).replace(",", ""))
    except ValueError:
        return False


def accuracy_reward(prompts: Sequence[str], completions: Sequence[str], *,
                    answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 per completion whose stated answer (`extract_answer`) equals the row's `answer`."""
    del prompts
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        stated = extract_answer(completion)
        out.append(float(stated is not None and _same_number(stated, expected)))
    return out


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 per completion that states a final answer (`#### N` or `\\boxed{N}`)."""
    del prompts
    return [float(extract_answer(c) is not None) for c in completions]


BUILT_IN: dict[str, RewardFunc] = {"accuracy": accuracy_reward, "format": format_reward}


def load_reward_func(spec: str) -> RewardFunc:
    """A built-in name (`accuracy`, `format`) or `module:function`, imported."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward-funcs {spec!r} is invalid; accepted: "
                         f"{' | '.join(BUILT_IN)} or module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--reward-funcs {spec}: {err}; accepted: an importable "
                         "module:function") from None
    if not callable(fn):
        raise ValueError(f"--reward-funcs {spec} is a {type(fn).__name__}, not callable")
    return fn


def func_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


@dataclasses.dataclass(frozen=True)
class RewardFunctions:
    """Several reward functions and their weights (1.0 each by default): `self(prompts,
    completions, fields)` returns the weighted sum float64[B] and each function's rewards
    {name: float64[B]} (for the metrics)."""

    funcs: tuple[RewardFunc, ...]
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.funcs:
            raise ValueError("no reward function given; accepted: at least one callable "
                             "(prompts, completions, **row_fields) -> list[float]")
        for fn in self.funcs:
            if not callable(fn):
                raise TypeError(f"reward function {fn!r} is not callable")
        if self.weights is not None and len(self.weights) != len(self.funcs):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.funcs)} reward "
                             "functions; accepted: one weight per function")

    def names(self) -> list[str]:
        return [func_name(fn) for fn in self.funcs]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 fields: dict[str, Sequence[Any]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        weights = self.weights or (1.0,) * len(self.funcs)
        total = np.zeros(len(completions))
        each = {}
        for fn, weight in zip(self.funcs, weights):
            values = call_checked(fn, prompts, completions, fields)
            each[func_name(fn)] = values
            total += weight * values
        return total, each


def call_checked(fn: RewardFunc, prompts: Sequence[str], completions: Sequence[str],
                 fields: dict[str, Sequence[Any]]) -> np.ndarray:
    """float64[B] of `fn(prompts, completions, **fields)`; `RewardFunctionError` naming `fn`
    and the sample when it raises or a value is not a finite number."""
    name = func_name(fn)
    try:
        values = list(fn(list(prompts), list(completions), **fields))
    except Exception as err:  # noqa: BLE001  (any failure of user code stops the run, named)
        raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {err} "
                                  f"(on a batch of {len(completions)} samples, the first "
                                  f"{completions[0]!r:.80})") from err
    if len(values) != len(completions):
        raise RewardFunctionError(f"reward function {name} returned {len(values)} rewards for "
                                  f"{len(completions)} completions; accepted: one per completion")
    for i, value in enumerate(values):
        ok = (isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
              and math.isfinite(float(value)))
        if not ok:
            raise RewardFunctionError(f"reward function {name} returned {value!r} for sample "
                                      f"{i} (prompt {prompts[i]!r:.60}, completion "
                                      f"{completions[i]!r:.60}); accepted: a finite number")
    return np.asarray(values, np.float64)


__all__ = ["BUILT_IN", "RewardFunc", "RewardFunctionError", "RewardFunctions", "accuracy_reward",
           "call_checked", "extract_answer", "format_reward", "func_name", "load_reward_func"]
