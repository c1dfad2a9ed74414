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


def test_sigterm_is_a_stop_request_then_terminated_and_exits_143():
    from zeroxla.app.interrupt import STOP_SIGNALS, Terminated, exit_status

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with stop_requests(*STOP_SIGNALS) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
        with pytest.raises(Terminated) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
    assert isinstance(raised.value, KeyboardInterrupt)     # cleanups for Ctrl-C run for it too
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
    assert exit_status(signal.SIGTERM) == 143 and exit_status(signal.SIGINT) == 130


def test_terminate_raises_outside_the_loop():
    from zeroxla.app.interrupt import Terminated, terminate_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with terminate_raises():
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
