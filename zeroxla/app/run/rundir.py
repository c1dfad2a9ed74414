"""Run directories: where a `zeroxla train` run writes, and the rule that no run overwrites another.

    runs/gpt-tiny-20250614-093012/
        metrics.jsonl       one JSON record per step and per evaluation, appended across resumes
        loss_curve.png      the whole run's losses (read back from metrics.jsonl)
        summary.json        the settings actually used and the final report
        checkpoint/<n>/     step checkpoints (`zeroxla.save`'s layout)

A new run gets a fresh directory, `runs/<model>-<YYYYmmdd-HHMMSS>` (with `-2`, `-3`, ... if that
name is taken). An explicit `--out` that already holds a run is refused (`check_out_dir`) unless
it is the run being resumed; the checks here read only the file system, so a job refuses
before JAX starts, and again when the runner claims the directory (`claim`: an exclusive lock,
so of two jobs started together on one `--out` one runs and the other is refused). A run that
fails removes what it wrote unless the directory holds a checkpoint (`removed_unless_saved`:
the runner's failure rule). `--resume` accepts a run directory, its `checkpoint/`
directory, or one step directory inside it (`locate_resume`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss_curve.png"
CHECKPOINT_DIR = "checkpoint"
# What makes a directory "a run": any of these.
RUN_FILES = (METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR)
DEFAULT_ROOT = "runs"


class RunDirError(ValueError):
    """`--out` or `--resume` names a directory that cannot be used; the message says why."""


def default_run_dir(model: str, *, now: datetime.datetime, root: str | Path = DEFAULT_ROOT) -> Path:
    """`root/<model>-<YYYYmmdd-HHMMSS>`, or that name with `-2`, `-3`, ... if it exists."""
    return fresh_path(Path(root) / f"{model}-{now:%Y%m%d-%H%M%S}")


def run_files(directory: str | Path) -> list[str]:
    """The run files (`RUN_FILES`) present in `directory`; [] for a missing directory."""
    directory = Path(directory)
    return [name for name in RUN_FILES if (directory / name).exists()]


def fresh_path(directory: Path) -> Path:
    """`directory` if it does not exist, else the first free `directory-2`, `-3`, ..."""
    candidate, n = directory, 1
    while candidate.exists():
        n += 1
        candidate = directory.with_name(f"{directory.name}-{n}")
    return candidate


def check_out_dir(out: str | Path, *, resuming: Path | None = None,
                  resumable: bool = True) -> None:
    """Raises RunDirError if `out` holds a run other than `resuming` (the run being continued).

    The message names the ways forward that exist: a fresh `--out`, and `--resume` to continue
    that run only for a command that has it (`resumable`: `zeroxla train`; not `reward`, `ppo`)
    and a run that has a checkpoint/ to continue from.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file; accepted: a directory that holds no run yet "
                          f"(e.g. --out {fresh_path(out)}), or leave --out out for a fresh "
                          f"{DEFAULT_ROOT}/<model>-<time>")
    found = run_files(out)
    if not found:
        return
    if resuming is not None and out.resolve() == resuming.resolve():
        return
    listed = ", ".join(f"{name}/" if (out / name).is_dir() else name for name in found)
    fresh = (f"to start a new one: --out {fresh_path(out)} (or leave --out out for a fresh "
             f"{DEFAULT_ROOT}/<model>-<time>)")
    if resumable and (out / CHECKPOINT_DIR).is_dir():
        forward = f"To continue that run: --resume {out}; {fresh}"
    else:
        forward = f"{fresh[0].upper()}{fresh[1:]}, or delete {out} to redo it"
    raise RunDirError(f"--out {out} already holds a run ({listed}); refusing to overwrite it. "
                      f"{forward}")


@dataclasses.dataclass
class RunClaim:
    """A run directory held by this job (`claim`): `created` is the outermost directory the
    claim made (None if `out` existed); the lock lasts until `release()` or the process ends."""

    out: Path
    created: Path | None
    fd: int | None

    def release(self) -> None:
        """Lets another job claim `out` (closing the descriptor releases the lock)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim(out: str | Path, *, fresh: bool, resuming: Path | None = None,
          resumable: bool = True) -> RunClaim:
    """Makes `out` this job's run directory, atomically: creates it (and its parents) if it is
    missing (`fresh`: it must not exist), takes an exclusive lock on it (`flock` on the
    directory, released when the process ends however it ends, so no stale lock survives a
    crash) and only then checks, under the lock, that it holds no run but `resuming`
    (`check_out_dir`). Of two jobs given one `--out` at once, exactly one gets it; the other
    gets the RunDirError `check_out_dir` raises for a directory that holds a run, having
    written nothing. `check_out_dir` before the job starts stays the early, lock-free refusal.
    """
    import fcntl

    out = Path(out)
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    try:
        out.mkdir(parents=True, exist_ok=not fresh)
    except FileExistsError:
        raise RunDirError(f"run directory {out} was created by another job meanwhile; start "
                          "again (a new name is chosen)") from None
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(_in_use(out)) from None
        if os.fstat(fd).st_ino != os.stat(out).st_ino:      # removed and made anew meanwhile
            raise RunDirError(_in_use(out))
        check_out_dir(out, resuming=resuming, resumable=resumable)
    except BaseException:
        os.close(fd)
        raise
    return RunClaim(out, created, fd)


def _in_use(out: Path) -> str:
    return (f"--out {out} already holds a run (another zeroxla job is writing to it now); "
            f"refusing to share it. To start a new one: --out {fresh_path(out)} (or leave --out "
            f"out for a fresh {DEFAULT_ROOT}/<model>-<time>)")


_UNKNOWN = object()


def part_dir(out: Path, name: str | None) -> Path:
    """Where a job's part is checkpointed: checkpoint/, or checkpoint/<name>/ for a job of
    several parts (PPO's actor and critic)."""
    directory = Path(out) / CHECKPOINT_DIR
    return directory if name is None else directory / name


def has_checkpoint(out: Path) -> bool:
    """Whether run directory `out` holds a complete checkpoint (of any part)."""
    from zeroxla import checkpoint

    directory = Path(out) / CHECKPOINT_DIR
    if not directory.is_dir():
        return False
    parts = [directory, *(d for d in directory.iterdir() if d.is_dir() and not d.name.isdigit())]
    return any(checkpoint.latest_step(d) is not None for d in parts)


@contextlib.contextmanager
def removed_unless_saved(out: Path, *, created: Any = _UNKNOWN) -> Iterator[None]:
    """The failure rule of every run, around its writing to run directory `out`: if the block
    raises (an error, or Ctrl-C) and `out` holds no complete checkpoint, removes what the block
    created, so a retry with the same --out is not refused as a run and no half-written run is
    left: `out` itself (and the parents it made) when the block created it, else the entries
    of `out` that were not there before. A directory that holds a checkpoint is never removed.
    `created`: the outermost directory made just before the block for it (`RunClaim.created`),
    if known."""
    out = Path(out)
    if created is _UNKNOWN:
        created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    before = set(os.listdir(out)) if created is None and out.is_dir() else set()
    try:
        yield
    except BaseException:
        if has_checkpoint(out):
            raise
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif out.is_dir():
            for name in set(os.listdir(out)) - before:
                path = out / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


def check_no_newer(out: Path, part: str | None, restored: Path) -> None:
    """Refuses to continue from checkpoint `restored` in run directory `out` when its
    checkpoints of `part` already go further (the later ones would be overwritten by another
    history). Steps are the checkpoints' own numbers (optimizer steps)."""
    from zeroxla import checkpoint

    directory = part_dir(out, part)
    latest = checkpoint.latest_step(directory) if directory.is_dir() else None
    if latest is not None and latest > int(Path(restored).name):
        raise RunDirError(
            f"--resume: the checkpoint is {restored} but {directory} already has a newer one, "
            f"{latest}; resume from the newest (--resume {out}) or continue into a fresh "
            f"directory (--out {fresh_path(Path(out))})")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """What `--resume PATH` names.

    `checkpoint_dir`: the directory given to `zeroxla.save`; `step`: one step in it, or None for
    the newest complete one; `run_dir`: the run the checkpoints belong to (the parent of a
    `checkpoint/` directory), None for checkpoints saved elsewhere.
    """

    checkpoint_dir: Path
    step: int | None
    run_dir: Path | None


def _is_step_dir(path: Path) -> bool:
    # A step directory of `zeroxla.save`: DIR/<n>/ holding orbax items (never the run itself).
    return path.name.isdigit() and path.is_dir() and not (path / CHECKPOINT_DIR).is_dir()


def locate_resume(path: str | Path) -> ResumePoint:
    """Reads `--resume PATH`: a run directory, its `checkpoint/` directory or a step in it.

    Raises RunDirError naming the accepted forms when PATH is none of them.
    """
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"--resume {path}: no such directory; accepted: a run directory (e.g. "
                          f"{DEFAULT_ROOT}/gpt-tiny-20250101-120000), its {CHECKPOINT_DIR}/ "
                          "directory, or one step directory inside that")
    if (path / CHECKPOINT_DIR).is_dir():
        return ResumePoint(path / CHECKPOINT_DIR, None, path)
    if _is_step_dir(path):
        checkpoint_dir = path.parent
        return ResumePoint(checkpoint_dir, int(path.name), _run_of(checkpoint_dir))
    if any(entry.name.isdigit() or ".orbax-checkpoint-tmp" in entry.name
           for entry in path.iterdir()):
        return ResumePoint(path, None, _run_of(path))
    raise RunDirError(f"--resume {path} holds no checkpoints; accepted: a run directory with a "
                      f"{CHECKPOINT_DIR}/ inside, a checkpoint directory given to zeroxla.save, "
                      "or one step directory inside it")


def _run_of(checkpoint_dir: Path) -> Path | None:
    return checkpoint_dir.parent if checkpoint_dir.name == CHECKPOINT_DIR else None


def checkpoint_dir_of(run: str | Path) -> Path:
    """The checkpoint directory of a run directory (its checkpoint/), or `run` itself when it
    is already one."""
    run = Path(run)
    return run / CHECKPOINT_DIR if (run / CHECKPOINT_DIR).is_dir() else run


def read_metrics(path: str | Path, key: str = "step") -> list[dict]:
    """The records of a metrics.jsonl that hold `key` (a record's position: "step", or
    "iteration"); [] if there is none. A torn last line (a run killed while writing it) is
    skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and key in record:
            records.append(record)
    return records


def write_metrics(path: str | Path, records: list[dict]) -> None:
    """Replaces `path` with `records`, one JSON object a line, atomically (write, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)


__all__ = ["CHECKPOINT_DIR", "DEFAULT_ROOT", "METRICS_FILE", "PLOT_FILE", "RUN_FILES",
           "ResumePoint", "RunClaim", "RunDirError", "SUMMARY_FILE", "check_no_newer",
           "check_out_dir", "checkpoint_dir_of", "claim", "default_run_dir", "fresh_path",
           "has_checkpoint", "locate_resume", "part_dir", "read_metrics", "removed_unless_saved",
           "run_files", "write_metrics"]
