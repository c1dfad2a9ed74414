"""Every test sees 8 host CPU devices (a 2-node x 4-local mesh is the standard shape), compiled
with the suite's codegen flags, through one compilation cache shared by the run's processes
(tests/support/xla_flags.py says what each changes and what not)."""

import os
import shutil

import xla_flags  # tests/support, on sys.path through pyproject's `pythonpath`

_FUSION_EMITTERS = os.environ.get(xla_flags.FUSION_EMITTERS_ENV) == "1"   # a `fusion_emitters` child
os.environ["XLA_FLAGS"] = (xla_flags.with_codegen_flags(os.environ.get("XLA_FLAGS", ""),
                                                        older_emitters=not _FUSION_EMITTERS) +
                           f" {xla_flags.DEVICE_COUNT_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Set before pytest-xdist starts its workers, so they and every process a test starts share it.
_CREATED_CACHE = xla_flags.use_compilation_cache(os.environ)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402  (must come after the flag)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# JAX read its environment when xla_flags imported it, before the cache was named: say it here.
jax.config.update("jax_compilation_cache_dir", os.environ[xla_flags.CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session):
    """The run's compilation cache goes with the run (the controller's, after its workers)."""
    if _CREATED_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CREATED_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "conftest must run before jax initialises its backend"
    return jax.devices()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):       # before xdist starts its workers
        os.environ[_DIST_ENV] = str(config.getoption("dist", "no"))
    config.addinivalue_line(
        "markers", "fusion_emitters: the check is bit-identity between differently compiled "
        "programs, which holds with XLA:CPU's fusion emitters (what users run) but not with the "
        "older emitters the suite compiles with (tests/support/xla_flags.py): the test runs in "
        "a child pytest with the fusion emitters")


# pytest-xdist's --dist mode, as the controller was given it (a worker's own option says "no")
_DIST_ENV = "ZEROXLA_TEST_DIST"


def _whole_files_here(config) -> bool:
    """Whether this process runs every selected test of a file (no xdist, or xdist's
    `--dist loadfile`), so that one child can run all of a file's `fusion_emitters` tests."""
    return not hasattr(config, "workerinput") or os.environ.get(_DIST_ENV) == "loadfile"


# nodeid -> (outcome, text) of the `fusion_emitters` tests a child pytest has run
_FUSION_RESULTS: dict[str, tuple[str, str]] = {}


def _run_fusion_child(pyfuncitem) -> str:
    """Runs in one child pytest (XLA:CPU's fusion emitters, the run's compilation cache) this
    test and, where this process runs whole files, every other selected `fusion_emitters` test
    of its file not run yet: one process start and one JAX import for them all, and the
    programs they share compiled once. Records each test's outcome in _FUSION_RESULTS; returns
    the child's output, for a test it did not report on."""
    nodeids = [pyfuncitem.nodeid]
    if _whole_files_here(pyfuncitem.config):
        module = pyfuncitem.nodeid.split("::")[0]
        nodeids += [item.nodeid for item in pyfuncitem.session.items
                    if item.nodeid.split("::")[0] == module and item.nodeid not in nodeids
                    and item.nodeid not in _FUSION_RESULTS
                    and item.get_closest_marker("fusion_emitters")]
    env = xla_flags.child_environ()       # the child's conftest drops OLDER_EMITTERS_FLAG
    env[xla_flags.FUSION_EMITTERS_ENV] = "1"
    with tempfile.TemporaryDirectory(prefix="zeroxla-fusion-") as directory:
        report = os.path.join(directory, "outcomes.jsonl")
        env[_FUSION_REPORT_ENV] = report
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
             "--rootdir", str(pyfuncitem.config.rootpath), *nodeids],
            cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True,
            timeout=1200 * len(nodeids))
        if os.path.exists(report):
            with open(report) as lines:
                for line in lines:
                    record = json.loads(line)
                    if record["outcome"] != "passed" or record["nodeid"] not in _FUSION_RESULTS:
                        _FUSION_RESULTS[record["nodeid"]] = (record["outcome"], record["text"])
    return (f"child pytest exit {result.returncode}:\n{result.stdout[-6000:]}"
            f"{result.stderr[-2000:]}")


def pytest_pyfunc_call(pyfuncitem):
    """A `fusion_emitters` test runs in a child pytest (XLA:CPU's fusion emitters, the run's
    compilation cache; `_run_fusion_child`) and passes, fails or is skipped with it there."""
    if _FUSION_EMITTERS or not pyfuncitem.get_closest_marker("fusion_emitters"):
        return None
    output = None
    if pyfuncitem.nodeid not in _FUSION_RESULTS:
        output = _run_fusion_child(pyfuncitem)
    outcome, text = _FUSION_RESULTS.pop(pyfuncitem.nodeid, ("missing", output or ""))
    if outcome == "skipped":
        pytest.skip(f"in the child pytest with XLA:CPU's fusion emitters: {text}")
    if outcome != "passed":
        pytest.fail(f"with XLA:CPU's fusion emitters (child pytest, {outcome}):\n{text}",
                    pytrace=False)
    return True


_FUSION_REPORT_ENV = "ZEROXLA_TEST_FUSION_REPORT"   # where a child writes its tests' outcomes


def pytest_runtest_logreport(report):
    """In a `fusion_emitters` child: each test's outcome (a failed setup, call or teardown
    fails it), one JSON line per phase, for the parent (`_run_fusion_child`)."""
    path = os.environ.get(_FUSION_REPORT_ENV) if _FUSION_EMITTERS else None
    if not path or (report.passed and report.when != "call"):
        return
    outcome = "failed" if report.failed else report.outcome
    text = report.longreprtext[-6000:] if report.failed else (
        str(report.longrepr[-1]) if report.skipped and isinstance(report.longrepr, tuple) else "")
    with open(path, "a") as out:
        out.write(json.dumps({"nodeid": report.nodeid, "outcome": outcome, "text": text}) + "\n")
