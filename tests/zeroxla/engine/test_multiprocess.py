"""A real multi-process run (2 processes x 4 CPU devices, gloo) trains like one process x 8."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from multiprocess_worker import train, train_moe_ep

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(out, *mode):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), "2", str(port), str(out),
                               *mode],
                              cwd=WORKER.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    try:
        stderrs = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:                                        # a timeout or error: leave no process behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, stderr in zip(procs, stderrs):
        assert proc.returncode == 0, stderr[-3000:]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    out = tmp_path / "losses.json"
    _run_two(out)
    result = json.loads(out.read_text())
    assert (result["local_devices"], result["global_devices"]) == (4, 8)
    assert result["rows"] == [2, 2, 2, 2]           # each process built only its devices' rows
    expected, _ = train(jax.devices())              # this process: 8 devices, one controller
    print(f"2 processes x 4: {result['losses']}, 1 process x 8: {expected}")
    np.testing.assert_allclose(result["losses"], expected, rtol=1e-6)


@pytest.mark.slow
def test_expert_parallel_over_two_processes_with_adversarial_routing(tmp_path):
    """EP = 8 across both processes, every token routed to device 0's experts (seven devices'
    experts idle): each process compiles its own program, and the two run the same collective
    sequence (kinds, groups, bytes, trip counts compared), finish (no hang) and train as one
    process x 8 devices does."""
    out = tmp_path / "moe.json"
    _run_two(out, "moe-ep")
    results = [json.loads((tmp_path / f"moe.json.{i}").read_text()) for i in range(2)]
    assert results[0]["collectives"] == results[1]["collectives"]
    assert results[0]["collectives"]
    expected, found = train_moe_ep(jax.devices())
    assert [list(c) for c in found] == results[0]["collectives"]
    for result in results:
        np.testing.assert_allclose(result["losses"], expected, rtol=1e-6)
