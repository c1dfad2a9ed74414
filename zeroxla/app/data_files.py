"""A job's data file as rows: the one reader behind every `--data` and `--prompts`.

    rows(path, split=None) -> Iterator[Row]       Row(source, number, record: dict)

What `path` may be, told apart by its name and then what a directory holds:

    NAME.jsonl, NAME.json (.gz)   JSON lines, or a JSON array (`zeroxla.app.data.read_records`);
                                  a row is named `NAME:LINE`
    NAME.parquet                  Parquet (pyarrow), read one record batch of BATCH_ROWS rows
                                  at a time (`ParquetFile.iter_batches`, unbuffered row groups
                                  read through a BUFFER_BYTES buffer), never whole: a file
                                  larger than memory streams; a row is named `NAME row N`
    DIR of *.parquet shards       each shard in name order, as above (a Hub dataset's export)
    DIR saved by `datasets`       `Dataset.save_to_disk` (memory-mapped Arrow, read a batch at a
                                  time); a `DatasetDict`'s needs `split` (`--split train`), and a
                                  row is named `DIR[train] row N`

Rows are numbered from 1. The column layouts (TRL's `prompt`/`completion`, `messages`,
`chosen`/`rejected`, verl's `prompt`/`reward_model`/`extra_info`) are checked where each job
reads its rows (`chat_data`, `prompt_files`), naming the row and the column. A Parquet or
`datasets` cell that is null is left out of its row's dict, as a key a JSON line does not
hold: a column some rows lack reads the same in every format. Parquet needs pyarrow and a
`datasets` directory needs datasets, both in the `data` extra (`pip install "zeroxla[data]"`);
a missing one is refused naming the extra (`check_installed`, before a run starts).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from zeroxla.app.data import ACCEPTED_JSON, ChatDataError, json_suffix, read_records

BATCH_ROWS = 1024              # rows per record batch read from Parquet or a datasets directory
BUFFER_BYTES = 1 << 20         # Parquet's column chunks are read through a buffer of this size
PARQUET = ".parquet"
EXTRA = "data"
# what each kind of source needs: (the module imported, the package named in the error)
NEEDS = {"parquet": ("pyarrow", "pyarrow"), "parquet_dir": ("pyarrow", "pyarrow"),
         "datasets": ("datasets", "datasets")}
ACCEPTED = (f"{ACCEPTED_JSON}; a .parquet file or a directory of .parquet shards; or a "
            "directory saved by datasets' save_to_disk (a DatasetDict's with a split)")
DATASET_FILES = ("state.json", "dataset_dict.json")     # a Dataset's, a DatasetDict's


class Row(NamedTuple):
    """One row of a data file: where it was read and its columns."""

    source: str                # the file (a shard of a directory), or "DIR[split]"
    number: int                # 1-based: a JSON file's line, else the row
    record: dict[str, Any]

    @property
    def where(self) -> str:
        return where(self.source, self.number)


def where(source: str, number: int) -> str:
    """How errors name a row: `file:line` of a JSON file, `source row N` of the others."""
    return f"{source}:{number}" if json_suffix(source) else f"{source} row {number}"


def type_name(source: str, value: Any) -> str:
    """A value's type as errors name it: "a JSON str" in a JSON file, else the Python type
    that Parquet or `datasets` gave the cell ("an int", "a list")."""
    name = ("JSON " if json_suffix(source) else "") + type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def kind(path: str | os.PathLike) -> str | None:
    """"json", "parquet", "parquet_dir" or "datasets" for a data file this module reads; None
    for anything else (a text file, which only `zeroxla train` reads, as text)."""
    name = os.fspath(path)
    if json_suffix(name) is not None:
        return "json"
    if name.lower().endswith(PARQUET):
        return "parquet"
    if os.path.isdir(name):
        if any((Path(name) / f).is_file() for f in DATASET_FILES):
            return "datasets"
        if _shards(Path(name)):
            return "parquet_dir"
    return None


def _shards(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.lower().endswith(PARQUET))


def check_installed(paths: Iterable[str | None],
                    find_spec: Callable[[str], Any] = importlib.util.find_spec) -> None:
    """ValueError naming the package and the `data` extra for a path of `paths` (None: not
    given) whose reader is not installed; called before a run starts."""
    for path in paths:
        need = NEEDS.get(kind(path)) if path is not None else None
        if need is not None and find_spec(need[0]) is None:
            raise ValueError(f"{path}: reading it needs the package {need[1]}, which is not "
                             f"installed (pip install \"zeroxla[{EXTRA}]\"); accepted: install "
                             f"it, or {ACCEPTED_JSON}")


def check_split(split: str | None, path: str | None, option: str) -> None:
    """ValueError naming `--split` when it is given without the data option `option` (whose
    value is `path`), or is not a name."""
    if split is not None and (not isinstance(split, str) or not split or path is None):
        raise ValueError(f"--split {split!r} with {option} {path!r} is invalid; accepted: a "
                         f"split's name, with {option} naming a DatasetDict directory")


def rows(path: str | os.PathLike, split: str | None = None) -> Iterator[Row]:
    """The rows of `path` (see the module docstring); ChatDataError naming the path when it is
    none of the accepted forms, holds no row, or `split` does not fit it."""
    name = os.fspath(path)
    found = kind(name)
    if found is None:
        what = "no such file or directory" if not os.path.exists(name) else "not a data file"
        raise ChatDataError(f"{name}: {what}; accepted: {ACCEPTED}")
    if split is not None and found != "datasets":
        raise ChatDataError(f"split {split!r} given for {name}, which has no splits; accepted: "
                            "a split only with a directory saved by datasets' DatasetDict")
    check_installed([name])
    count = 0
    if found == "json":
        read: Iterator[Row] = (Row(name, n, r) for n, r in read_records(name))
    elif found == "parquet":
        read = _parquet_rows(Path(name))
    elif found == "parquet_dir":
        read = (row for shard in _shards(Path(name)) for row in _parquet_rows(shard))
    else:
        read = _dataset_rows(name, split)
    for row in read:
        count += 1
        yield row
    if count == 0:
        raise ChatDataError(f"{name}{'' if split is None else f'[{split}]'}: no rows; "
                            f"accepted: {ACCEPTED}")


def _present(record: dict[str, Any]) -> dict[str, Any]:
    """The record without its null cells (module docstring)."""
    return {k: v for k, v in record.items() if v is not None}


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = str(path)
    try:
        # pre_buffer off: pyarrow would otherwise issue the reads of every row group asked for,
        # which iter_batches asks for all at once (the whole file in memory, apache/arrow#39820)
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=BUFFER_BYTES)
        batches = parquet.iter_batches(batch_size=BATCH_ROWS)
        number = 0
        for batch in batches:                       # one record batch in memory at a time
            for record in batch.to_pylist():
                number += 1
                yield Row(name, number, _present(record))
    except (pa.ArrowException, OSError) as err:
        raise ChatDataError(f"{name}: not a readable Parquet file ({err}); accepted: "
                            f"{ACCEPTED}") from None


def _dataset_rows(name: str, split: str | None) -> Iterator[Row]:
    import datasets

    loaded = datasets.load_from_disk(name)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            given = "no split given" if split is None else f"split {split!r} is not one of them"
            raise ChatDataError(f"{name}: a DatasetDict of splits {sorted(loaded)} ({given}); "
                                f"accepted: one of them as the split (--split "
                                f"{sorted(loaded)[0]})")
        loaded, source = loaded[split], f"{name}[{split}]"
    elif split is not None:
        raise ChatDataError(f"split {split!r} given for {name}, a Dataset of no splits; "
                            "accepted: no split, or a directory saved by a DatasetDict")
    else:
        source = name
    number = 0
    for batch in loaded.with_format(None).iter(batch_size=BATCH_ROWS):   # {column: [values]}
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            number += 1
            yield Row(source, number, _present(dict(zip(columns, values))))


__all__ = ["ACCEPTED", "BATCH_ROWS", "EXTRA", "Row", "check_installed", "check_split", "kind",
           "rows", "type_name", "where"]
