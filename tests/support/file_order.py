"""The order in which `-n 2 --dist loadfile` hands test files to the workers: longest first.

A worker takes whole files, first come, first served. Handed out longest first (LPT
scheduling), the run ends on short files on both workers; in collection order, a 100-second
notebook can start last on one worker while the other idles. Each file's seconds come from a
measured run (`file_seconds.json`, beside this file); a file not in it counts as
`UNMEASURED_SLOW` seconds if it holds a slow test, else 0. The numbers only order the files:
a stale table costs balance, never a test. (pytest-xdist would otherwise reorder the files by
their number of tests; tests/conftest.py turns that off.)

Regenerate after a full run with a JUnit report:
    python -m pytest -n 2 --dist loadfile --junitxml=/tmp/suite.xml
    python tests/support/file_order.py /tmp/suite.xml > tests/support/file_seconds.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")
UNMEASURED_SLOW = 30.0


def file_seconds() -> dict[str, float]:
    """{test file, relative to the repository root: seconds its tests took}."""
    return json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}


def longest_first(items: list, root: Path) -> None:
    """Sorts pytest `items` in place: files by measured seconds, longest first; each file's
    tests kept together and in their order."""
    seconds = file_seconds()
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def weight(item) -> float:
        known = seconds.get(item.path.relative_to(root).as_posix())
        return known if known is not None else (UNMEASURED_SLOW if item.path in slow else 0.0)
    items.sort(key=lambda item: -weight(item))          # stable: each file's order kept


def _seconds_from_junit(report: Path, root: Path) -> dict[str, float]:
    """Per-file seconds from a pytest JUnit XML report (testcase `classname` is the module's
    dotted path)."""
    totals: Counter = Counter()
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        for end in range(len(parts), 0, -1):            # a test class adds a trailing part
            path = Path(*parts[:end]).with_suffix(".py")
            if (root / path).exists():
                totals[path.as_posix()] += float(case.get("time", 0.0))
                break
    return {path: round(s, 1) for path, s in totals.most_common()}


if __name__ == "__main__":
    print(json.dumps(_seconds_from_junit(Path(sys.argv[1]), Path(__file__).parents[2]),
                     indent=1))
