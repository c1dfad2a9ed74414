"""Ctrl-C inside `stop_requests`: a flag for the loop, then KeyboardInterrupt, then the old
handler back."""

import os
import signal
import threading

import pytest

from zeroxla.app.interrupt import stop_requests


def test_first_sigint_sets_the_flag_second_interrupts_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGINT)
    with stop_requests() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested                  # no exception: the loop decides when to stop
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_nothing_is_installed():
    seen = []

    def worker():
        with stop_requests() as stop:
            seen.append((stop.requested, signal.getsignal(signal.SIGINT)))

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(False, before)]
