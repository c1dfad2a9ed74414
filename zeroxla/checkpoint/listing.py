"""A checkpoint directory's steps, complete or not, and which one to read.

One orbax `CheckpointManager` directory:

    DIR/<n>/state/      orbax PyTree of the state's logical arrays (`zeroxla.engine.logical`)
    DIR/<n>/zeroxla/    JSON: ZeroConfig, model config, the caller's metadata, the loss scale and
                        every array's shape, dtype and checksum, closed by a digest of itself
    DIR/<n>.orbax-checkpoint-tmp/   a save still running, or one killed before it committed

Orbax commits a step by writing `commit_success.txt` and renaming the temporary directory to
`<n>` (atomic on POSIX file systems; object stores keep the name and rely on the commit file),
so a killed save leaves only the temporary directory: it is listed as incomplete and skipped.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

# 3: frozen leaves held as codes saved as codes in their logical group order, the same on every
#    mesh (`frozen_codes/...`, `zeroxla.checkpoint.codes`);
# 2: the same, but each device's codes in its shard layout (still read);
# 1: such leaves stored as dequantized floats (still read: requantized once).
FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
STATE_ITEM = "state"          # orbax item holding the arrays
META_ITEM = "zeroxla"         # orbax item holding our JSON
TMP_SUFFIX = ".orbax-checkpoint-tmp"          # orbax's temporary step directories
COMMIT_FILE = "commit_success.txt"            # orbax writes it just before the commit rename
TMP_RE = re.compile(r"^(\d+)" + re.escape(TMP_SUFFIX))
class CheckpointError(RuntimeError):
    """A checkpoint cannot be used."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint's save never committed (killed or still running)."""


class CorruptCheckpointError(CheckpointError):
    """A stored array or the metadata does not match what was written."""


class IncompleteCheckpointWarning(UserWarning):
    """`restore` skipped an incomplete checkpoint."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step directory: `complete` checkpoints can be restored; `problem` says why not."""

    step: int
    path: Path
    complete: bool
    problem: str | None = None


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Every step directory under `directory`, complete or not, by step then path."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        if not entry.is_dir():
            continue
        if entry.name.isdigit():
            if (entry / COMMIT_FILE).exists():
                problem = (None if (entry / META_ITEM).is_dir() else
                           f"no {META_ITEM}/ item: not written by zeroxla.save")
            else:
                problem = f"no {COMMIT_FILE}: the save never committed"
            found.append(CheckpointInfo(int(entry.name), entry, problem is None, problem))
        elif match := TMP_RE.match(entry.name):
            found.append(CheckpointInfo(
                int(match.group(1)), entry, False,
                "a save was interrupted (or is still running) before orbax committed it"))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def latest_step(directory: str | Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = [c.step for c in list_checkpoints(directory) if c.complete]
    return max(steps) if steps else None


def select(directory: Path, step: int | None) -> CheckpointInfo:
    """The checkpoint to read: `step`, or the newest complete one (warning about skipped ones)."""
    infos = list_checkpoints(directory)
    if step is not None:
        matching = [c for c in infos if c.step == step]
        complete = [c for c in matching if c.complete]
        if complete:
            return complete[0]
        if matching:
            raise IncompleteCheckpointError(
                f"checkpoint step {step} at {matching[0].path} is incomplete: "
                f"{matching[0].problem}; complete steps: {[c.step for c in infos if c.complete]}")
        raise FileNotFoundError(f"no checkpoint step {step} in {directory}; complete steps: "
                                f"{[c.step for c in infos if c.complete]}")
    complete = [c for c in infos if c.complete]
    if not complete:
        broken = [str(c.path) for c in infos]
        raise FileNotFoundError(f"no complete checkpoint in {directory}"
                                + (f" (incomplete: {broken})" if broken else ""))
    chosen = complete[-1]
    for c in infos:
        if not c.complete:
            warnings.warn(f"skipping incomplete checkpoint {c.path} (step {c.step}): {c.problem}; "
                          f"restoring step {chosen.step}", IncompleteCheckpointWarning,
                          stacklevel=3)
    return chosen
