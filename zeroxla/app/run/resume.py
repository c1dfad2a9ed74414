"""One resume contract for every job: the recorded tree comes back, changes are said, edited
data is refused.

Every checkpoint records the job (`job_record`, under `RECORD_KEY`): its kind, its config tree
as JSON (per-invocation fields left out, paths absolute) and a SHA-256 fingerprint of each data
file it read. `--resume RUN` rebuilds the tree from the record (`tree_from_record`), applies
the options the command line gives over it (the command line wins, as in `zeroxla train`) and
says in one line what came back and which recorded values changed (`resumed_tree`). A data file
whose contents changed under the same name is refused, naming its option and both
fingerprints: the steps already trained saw the old contents, and a silent mix is the one
outcome no user asks for; a new path given on the command line is a change, taken and said.
Nothing here uses JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zeroxla.app.run.job import PER_INVOCATION

RECORD_KEY = "run_record"          # checkpoint metadata: {"kind", "config", "data", "done"}
_CHUNK = 1 << 20


def fingerprint(path: str | Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB chunks); of a directory (Parquet shards, a
    `datasets` save_to_disk), of each file's relative path and bytes, in path order."""
    digest = hashlib.sha256()
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for file in files:
        if root.is_dir():
            digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                digest.update(chunk)
    return digest.hexdigest()


def fingerprints(files: Mapping[str, str | None]) -> dict[str, dict[str, str]]:
    """{option: {"path": absolute path, "sha256": ...}} of the files given (None: not given)."""
    return {option: {"path": os.path.abspath(path), "sha256": fingerprint(path)}
            for option, path in files.items() if path is not None}


def data_paths(tree: Any, fields: Mapping[str, str]) -> dict[str, str | None]:
    """{option: path} of a tree's data files, `fields` naming each option's dotted field."""
    paths = {}
    for option, dotted in fields.items():
        value = tree
        for name in dotted.split("."):
            value = getattr(value, name)
        paths[option] = value
    return paths


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def tree_record(tree: Any) -> dict[str, Any]:
    """The tree as JSON (nested dataclasses as objects, tuples as lists), the run section's
    per-invocation fields left out."""
    record = _jsonable(tree)
    run = record.get("run")
    if isinstance(run, dict):
        record["run"] = {k: v for k, v in run.items() if k not in PER_INVOCATION}
    return record


def _value(hint: Any, value: Any) -> Any:
    """A recorded value as the field's type: nested dataclasses rebuilt, lists as tuples."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, Mapping):
            return tree_from_record(option, value)
    if isinstance(value, list):
        return tuple(_value(typing.Any, v) for v in value)
    return value


def tree_from_record(cls: type, record: Mapping[str, Any]) -> Any:
    """Inverse of `tree_record` (per-invocation fields at their defaults; keys a newer zeroxla
    recorded that this one does not know are dropped)."""
    hints = typing.get_type_hints(cls)
    values = {f.name: _value(hints[f.name], record[f.name])
              for f in dataclasses.fields(cls) if f.init and f.name in record}
    return cls(**values)


def job_record(kind: str, tree: Any, data: Mapping[str, str | None], done: int) -> dict:
    """What every checkpoint of a job records about the job (`RECORD_KEY`)."""
    return {"kind": kind, "config": tree_record(tree), "data": fingerprints(data),
            "done": done}


def flat_record(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested record with dotted keys: {"sharding": {"stage": 3}} -> {"sharding.stage": 3}."""
    out = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(flat_record(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_fields(before: Any, after: Any) -> dict[str, tuple[Any, Any]]:
    """{dotted field: (recorded, now)} where two trees' records differ."""
    old, new = flat_record(tree_record(before)), flat_record(tree_record(after))
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)}


def check_data(recorded: Mapping[str, Mapping[str, str]],
               files: Mapping[str, str | None]) -> None:
    """Refuses a data file read under the recorded path whose bytes changed since."""
    for option, path in files.items():
        seen = recorded.get(option)
        if path is None or seen is None or os.path.abspath(path) != seen["path"]:
            continue                     # not recorded, or a new path: a change, said elsewhere
        if not os.path.exists(path):
            raise ValueError(f"{option} {path}: the file the run recorded is gone; accepted: "
                             "the file as the run read it, or another file given to "
                             f"{option} (taken as a change)")
        now = fingerprint(path)
        if now != seen["sha256"]:
            raise ValueError(f"{option} {path} changed since the run read it (sha256 "
                             f"{seen['sha256'][:12]}... then, {now[:12]}... now): its earlier "
                             "steps saw the old contents; accepted: the file as it was, or the "
                             f"new contents under another name given to {option} (taken as a "
                             "change)")


def refuse_fixed(changes: Mapping[str, tuple[Any, Any]], fixed: frozenset[str],
                 names: Mapping[str, str], source: str) -> None:
    """ValueError naming each option among `changes` ({dotted field: (recorded, now)}) that a
    resumed run cannot change: the checkpoint's state (adapters) or the frozen reference was
    made from its recorded value."""
    refused = [f"{names.get(k, k)} {a!r} -> {b!r}" for k, (a, b) in changes.items()
               if k in fixed]
    if refused:
        raise ValueError(f"--resume {source} continues the run as it was built; "
                         f"{', '.join(refused)} cannot change (the checkpoint's state, or the "
                         "frozen reference, was made from the recorded value); accepted: the "
                         "recorded value, or a new run")


def resumed_tree(kind: str, recorded: Mapping[str, Any] | None, cls: type,
                 apply: Callable[[Any], Any], names: Mapping[str, str], source: str,
                 fixed: frozenset[str] = frozenset()) -> tuple[Any, str]:
    """The tree a `--resume` continues, and the line that says what came back and changed.

    `recorded`: the checkpoint's `RECORD_KEY`; `apply(tree)`: the command line's options over a
    tree; `names`: dotted field -> its option ("dpo.beta" -> "--beta"), for the line; `fixed`:
    the dotted fields a resumed run cannot change (refused, naming the option).
    """
    if recorded is None or recorded.get("kind") != kind:
        found = None if recorded is None else recorded.get("kind")
        raise ValueError(f"--resume {source} is not a `zeroxla {kind}` run: its checkpoint "
                         f"records job {found!r}; accepted: a run this command wrote")
    before = tree_from_record(cls, recorded["config"])
    after = apply(before)
    changes = changed_fields(before, after)
    refuse_fixed(changes, fixed, names, source)
    said = ", ".join(f"{names.get(k, k)} {a!r} -> {b!r}" for k, (a, b) in changes.items())
    return after, (f"resume: the run's recorded settings came back; changed on the command "
                   f"line: {said or 'nothing'}")


__all__ = ["RECORD_KEY", "changed_fields", "check_data", "data_paths", "refuse_fixed", "fingerprint", "fingerprints",
           "job_record", "resumed_tree", "tree_from_record", "tree_record"]
