"""verl's reward functions, called as verl calls them: one sample at a time.

verl scores an answer with `compute_score(data_source, solution_str, ground_truth,
extra_info=None)` (`verl.utils.reward_score.default_compute_score`, and the
`custom_reward_function` a recipe names), which returns a number, or a dict whose "score" is
the reward (its other keys are verl's extra metrics). A reward function of GRPO whose
parameters include `solution_str` is such a function (`is_compute_score`); `batch_scores`
calls it once per answer with the answer's text and its prompt row's `data_source`,
`ground_truth` (the row's `reward_model.ground_truth`, `zeroxla.app.prompt_files`) and
`extra_info` (None when the row has none), as verl's reward manager does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

SOLUTION = "solution_str"
COLUMNS = ("data_source", "ground_truth")           # every row needs them
OPTIONAL = ("extra_info",)


def is_compute_score(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes verl's `solution_str` (a signature that cannot be read: no)."""
    try:
        return SOLUTION in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def batch_scores(fn: Callable[..., Any], completions: Sequence[str],
                 fields: dict[str, Sequence[Any]]) -> list[Any]:
    """`fn`'s score of each completion (a dict's "score"); KeyError naming the column a row
    lacks (the caller names the function and the sample)."""
    for column in COLUMNS:
        values = fields.get(column)
        if values is None or any(v is None for v in values):
            raise KeyError(f"verl's compute_score needs the column {column!r} in every prompt "
                           "row (ground_truth: reward_model.ground_truth)")
    extra = fields.get("extra_info") or [None] * len(completions)
    out = []
    for i, completion in enumerate(completions):
        score = fn(data_source=fields["data_source"][i], solution_str=completion,
                   ground_truth=fields["ground_truth"][i], extra_info=extra[i])
        out.append(score["score"] if isinstance(score, dict) else score)
    return out


__all__ = ["batch_scores", "is_compute_score"]
