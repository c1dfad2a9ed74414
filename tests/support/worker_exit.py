"""How a pytest-xdist worker process ends: at once, once its session is over.

A worker that has run a few hundred test files holds thousands of compiled XLA programs, and
Python's interpreter finalization frees each of them (and every module's objects) one by one:
about 2.5 s for 800 small programs, 8 s after a dozen model-family files. pytest-xdist's
controller waits at most 10 s (`NodeManager.EXIT_TIMEOUT`) for each worker to exit and then
kills it: a run would end 10 s after its last test. The worker has nothing left to do by
then: its results, its profile and its `workerfinished` message (sent by pytest-xdist's own
`pytest_sessionfinish`, with the execnet pipe written synchronously) are with the controller.
So the worker's last hook flushes its output and leaves with `os._exit`, skipping the
finalization. The controller, and any pytest run without `-n`, ends as usual.
"""

import os
import sys


def exit_now(exit_status: int) -> None:
    """Flushes stdout and stderr and ends this process with `exit_status`, without Python's
    finalization (atexit handlers, module teardown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)
