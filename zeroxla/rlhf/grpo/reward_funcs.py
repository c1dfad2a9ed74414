"""Reward functions of the GRPO family: plain callables
`fn(prompts, completions, **row_fields) -> list[float]`, one reward per completion (TRL's
`reward_funcs` signature; `row_fields` are the prompt rows' other columns, one list each, e.g.
`answer`), combined by `RewardFunctions` into one weighted reward per answer.

Built in, for math-style data:
  accuracy_reward   1.0 when the completion's final number (after `####`, or inside `\\boxed{}`)
                    equals the row's `answer` (or verl's `ground_truth`), else 0.0
  format_reward     1.0 when the completion states a final answer in that form, else 0.0

A function returns a list (or a 1-d NumPy or torch array) of numbers that a float holds exactly:
floats, ints, bools (0 / 1; TRL converts them too), NumPy scalars, 0-d arrays. One that raises,
returns the wrong number of rewards, or a NaN, an infinity, a number beyond float32's range (the
advantages' dtype), None or anything else stops the run with a `RewardFunctionError` naming the
function and the sample: a reward that silently drops out would train on the others alone.
A function whose parameters include `solution_str` is verl's `compute_score(data_source,
solution_str, ground_truth, extra_info)` and is called as verl calls it, once per sample
(`verl_score`). `load_reward_func("module:function")` resolves the command line's
`--reward-funcs`, from `sys.path` or the working directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from zeroxla.rlhf.grpo import verl_score

RewardFunc = Callable[..., Sequence[float | None]]
FLOAT32_MAX = float(np.finfo(np.float32).max)
ACCEPTED = ("a finite number within float32's range (|r| <= 3.4e38): a float, an int or a bool "
            "(0 / 1), or a NumPy or torch array of them")

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
                    answer: Sequence[Any] | None = None,
                    ground_truth: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 per completion whose stated answer (`extract_answer`) equals the row's `answer`
    (else verl's `ground_truth`, its `reward_model.ground_truth`)."""
    del prompts
    expected_answers = answer if answer is not None else ground_truth
    if expected_answers is None:
        raise KeyError("the prompt rows have no column 'answer' (nor verl's "
                       "reward_model.ground_truth)")
    out = []
    for completion, expected in zip(completions, expected_answers, strict=True):
        stated = extract_answer(completion)
        out.append(float(stated is not None and _same_number(stated, expected)))
    return out


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 per completion that states a final answer (`#### N` or `\\boxed{N}`)."""
    del prompts
    return [float(extract_answer(c) is not None) for c in completions]


BUILT_IN: dict[str, RewardFunc] = {"accuracy": accuracy_reward, "format": format_reward}


def load_reward_func(spec: str) -> RewardFunc:
    """A built-in name (`accuracy`, `format`) or `module:function`, imported from `sys.path` or,
    failing that, the working directory (`_import_module`). ValueError naming `spec` when it
    is none of them, and the file (and line) when the module fails while it is imported."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward-funcs {spec!r} is invalid; accepted: "
                         f"{' | '.join(BUILT_IN)} or module:function")
    try:
        module = _import_module(module_name)
    except SyntaxError as err:
        raise ValueError(f"--reward-funcs {spec}: {err.filename}:{err.lineno}: SyntaxError: "
                         f"{err.msg}") from None
    except Exception as err:  # noqa: BLE001  (any failure of the user's module, named)
        if isinstance(err, ModuleNotFoundError) and _is_missing(err, module_name):
            raise ValueError(f"--reward-funcs {spec}: {err}; accepted: an importable "
                             "module:function (a module in the working directory, or on "
                             "PYTHONPATH)") from None
        raise ValueError(f"--reward-funcs {spec}: importing {module_name} raised "
                         f"{type(err).__name__}: {err} ({_raised_at(err)})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"--reward-funcs {spec}: module {module_name} "
                         f"({getattr(module, '__file__', None)}) has no {attr!r}; accepted: "
                         "module:function naming a function of it")
    if not callable(fn):
        raise ValueError(f"--reward-funcs {spec} is a {type(fn).__name__}, not callable")
    return fn


def _import_module(name: str) -> Any:
    """`importlib.import_module(name)`; when no `sys.path` entry holds it, again with the working
    directory searched too, as `python -m` and TRL's scripts do (the `zeroxla` console script's
    `sys.path` lacks it). `sys.path` is as it was afterwards."""
    cwd = os.getcwd()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if not _is_missing(err, name) or cwd in sys.path or "" in sys.path:
            raise            # one of its own imports is missing, or the directory was searched
    sys.path.append(cwd)
    try:
        importlib.invalidate_caches()
        return importlib.import_module(name)
    finally:
        sys.path.remove(cwd)


def _is_missing(err: ModuleNotFoundError, name: str) -> bool:
    """Whether `err` says module `name` (or a package above it) is missing, not an import of
    its own."""
    return err.name is not None and (name == err.name or name.startswith(err.name + "."))


def _raised_at(err: BaseException) -> str:
    """'file:line' of the innermost frame of `err`'s traceback outside importlib."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith("<frozen ")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown file"


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
    and the sample when it raises or a value is not a number that converts exactly to a float
    (`exact_float`) finite in float32, the dtype of the advantages (TRL converts rewards to
    float32 too)."""
    name = func_name(fn)
    try:
        returned = (verl_score.batch_scores(fn, completions, fields)
                    if verl_score.is_compute_score(fn)
                    else fn(list(prompts), list(completions), **fields))
    except Exception as err:  # noqa: BLE001  (any failure of user code stops the run, named)
        raise RewardFunctionError(f"reward function {name} raised {type(err).__name__}: {err} "
                                  f"(on a batch of {len(completions)} samples, the first "
                                  f"{completions[0]!r:.80})") from err
    is_array = _is_array(returned)
    values = _to_numpy(returned) if is_array else returned
    if (is_array and values.ndim != 1) or not isinstance(values, Iterable):
        shown = f"an array of shape {values.shape}" if is_array else f"a {type(values).__name__}"
        raise RewardFunctionError(f"reward function {name} returned {shown}; accepted: one "
                                  "reward per completion, a list or a 1-d NumPy or torch array")
    values = list(values)
    if len(values) != len(completions):
        raise RewardFunctionError(f"reward function {name} returned {len(values)} rewards for "
                                  f"{len(completions)} completions; accepted: one per completion")
    out = np.zeros(len(values))
    for i, value in enumerate(values):
        number = exact_float(value)
        if number is None or not abs(number) <= FLOAT32_MAX:        # refuses nan too
            raise RewardFunctionError(f"reward function {name} returned {value!r} for sample "
                                      f"{i} (prompt {prompts[i]!r:.60}, completion "
                                      f"{completions[i]!r:.60}); accepted: {ACCEPTED}")
        out[i] = number
    return out


def _is_array(value: Any) -> bool:
    torch = sys.modules.get("torch")       # a torch tensor exists only if torch was imported
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))


def _to_numpy(value: Any) -> np.ndarray:
    """A NumPy array as it is; a torch tensor detached, on the host, its floats widened to
    float64 (exact; NumPy has no bfloat16)."""
    if isinstance(value, np.ndarray):
        return value
    tensor = value.detach().cpu()
    return (tensor.double() if tensor.is_floating_point() else tensor).numpy()


def exact_float(value: Any) -> float | None:
    """`value` as a float when it is a real number (a bool as 0 / 1; a 0-d NumPy or torch array
    by its element) that a float64 holds exactly (nan and infinities included); else None."""
    if _is_array(value):
        array = _to_numpy(value)
        if array.ndim != 0:
            return None
        value = array[()]
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    number = float(value)
    return number if number == value or math.isnan(number) else None


__all__ = ["BUILT_IN", "RewardFunc", "RewardFunctionError", "RewardFunctions", "accuracy_reward",
           "call_checked", "exact_float", "extract_answer", "format_reward", "func_name",
           "load_reward_func"]
