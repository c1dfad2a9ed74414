"""The order test files are handed to pytest-xdist's workers: the longest first.

`python -m pytest -n 2 --dist loadfile` gives each worker one file at a time, in the order of the
collection, and a worker that finishes a file takes the next. Whatever file comes last runs alone
while the other worker idles, so a long file handed out last stretches the run by most of its
length. Handing out the longest files first (the longest-processing-time rule) leaves only short
files for the end. pytest-xdist's own reordering sorts files by their number of tests, which
says little about their time here (a file of 115 config checks takes 0.1 s, one of 14
sequence-parallel parity tests 40 s), so the suite turns it off (tests/conftest.py's
`pytest_configure`, as `--no-loadscope-reorder` would) and `order_items` sorts the collection by
the seconds of file_seconds.py.

The seconds are a scheduling hint, not a check: a stale or missing entry costs only balance
(a file without one goes after every file with one, in collection order), and no test's result
depends on the order (the compile budgets already hold for any order: compile_budgets.py).
Rewrite them from a profiled run:

    python -m pytest -n 2 --dist loadfile -m "not slow" --write-file-seconds    # daily column
    python -m pytest -n 2 --dist loadfile --write-file-seconds                  # whole column

(each file's wall seconds summed over its tests in that run: `suite_profile.py`).
"""

from __future__ import annotations

import runpy
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.py")
COLUMNS = ("daily", "whole")


def load_table(table: Path = TABLE) -> dict[str, tuple[float, float]]:
    return runpy.run_path(str(table))["FILE_SECONDS"]


def tier_of(markexpr: str) -> str:
    """"daily" for a run that deselects the slow tests (`-m "not slow"`, CI's second leg's
    `-m "not slow or second_leg"`), else "whole"."""
    return "daily" if "not slow" in (markexpr or "") else "whole"


def file_seconds(table: dict[str, tuple[float, float]], tier: str) -> dict[str, float]:
    """Each file's seconds in `tier`'s column (the whole suite's falls back to the daily one)."""
    column = COLUMNS.index(tier)
    return {path: row[column] or row[0] for path, row in table.items()}


def order_items(items: list, rootpath: Path, seconds: dict[str, float]) -> None:
    """Sorts `items` in place: files by their seconds, the longest first (files without an
    entry after them, in their collection order); each file's tests keep their order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.path.relative_to(rootpath).as_posix(), len(first_seen))

    def key(item):
        path = item.path.relative_to(rootpath).as_posix()
        return (-seconds.get(path, 0.0), first_seen[path])

    items.sort(key=key)      # stable: a file's tests stay in collection order


def write_table(measured: dict[str, float], old: dict[str, tuple[float, float]], tier: str,
                table: Path = TABLE) -> None:
    """Rewrites file_seconds.py with `measured` (path -> wall seconds of this run) in `tier`'s
    column; the other column, and files this run did not reach, keep their values."""
    column = COLUMNS.index(tier)
    rows = {path: list(row) for path, row in old.items()}
    for path, seconds in measured.items():
        rows.setdefault(path, [0.0, 0.0])[column] = round(seconds, 1)
    text = table.read_text()
    head = text[:text.index("FILE_SECONDS = {")]
    lines = [f'    "{path}": ({d}, {w}),' for path, (d, w) in sorted(rows.items())
             if d or w]
    table.write_text(head + "FILE_SECONDS = {\n" + "\n".join(lines) + "\n}\n")
