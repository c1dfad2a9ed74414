"""Running `zeroxla` as a user does, in a subprocess: the command line and a clean environment;
and the environment of a pytest that a test runs on a folder of its own."""

import os
import shutil
import sys
from pathlib import Path

import xla_flags
from zeroxla.app import distributed


def zeroxla_command(*args):
    """`zeroxla ARGS` (the console script when installed, else `python -m zeroxla`)."""
    exe = shutil.which("zeroxla")
    return [exe, *args] if exe else [sys.executable, "-m", "zeroxla", *args]


def cpu_env():
    """The suite's environment with no device count and no rank variables: `zeroxla launch`
    sets both per rank."""
    return {k: v for k, v in xla_flags.child_environ().items() if k not in distributed.ENV_VARS}


def child_pytest_env():
    """The suite's environment for a pytest run inside a test on files it wrote: tests/support
    importable (the child's conftest names its plugins), and none of the outer run's options in
    PYTEST_ADDOPTS (the child lacks their plugins, and `--write-file-seconds` would rewrite the
    checked-in table with the child's files)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent),
                                         os.environ.get("PYTHONPATH", "")])
    return env
