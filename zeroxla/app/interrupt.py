"""Stop signals as requests to stop between steps, so a job can save before it exits.

    with stop_requests(*STOP_SIGNALS) as stop:
        for k in range(steps):
            if stop.requested:
                break            # save a checkpoint of step k, then exit 128 + stop.signum
            state, metrics = step(state, batch)

Inside the block the first SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send before
they kill a job at its time limit or on preemption) only sets `stop.requested`: a step that is
running finishes, and the job decides when to look. A second signal raises at once
(`KeyboardInterrupt` for SIGINT, `Terminated` for SIGTERM), for a user who does not want to wait
for the save. The previous handlers are restored when the block exits. Signal handlers can only
be installed from the main thread; elsewhere the block installs nothing and `stop.requested`
stays false.

Outside such a block, `terminate_raises()` makes SIGTERM raise `Terminated` (Python's default is
to die at once), so a command's cleanups (`finally`, `rundir.removed_unless_saved`) run for it as
they do for Ctrl-C, and the command exits with the shell's status for the signal.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an exception. A KeyboardInterrupt, so every cleanup written for Ctrl-C
    runs for it too."""

    signum = signal.SIGTERM

    def __init__(self) -> None:
        super().__init__("terminated (SIGTERM)")


def raised_for(signum: int) -> KeyboardInterrupt:
    """The exception a stop signal raises: KeyboardInterrupt (SIGINT) or Terminated."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def exit_status(signum: int) -> int:
    """The shell's exit status for a process stopped by `signum`: 128 + signum (130 for SIGINT,
    143 for SIGTERM)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """'Ctrl-C' for SIGINT, else the signal's name ('SIGTERM')."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopRequest:
    """Set by the handler of `stop_requests`; read by the job."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None      # the first signal's number
        self.signals = 0

    def handle(self, signum: int, frame: Any) -> None:
        """The handler: the first signal requests a stop, the second raises."""
        del frame
        self.signals += 1
        if self.signals > 1:
            raise raised_for(signum)
        self.requested, self.signum = True, signum


@contextlib.contextmanager
def stop_requests(*signums: int) -> Iterator[StopRequest]:
    """Turns `signums` (default SIGINT alone) into `StopRequest.requested` inside the block."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request.handle) for s in (signums or (signal.SIGINT,))}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        del signum, frame
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["STOP_SIGNALS", "StopRequest", "Terminated", "exit_status", "raised_for",
           "signal_name", "stop_requests", "terminate_raises"]
