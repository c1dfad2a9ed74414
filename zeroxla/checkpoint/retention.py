"""Checkpoint retention: keep the newest K committed step checkpoints of a directory.

    zeroxla.save(directory, state, layout=zero_step.layout)   # commits DIR/<n>/
    prune_checkpoints(directory, keep_last=3)                 # then drops the old ones

`zeroxla.save` writes step n into a temporary directory and commits it by writing orbax's
COMMIT_FILE and renaming it to `DIR/<n>` (manager.py). Only committed steps count here: the
newest `keep_last` committed steps are kept, older committed ones are deleted, and anything
uncommitted (a save still running, or one killed before its commit) is left alone. Called after
a save returned, a crash at any moment leaves at least the newest committed checkpoint whole
(DeepSpeed's and torchtitan's `keep_latest_k` delete the same way: after the new one is written).

A step is deleted by renaming it out of the step namespace first (`<n>.zeroxla-deleting`, an
atomic rename: `list_checkpoints`, `restore` and orbax stop seeing the step at once) and then
removing the files; a removal cut short by a crash is finished by the next prune.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from zeroxla.checkpoint.listing import list_checkpoints

DELETING_SUFFIX = ".zeroxla-deleting"


def steps_to_delete(committed: Iterable[int], keep_last: int) -> list[int]:
    """The committed steps older than the newest `keep_last` ones, ascending."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} is invalid; accepted: an integer >= 1")
    steps = sorted(set(committed))
    return steps[:max(len(steps) - keep_last, 0)]


def prune_checkpoints(directory: str | Path, keep_last: int) -> list[int]:
    """Deletes the committed checkpoints of `directory` older than its newest `keep_last`
    committed ones; returns the deleted steps. Run it on one process only (process 0)."""
    directory = Path(directory)
    committed = {c.step: c.path for c in list_checkpoints(directory) if c.complete}
    doomed = steps_to_delete(committed, keep_last)
    _remove_leftovers(directory)          # a previous prune cut short
    for step in doomed:
        path = committed[step]
        path.rename(path.with_name(path.name + DELETING_SUFFIX))
    _remove_leftovers(directory)
    return doomed


def _remove_leftovers(directory: Path) -> None:
    if directory.is_dir():
        for path in directory.glob("*" + DELETING_SUFFIX):
            shutil.rmtree(path)


__all__ = ["DELETING_SUFFIX", "prune_checkpoints", "steps_to_delete"]
