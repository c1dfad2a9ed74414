"""Every test sees 8 host CPU devices (a 2-node x 4-local mesh is the standard shape) and the CPU
client's threads for them, compiled with the suite's codegen flags, from jaxlib 0.12 through one
compilation cache shared by the run's processes (kept between runs with
`ZEROXLA_TEST_JAX_CACHE=keep`; none before 0.12: tests/support/xla_flags.py says why, and what
each setting changes and what not), with the garbage collector's test settings
(tests/support/gc_policy.py); a pytest-xdist worker ends at once when its session is over
(tests/support/worker_exit.py), and a worker that dies costs its test, not the run
(tests/support/xdist_scheduling.py)."""

import os
import shutil

import ci_legs  # tests/support, on sys.path through pyproject's `pythonpath`
import file_order
import fusion_children
import gc_policy
import program_release
import tiers
import worker_exit
import xla_flags
from zeroxla.app.launch import set_host_threads  # no JAX backend starts on import

# Where the time goes per file, and the compile budget of the daily subset (suite_profile.py);
# `--dist loadfile` that survives a dead worker (xdist_scheduling.py).
pytest_plugins = ["suite_profile", "xdist_scheduling"]

_FUSION_EMITTERS = os.environ.get(xla_flags.FUSION_EMITTERS_ENV) == "1"   # a `fusion_emitters` child
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's codegen flags on the CPU only: a GPU plugin's XLA exits on the CPU-only ones it does
# not define ("Unknown flag in XLA_FLAGS: --xla_cpu_use_fusion_emitters=false", jax-cuda13
# 0.11.2), so `JAX_PLATFORMS=cuda pytest tests/pallas_kernels` runs on a GPU machine.
_CODEGEN = (xla_flags.with_codegen_flags(os.environ.get("XLA_FLAGS", ""),
                                         older_emitters=not _FUSION_EMITTERS)
            if os.environ["JAX_PLATFORMS"] == "cpu" else os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_CODEGEN} {xla_flags.DEVICE_COUNT_FLAG}=8".strip()
# and the CPU client's threads for those 8 devices, as `zeroxla train` sets them: without them a
# warm run deadlocked in a collective about once in ten (zeroxla.app.launch.set_host_threads)
set_host_threads(os.environ, 8)
# Set before pytest-xdist starts its workers, so they and every process a test starts share them.
xla_flags.use_trace_settings(os.environ)
_CREATED_CACHE = xla_flags.use_compilation_cache(os.environ)

import jax  # noqa: E402  (must come after the flag)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# JAX read its environment when xla_flags imported it, before the cache was named: say it here
# (none before jaxlib 0.12: xla_flags.PERSISTENT_CACHE_SAFE).
if os.environ.get(xla_flags.CACHE_ENV):
    jax.config.update("jax_compilation_cache_dir", os.environ[xla_flags.CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_traceback_in_locations_limit",
                  int(os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"]))
gc_policy.use_test_thresholds()


def pytest_collection_finish(session):
    """What collection imported lives as long as the process: out of the collector's walks."""
    gc_policy.freeze_imported()


def pytest_sessionfinish(session):
    """The run's compilation cache goes with the run (the controller's, after its workers),
    unless it is a kept one."""
    if _CREATED_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_CREATED_CACHE, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker, everything reported, ends at once instead of freeing its thousands
    of compiled programs one by one (tests/support/worker_exit.py says why)."""
    if hasattr(config, "workerinput"):
        worker_exit.exit_now(int(config.workeroutput.get("exitstatus", 0)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test file (its module fixtures finalized), drop the compiled programs when
    the process holds many memory maps (tests/support/program_release.py says why and when);
    after every file in a run that writes the compile budgets, so that each file's count is
    what it compiles alone. Not after the process's last test (`nextitem` None): the process
    ends there, and dropping thousands of programs first only delays the run's end."""
    yield
    if nextitem is None or nextitem.path == item.path:
        return
    writing = item.config.getoption("write_compile_budgets", default=None)
    program_release.release_if_crowded(0 if writing else program_release.MAX_MAPS)


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "conftest must run before jax initialises its backend"
    return jax.devices()


def pytest_collection_modifyitems(config, items):
    """The tests of the second CI leg's files carry its marker (tests/support/ci_legs.py), the
    unit files' tests theirs (tests/support/tiers.py); the files go longest first
    (tests/support/file_order.py)."""
    file_order.order_items(items, config.rootpath, file_order.file_seconds(
        file_order.load_table(), file_order.tier_of(config.getoption("markexpr"))))
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        if path in tiers.UNIT_FILES:
            item.add_marker(tiers.MARKER)
        if (path in ci_legs.SECOND_LEG_FILES
                and f"{path}::{item.name}" not in ci_legs.LEFT_TO_LEG_1):
            item.add_marker(ci_legs.MARKER)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):    # pytest-xdist's by-test-count order:
        config.option.loadscopereorder = False        # file_order.py's replaces it
    if os.environ.get(fusion_children.OUTCOMES_ENV):  # a `fusion_emitters` child: its record
        config.pluginmanager.register(
            fusion_children.Recorder(os.environ[fusion_children.OUTCOMES_ENV]))
    config.addinivalue_line(
        "markers", f"{tiers.MARKER}: a unit test, which builds no program of the library and runs "
        "in seconds (tests/support/tiers.py); every other test is an integration run")
    config.addinivalue_line(
        "markers", f"{ci_legs.MARKER}: run by the second CI leg (Python 3.12, the newest JAX) "
        "whether slow or not (tests/support/ci_legs.py)")
    config.addinivalue_line(
        "markers", "fusion_emitters: the check is bit-identity between differently compiled "
        "programs, which holds with XLA:CPU's fusion emitters (what users run) but not with the "
        "older emitters the suite compiles with (tests/support/xla_flags.py): the test runs in "
        "a child pytest with the fusion emitters")


def pytest_pyfunc_call(pyfuncitem):
    """A `fusion_emitters` test passes, fails or skips as it did in its file's child pytest
    (XLA:CPU's fusion emitters, the run's compilation cache; one child per file:
    tests/support/fusion_children.py)."""
    if (_FUSION_EMITTERS or not xla_flags.HAS_OLDER_EMITTERS
            or not pyfuncitem.get_closest_marker(fusion_children.MARKER)):
        return None
    env = xla_flags.child_environ()       # the child's conftest drops OLDER_EMITTERS_FLAG
    env[xla_flags.FUSION_EMITTERS_ENV] = "1"
    result = fusion_children.outcome_of(pyfuncitem, env)
    if result.outcome == "skipped":
        pytest.skip(f"with XLA:CPU's fusion emitters (child pytest): {result.text}")
    if result.outcome != "passed":
        pytest.fail(f"with XLA:CPU's fusion emitters (child pytest):\n{result.text}",
                    pytrace=False)
    return True
