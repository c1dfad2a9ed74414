"""`fusion_emitters` tests run in a child pytest with XLA:CPU's fusion emitters (tests/conftest.py
says with which environment, tests/support/xla_flags.py why): one child per test file, not one
per test. A child pays for a Python, pytest and JAX start before its first test, so the first
such test of a file that runs starts one child with every selected such test of the file; each
of them then passes, fails or skips as the child recorded it. pytest-xdist's `--dist loadfile`
runs a file on one worker, so each file starts one child per run (under `--dist load` a worker
may start its own child for a file whose tests it shares with another: more work, the same
outcomes).

In the child, `Recorder` writes one JSON line per finished test (node id, outcome, the report's
text) to the file OUTCOMES_ENV names. A test the child did not finish (it crashed or stopped)
fails with the child's exit status and output; the file's tests after it start a new child.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping

import pytest

MARKER = "fusion_emitters"
OUTCOMES_ENV = "ZEROXLA_TEST_FUSION_OUTCOMES"     # set in the child: where Recorder writes
SECONDS_PER_TEST = 300                             # the child's time limit, per test it runs


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test's result in the child: "passed", "failed" or "skipped", and why."""
    outcome: str
    text: str = ""


# Per session (pytest's stash on the config, not module state): node id -> Outcome.
_OUTCOMES = pytest.StashKey[dict[str, Outcome]]()


def outcome_of(item: pytest.Item, child_environ: Mapping[str, str]) -> Outcome:
    """`item`'s outcome in a child pytest run with `child_environ`: what its file's child
    recorded, the child started now (with every selected `fusion_emitters` test of the file
    not yet run) if no child of this session has run `item`."""
    known = item.config.stash.setdefault(_OUTCOMES, {})
    if item.nodeid not in known:
        batch = [other.nodeid for other in item.session.items
                 if other.path == item.path and other.get_closest_marker(MARKER)
                 and other.nodeid not in known]
        known.update(_run_child(item.config, child_environ,
                                batch if item.nodeid in batch else [item.nodeid]))
    return known[item.nodeid]


def _run_child(config: pytest.Config, child_environ: Mapping[str, str],
               nodeids: list[str]) -> dict[str, Outcome]:
    """Runs `nodeids` (one file's tests) in a child pytest; their outcomes, the first one it
    did not finish failed."""
    env = dict(child_environ)
    with tempfile.TemporaryDirectory(prefix="zeroxla-fusion-child-") as folder:
        env[OUTCOMES_ENV] = os.path.join(folder, "outcomes.jsonl")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
             "--rootdir", str(config.rootpath), *nodeids],
            cwd=config.rootpath, env=env, capture_output=True, text=True,
            timeout=SECONDS_PER_TEST * len(nodeids))
        outcomes = _read(env[OUTCOMES_ENV])
    unfinished = [nodeid for nodeid in nodeids if nodeid not in outcomes]
    if unfinished:
        outcomes[unfinished[0]] = Outcome("failed", (
            f"the child pytest exited {result.returncode} before finishing this test:\n"
            f"{result.stdout[-6000:]}{result.stderr[-2000:]}"))
    return outcomes


def _read(path: str) -> dict[str, Outcome]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["nodeid"]: Outcome(r["outcome"], r["text"]) for r in records}


class Recorder:
    """The child's plugin: a test's setup, call and teardown reports, written as one line when
    its teardown ends (failed if any phase failed, else skipped if one skipped)."""

    def __init__(self, path: str):
        self.path = path
        self.reports: dict[str, list[pytest.TestReport]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        reports = self.reports.setdefault(report.nodeid, [])
        reports.append(report)
        if report.when != "teardown":
            return
        failed = [r for r in reports if r.failed]
        skipped = [r for r in reports if r.skipped]
        outcome = "failed" if failed else "skipped" if skipped else "passed"
        if failed:
            text = "\n".join([failed[0].longreprtext, *(
                f"{name}\n{content}" for name, content in reports[-1].sections)])
        elif skipped:        # a skip's longrepr is (path, line, reason)
            longrepr = skipped[0].longrepr
            text = longrepr[2] if isinstance(longrepr, tuple) else skipped[0].longreprtext
        else:
            text = ""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": outcome,
                                "text": text[-6000:]}) + "\n")
        del self.reports[report.nodeid]
