"""The compile budget (tests/support/suite_profile.py) fails a run whose daily test file makes
more XLA compile requests than its line allows, naming the file, its count and its budget, and
counts what it says: one request per program handed to XLA (a jit called on a new shape), a
process per `subprocess.Popen`, slow tests left out of a file's daily count.

A child pytest runs a small test file with one extra compile planted: a real pytest run with
the plugin, as CI's is; the table's other answers are checked on the function itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import commands
import suite_profile


TEST_FILE = textwrap.dedent('''
    import subprocess, sys
    import jax, numpy as np
    import pytest

    def test_two_programs():
        f = jax.jit(lambda x: x * 2 + 1)
        f(np.ones(3)); f(np.ones(3)); f(np.ones(4))     # two shapes: two compile requests

    def test_one_process():
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    @pytest.mark.slow
    def test_slow_ones_are_not_counted_daily():
        jax.jit(lambda x: x - 1)(np.ones(5))
    {planted}
''')
PLANTED = textwrap.dedent('''
    def test_planted_extra_compile():
        jax.jit(lambda x: x / 3)(np.ones(6))
''')


def _run(tmp_path: Path, budgets: str, planted: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_counted.py").write_text(
        TEST_FILE.format(planted=PLANTED if planted else ""))
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_profile"]\n'
                                          'def pytest_configure(config):\n'
                                          '    config.addinivalue_line("markers", "slow: s")\n')
    table = tmp_path / "budgets.py"
    table.write_text(f"BUDGETS = {{{budgets}}}\n")
    env = {**commands.child_pytest_env(), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-o", "addopts=", f"--compile-budgets={table}", "--rootdir", str(tmp_path),
         str(tmp_path / "test_counted.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_planted_extra_compile_fails_the_run_naming_the_file_its_count_and_budget(tmp_path):
    over = _run(tmp_path, '"test_counted.py": (2, 1)', planted=True)
    assert over.returncode == 1, over.stdout[-3000:]
    # 2 programs + the planted one (the slow test's is not a daily one), 1 process
    assert ("test_counted.py: its daily tests made 3 compile requests and 1 processes; its "
            "budget is 2 and 1") in over.stdout, over.stdout[-3000:]


def test_a_file_within_its_budget_passes_and_one_without_a_line_is_named():
    spent = suite_profile.Counts(compiles=2, subprocesses=1)
    assert suite_profile.check_budgets({"a.py": spent}, {"a.py": (2, 1)}) == []
    assert suite_profile.check_budgets({"a.py": spent}, {"a.py": (1, 1)})
    assert suite_profile.check_budgets({"a.py": spent}, {"a.py": (2, 0)})
    [missing] = suite_profile.check_budgets({"b.py": spent}, {"a.py": (2, 1)})
    assert missing.startswith("b.py: its daily tests made 2 compile requests and 1 processes, "
                              "and the file has no line"), missing
