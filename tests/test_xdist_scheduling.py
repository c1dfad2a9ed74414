"""A worker that dies mid-run under `--dist loadfile` costs the test it died in, not the run
(tests/support/xdist_scheduling.py): a child pytest of nine one-test files, the last of which
aborts its worker once, ends with that test failed and every other test passed, where
pytest-xdist 3.8.0's own scheduling leaves both workers idle until the run is killed."""

import subprocess
import sys

import commands

# The plugin as tests/conftest.py loads it.
_CONFTEST = 'pytest_plugins = ["xdist_scheduling"]\n'

_ABORTS_ONCE = """
import os, pathlib


def test_z():
    marker = pathlib.Path(__file__).with_name("aborted")
    if not marker.exists():
        marker.write_text("")
        os.abort()
"""


def test_a_worker_that_aborts_late_costs_its_test_and_the_run_finishes(tmp_path):
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    for name in "abcdefgh":
        (tmp_path / f"test_{name}.py").write_text(
            f"import time\n\n\ndef test_{name}():\n    time.sleep(0.3)\n")
    (tmp_path / "test_z.py").write_text(_ABORTS_ONCE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
         "-p", "no:benchmark", "-o", "addopts=", "-o", "timeout=0"],
        cwd=tmp_path, env=commands.child_pytest_env(), capture_output=True, text=True,
        timeout=60)
    summary = out.stdout.strip().splitlines()[-1]
    assert "replacing crashed worker" in out.stdout, out.stdout[-3000:]
    # the aborted test is reported failed; pytest-xdist runs it again on the new worker, where
    # it passes: 8 + 1 passed
    assert "1 failed, 9 passed" in summary, out.stdout[-3000:]
    assert out.returncode == 1


def test_the_suite_schedules_its_loadfile_runs_so(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("xdist_scheduling")
