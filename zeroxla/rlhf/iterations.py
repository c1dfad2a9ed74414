"""The iteration loop GRPO's and PPO's runs share (`grpo.run`, `ppo.run`): a trainer's
`iteration(it) -> (record, rollout)` from a first iteration to an end, a stop request read before
each, every record handed on as it is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_iterations(iterations: Any) -> None:
    """Refuses an iteration count that is not an integer >= 1, by name."""
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} is invalid; accepted: an integer >= 1")


def run_iterations(trainer: Any, first: int, iterations: int,
                   should_stop: Callable[[], bool] = lambda: False,
                   on_iteration: Callable[[dict[str, Any]], None] | None = None
                   ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the records, the rollouts) of `trainer.iteration(it)` for it = `first` ..
    `iterations - 1`; `should_stop()` is read before each iteration (True: the loop ends
    there), `on_iteration(record)` called after each."""
    records, rollouts = [], []
    for it in range(first, iterations):
        if should_stop():
            break
        record, rollout = trainer.iteration(it)
        records.append(record)
        rollouts.append(rollout)
        if on_iteration is not None:
            on_iteration(record)
    return records, rollouts


__all__ = ["check_iterations", "run_iterations"]
