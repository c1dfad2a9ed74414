"""`fusion_emitters` tests run in one child pytest per file (tests/support/fusion_children.py):
each passes, fails or skips as it did there, a test the child did not finish fails naming the
child's exit status, and the file's tests after it start a new child.

A pytest run of a small test file, whose conftest hands the marked tests to the children as
tests/conftest.py does, checked against what each test did: the process each ran in (written
by the test itself) and the outcomes pytest reports.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import commands

CONFTEST = textwrap.dedent('''
    import os
    import fusion_children, pytest

    IN_CHILD = os.environ.get("IN_CHILD") == "1"

    def pytest_configure(config):
        config.addinivalue_line("markers", "fusion_emitters: in a child")
        if os.environ.get(fusion_children.OUTCOMES_ENV):
            config.pluginmanager.register(
                fusion_children.Recorder(os.environ[fusion_children.OUTCOMES_ENV]))

    def pytest_pyfunc_call(pyfuncitem):
        if IN_CHILD or not pyfuncitem.get_closest_marker("fusion_emitters"):
            return None
        result = fusion_children.outcome_of(pyfuncitem, {**os.environ, "IN_CHILD": "1"})
        if result.outcome == "skipped":
            pytest.skip(result.text)
        if result.outcome != "passed":
            pytest.fail(result.text, pytrace=False)
        return True
''')

TESTS = textwrap.dedent('''
    import os
    import pytest

    def _ran(name):
        with open("ran.txt", "a") as f:
            f.write(f"{name} {os.getpid()}\\n")

    @pytest.mark.fusion_emitters
    def test_a_passes():
        _ran("a")

    @pytest.mark.fusion_emitters
    def test_b_crashes():
        _ran("b")
        os._exit(3)

    @pytest.mark.fusion_emitters
    def test_c_passes():
        _ran("c")

    @pytest.mark.fusion_emitters
    def test_d_fails():
        _ran("d")
        assert 1 == 2, "d's own message"

    @pytest.mark.fusion_emitters
    def test_e_skips():
        _ran("e")
        pytest.skip("e's own reason")

    def test_plain_runs_here():
        _ran("plain")
''')


def test_one_child_per_file_and_each_test_its_own_outcome(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_marked.py").write_text(TESTS)
    env = commands.child_pytest_env()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-p",
         "no:xdist", "-o", "addopts=", "--rootdir", str(tmp_path), "test_marked.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    for name, outcome in (("a_passes", "PASSED"), ("b_crashes", "FAILED"),
                          ("c_passes", "PASSED"), ("d_fails", "FAILED"),
                          ("e_skips", "SKIPPED"), ("plain_runs_here", "PASSED")):
        assert f"test_marked.py::test_{name} {outcome}" in out, out[-4000:]
    assert "the child pytest exited 3 before finishing this test" in out
    assert "d's own message" in out and "e's own reason" in out
    pids = dict(line.split() for line in (tmp_path / "ran.txt").read_text().splitlines())
    # a and b in the first child; c, d and e (after b's crash) in a second one; plain here.
    assert pids["a"] == pids["b"] and pids["c"] == pids["d"] == pids["e"]
    assert len({pids["a"], pids["c"], pids["plain"]}) == 3
