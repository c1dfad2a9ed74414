"""Running `zeroxla` as a user does, in a subprocess: the command line and a clean environment."""

import shutil
import sys

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
