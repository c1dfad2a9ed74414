"""Where the suite's time goes, per test file, and the compile budget that keeps it there.

A pytest plugin (tests/conftest.py registers it in every pytest process, pytest-xdist's workers
included). Each test item counts, from its setup's start to its teardown's end, in its own process:

- XLA compile requests (JAX's `/jax/core/compile/backend_compile_duration` event, which fires once
  per program handed to the backend, whether XLA compiles it or the persistent compilation cache
  returns it: the count is the same cold or warm) and their seconds; the cache's hits;
- tracing (`jaxpr_trace_duration`) and lowering to StableHLO (`jaxpr_to_mlir_module_duration`)
  seconds (a jit traced inside another's trace is counted in both: the figure is an upper bound);
- processes started (`subprocess.Popen`, seen through Python's audit hook `subprocess.Popen`:
  jobs run through their CLI, notebooks' kernels, child pytests);
- the item's wall time (setup + call + teardown, from pytest's reports).

The counts travel to pytest-xdist's controller in the teardown report's `user_properties`, where
they are summed per file. Two uses:

    python -m pytest -n 2 --dist loadfile --suite-profile=profile.md   # the per-file table
                                                    # (and profile.md.tests.tsv: each test)
    python -m pytest -n 2 --dist loadfile -m "not slow" --write-compile-budgets
                                                    # rewrite tests/support/compile_budgets.py
                                                    # (then `=raise` on the other CI leg's JAX)

The compile budget: every test file of the daily subset (`-m "not slow"`) has a line in
`compile_budgets.BUDGETS` saying how many compile requests and processes its daily tests may
make. In any run, the counts of each file's daily tests are compared with its line, and a file
over budget (or a daily file without a line) fails the run at its end, naming the file, its
counts and its budget. The counts are deterministic (a compile request is counted whether or not
the cache answers it; conftest.py clears JAX's in-memory caches after each file, so no file
inherits another's programs); a run that also runs slow tests can only count fewer for the daily
ones (a module fixture is then built by whichever test comes first), never more. Raising a budget
is a reviewed one-line change of compile_budgets.py. Wall time is printed (`--durations=30`),
never asserted.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

import file_order

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
POPEN_AUDIT_EVENT = "subprocess.Popen"
# Processes a library starts once per machine, not per test: matplotlib runs `fc-list` to build
# its font cache the first time a fresh environment draws (a CI virtualenv, a new version).
# Counting them would make a file's count depend on what ran before it on the machine.
CACHE_BUILDING_EXECUTABLES = frozenset({"fc-list"})
PROPERTY = "zeroxla_profile"
BUDGETS_FILE = Path(__file__).with_name("compile_budgets.py")


@dataclasses.dataclass
class Counts:
    """What one test item (or, summed, one file) cost."""

    compiles: int = 0           # compile requests handed to the backend (cache hits included)
    cache_hits: int = 0
    subprocesses: int = 0
    compile_s: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0
    wall_s: float = 0.0
    tests: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                              dataclasses.astuple(other))))

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(dataclasses.astuple(self),
                                              dataclasses.astuple(other))))


class ProcessCounter:
    """The running totals of this process, fed by JAX's monitoring listeners and the audit hook
    (each registered once per process, in `pytest_configure`)."""

    def __init__(self):
        self.totals = Counts()

    def on_duration(self, event: str, seconds: float, **_):
        if event == COMPILE_EVENT:
            self.totals.compiles += 1
            self.totals.compile_s += seconds
        elif event == TRACE_EVENT:
            self.totals.trace_s += seconds
        elif event == LOWER_EVENT:
            self.totals.lower_s += seconds

    def on_event(self, event: str, **_):
        if event == CACHE_HIT_EVENT:
            self.totals.cache_hits += 1

    def on_audit(self, event: str, _args):
        if event == POPEN_AUDIT_EVENT:
            executable, argv = _args[0], _args[1]     # (executable, args, cwd, env)
            program = executable if executable is not None else (
                argv if isinstance(argv, (str, bytes)) else argv[0])
            if os.path.basename(os.fsdecode(program)) not in CACHE_BUILDING_EXECUTABLES:
                self.totals.subprocesses += 1

    def snapshot(self) -> Counts:
        return dataclasses.replace(self.totals)


def pytest_addoption(parser):
    group = parser.getgroup("zeroxla suite profile")
    group.addoption("--suite-profile", metavar="PATH", default=None,
                    help="write the per-file table of where the time goes (markdown) to PATH "
                         "and print its top 30")
    group.addoption("--compile-budgets", metavar="PATH", default=str(BUDGETS_FILE),
                    help="the budget table to check (and write): a Python file defining "
                         "BUDGETS = {path: (compiles, subprocesses)}")
    group.addoption("--write-compile-budgets", nargs="?", const="exact", default=None,
                    choices=("exact", "raise"),
                    help="rewrite tests/support/compile_budgets.py from this run's counts of "
                         "each file's daily tests (run it with -m 'not slow'): 'exact' (the "
                         "default) sets each line to the count, 'raise' only raises lines (to "
                         "take the larger count of the two CI legs' JAX versions)")
    group.addoption("--write-file-seconds", action="store_true", default=False,
                    help="rewrite tests/support/file_seconds.py (the order files go to the "
                         "workers) from this run's wall seconds per file (file_order.py)")


def pytest_configure(config):
    config.pluginmanager.register(SuiteProfile(config), "zeroxla_suite_profile")


class SuiteProfile:
    """The per-process counter (in every process) and the per-file sums (in the controller)."""

    def __init__(self, config):
        self.config = config
        self.counter = ProcessCounter()
        self.started: dict[str, tuple[Counts, float]] = {}
        self.files: dict[str, Counts] = defaultdict(Counts)         # every test that ran
        self.daily: dict[str, Counts] = defaultdict(Counts)         # its daily tests only
        self.items: list[tuple[str, Counts, bool]] = []             # (node id, cost, daily)
        self.over_budget: list[str] = []
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self.counter.on_duration)
        jax.monitoring.register_event_listener(self.counter.on_event)
        sys.addaudithook(self.counter.on_audit)

    # ---- in the process that runs the item ------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.started[item.nodeid] = (self.counter.snapshot(), time.perf_counter())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when != "teardown" or item.nodeid not in self.started:
            return
        before, start = self.started.pop(item.nodeid)
        spent = self.counter.snapshot() - before
        spent.wall_s = time.perf_counter() - start
        spent.tests = 1
        daily = item.get_closest_marker("slow") is None
        report.user_properties.append((PROPERTY, (dataclasses.astuple(spent), daily)))

    # ---- in the controller (or the only process) ------------------------------------------------

    def pytest_runtest_logreport(self, report):
        for name, value in report.user_properties:
            if name != PROPERTY:
                continue
            values, daily = value
            path = report.nodeid.split("::")[0]
            spent = Counts(*values)
            self.items.append((report.nodeid, spent, daily))
            self.files[path] = self.files[path] + spent
            if daily:
                self.daily[path] = self.daily[path] + spent

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if hasattr(self.config, "workerinput") or not self.files:
            return
        table = Path(self.config.getoption("compile_budgets"))
        budgets = runpy.run_path(str(table))["BUDGETS"]
        mode = self.config.getoption("write_compile_budgets")
        if mode:
            write_budgets(self.daily, budgets, table, raise_only=mode == "raise")
        else:
            self.over_budget = check_budgets(self.daily, budgets, table)
            if self.over_budget and session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.config.getoption("write_file_seconds"):
            file_order.write_table({path: spent.wall_s for path, spent in self.files.items()},
                                   file_order.load_table(),
                                   file_order.tier_of(self.config.getoption("markexpr")))
        path = self.config.getoption("suite_profile")
        if path:
            Path(path).write_text(profile_table(self.files) + "\n")
            Path(f"{path}.tests.tsv").write_text("".join(
                f"{spent.wall_s:.2f}\t{spent.compiles}\t{'daily' if daily else 'slow'}\t{node}\n"
                for node, spent, daily in sorted(self.items, key=lambda i: -i[1].wall_s)))

    def pytest_terminal_summary(self, terminalreporter):
        if hasattr(self.config, "workerinput"):
            return
        if self.config.getoption("suite_profile") and self.files:
            terminalreporter.write_sep("=", "where the time goes (top 30 files by wall time)")
            terminalreporter.write_line(profile_table(self.files, top=30))
        if self.over_budget:
            terminalreporter.write_sep("=", "compile budget exceeded", red=True)
            for line in self.over_budget:
                terminalreporter.write_line(line, red=True)


def check_budgets(daily: dict[str, Counts], budgets: dict[str, tuple[int, int]],
                  table: Path = BUDGETS_FILE) -> list[str]:
    """One line per daily test file over its (compiles, subprocesses) budget or without one."""
    problems = []
    for path, spent in sorted(daily.items()):
        if path not in budgets:
            problems.append(
                f"{path}: its daily tests made {spent.compiles} compile requests and "
                f"{spent.subprocesses} processes, and the file has no line in the compile "
                f"budgets ({_shown(table)}; add one: \"{path}\": "
                f"({spent.compiles}, {spent.subprocesses}),)")
            continue
        compiles, subprocesses = budgets[path]
        if spent.compiles > compiles or spent.subprocesses > subprocesses:
            problems.append(
                f"{path}: its daily tests made {spent.compiles} compile requests and "
                f"{spent.subprocesses} processes; its budget is {compiles} and {subprocesses} "
                f"({_shown(table)})")
    return problems


def _shown(table: Path) -> str:
    """The budget table's path, relative to the repository when it is ours."""
    try:
        return table.resolve().relative_to(BUDGETS_FILE.parents[2]).as_posix()
    except ValueError:
        return str(table)


def write_budgets(daily: dict[str, Counts], old: dict[str, tuple[int, int]], table: Path, *,
                  raise_only: bool = False):
    """Rewrite compile_budgets.py: this run's daily files, each at its count, or with
    `raise_only` at the larger of its count and its line (files this run did not reach keep
    their line)."""
    budgets = dict(old)
    for path, spent in daily.items():
        counts = (spent.compiles, spent.subprocesses)
        if raise_only and path in old:
            counts = tuple(max(a, b) for a, b in zip(counts, old[path]))
        budgets[path] = counts
    text = table.read_text()
    head = text[:text.index("BUDGETS = {")]
    lines = [f'    "{path}": ({c}, {s}),' for path, (c, s) in sorted(budgets.items())]
    table.write_text(head + "BUDGETS = {\n" + "\n".join(lines) + "\n}\n")


def profile_table(files: dict[str, Counts], top: int | None = None) -> str:
    """The markdown table: one row per file, the most wall time first."""
    rows = sorted(files.items(), key=lambda kv: -kv[1].wall_s)
    total = sum((c for _, c in rows), Counts())
    header = ("| file | tests | wall s | compiles (cache hits) | compile s | trace s | lower s "
              "| rest s | processes |\n|---|---|---|---|---|---|---|---|---|")
    body = [_row(path, spent) for path, spent in rows[:top]]
    return "\n".join([header, *body, _row(f"all {len(rows)} files", total)])


def _row(name: str, c: Counts) -> str:
    rest = c.wall_s - c.compile_s - c.trace_s - c.lower_s
    return (f"| {name} | {c.tests} | {c.wall_s:.1f} | {c.compiles} ({c.cache_hits}) | "
            f"{c.compile_s:.1f} | {c.trace_s:.1f} | {c.lower_s:.1f} | {rest:.1f} | "
            f"{c.subprocesses} |")
