"""Ctrl-C as a request to stop between steps, so the training loop can save before it exits.

    with stop_requests() as stop:
        for k in range(steps):
            if stop.requested:
                break            # save a checkpoint of step k, then exit
            state, metrics = step(state, batch)

Inside the block the first SIGINT only sets `stop.requested` (a step that is running finishes,
and the loop decides when to look). A second SIGINT raises KeyboardInterrupt as usual, for a
user who does not want to wait for the save. The previous handler is restored when the block
exits, so Ctrl-C outside the loop (data loading, compilation of the evaluation, the final save)
behaves as Python's default. Signal handlers can only be installed from the main thread;
elsewhere the block installs nothing and `stop.requested` stays false.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class StopRequest:
    """Set by the SIGINT handler of `stop_requests`; read by the training loop."""

    def __init__(self) -> None:
        self.requested = False
        self.signals = 0

    def handle(self, signum: int, frame: Any) -> None:
        """The SIGINT handler: first call requests a stop, the second interrupts."""
        del frame
        self.signals += 1
        if self.signals > 1:
            raise KeyboardInterrupt
        self.requested = True


@contextlib.contextmanager
def stop_requests(signum: int = signal.SIGINT) -> Iterator[StopRequest]:
    """Turns `signum` (default SIGINT, Ctrl-C) into `StopRequest.requested` inside the block."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = signal.signal(signum, request.handle)
    try:
        yield request
    finally:
        signal.signal(signum, previous)


__all__ = ["StopRequest", "stop_requests"]
