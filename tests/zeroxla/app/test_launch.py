"""`zeroxla launch` and the multi-process environment: the env contract, output prefixes,
failure handling, and a real 2-process `zeroxla train` against the 1-process run."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import xla_flags
from commands import cpu_env, zeroxla_command

from zeroxla.app import cli_args, distributed, launch
from zeroxla.app.run import rundir


zeroxla = zeroxla_command


# ---- the environment contract --------------------------------------------------------------------

def test_rank_environ_round_trips_through_from_environ():
    env = launch.rank_environ({"XLA_FLAGS": "--xla_dump_to=/x "
                               "--xla_force_host_platform_device_count=8", "KEEP": "1"},
                              rank=1, nproc=2, coordinator="127.0.0.1:1234", devices_per_proc=4)
    assert env["KEEP"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/x --xla_force_host_platform_device_count=4"
    assert distributed.from_environ(env) == distributed.DistributedEnv(
        coordinator="127.0.0.1:1234", num_processes=2, process_id=1)
    assert "XLA_FLAGS" not in launch.rank_environ({}, 0, 1, "h:1", None)
    assert distributed.from_environ({}) is None
    assert distributed.from_environ({"ZEROXLA_DISTRIBUTED": "auto"}).auto


def test_simulated_devices_get_four_client_threads_each_unless_set():
    """XLA:CPU (jaxlib 0.10) can run two collectives of one device at once, each holding a thread
    of the CPU client's pools until its peers arrive; with its default max(cores, devices)
    threads, 8 devices on 2 cores deadlocked (`launch.set_host_threads`). The environments the CLI
    builds carry 4 threads per device (at least the core count), and never override a user's."""
    cores = os.cpu_count()
    env = launch.rank_environ({}, rank=0, nproc=2, coordinator="h:1", devices_per_proc=4)
    assert env[launch.HOST_THREADS_ENV] == str(max(cores, 16))
    assert launch.HOST_THREADS_ENV not in launch.rank_environ({}, 0, 1, "h:1", None)
    mine = {launch.HOST_THREADS_ENV: "3"}
    assert launch.rank_environ(mine, 0, 2, "h:1", 4)[launch.HOST_THREADS_ENV] == "3"
    env = {}
    assert cli_args.set_host_device_count(8, env)
    assert env[launch.HOST_THREADS_ENV] == str(max(cores, 32))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}   # the user's count...
    assert not cli_args.set_host_device_count(8, env)
    assert env[launch.HOST_THREADS_ENV] == str(max(cores, 8))          # ...and threads for it


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
def test_this_process_cpu_client_holds_four_threads_per_device():
    """The variable reaches jaxlib: the XLA:CPU client of this test process (conftest sets the
    variable as `zeroxla train` does) runs its programs on 4 threads per device, not 1."""
    import jax

    jax.devices()                                    # the backend exists
    names = [open(f"/proc/self/task/{tid}/comm").read().strip()
             for tid in os.listdir("/proc/self/task")]
    assert names.count("tf_XLAEigen") >= launch.HOST_THREADS_PER_DEVICE * jax.device_count()


@pytest.mark.parametrize("environ,message", [
    ({"ZEROXLA_NUM_PROCESSES": "2"}, "ZEROXLA_COORDINATOR, ZEROXLA_PROCESS_ID not"),
    ({"ZEROXLA_COORDINATOR": "localhost", "ZEROXLA_NUM_PROCESSES": "2",
      "ZEROXLA_PROCESS_ID": "0"},
     "ZEROXLA_COORDINATOR='localhost' is invalid; accepted: HOST:PORT"),
    ({"ZEROXLA_COORDINATOR": "h:1", "ZEROXLA_NUM_PROCESSES": "2", "ZEROXLA_PROCESS_ID": "2"},
     r"ZEROXLA_PROCESS_ID='2' is invalid; accepted: an integer in \[0, 1\]"),
    ({"ZEROXLA_DISTRIBUTED": "slurm"}, "ZEROXLA_DISTRIBUTED='slurm' is invalid; accepted: auto"),
    ({"ZEROXLA_DISTRIBUTED": "auto", "ZEROXLA_PROCESS_ID": "0"}, "are both set"),
])
def test_bad_environment_names_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        distributed.from_environ(environ)


def test_mesh_devices_put_each_process_in_consecutive_rows():
    from collections import namedtuple

    Device = namedtuple("Device", "process_index id")
    devices = [Device(1, 5), Device(0, 1), Device(1, 4), Device(0, 0)]
    assert distributed.mesh_devices(devices, 4) == [Device(0, 0), Device(0, 1), Device(1, 4),
                                                    Device(1, 5)]
    with pytest.raises(ValueError, match="accepted: a --mesh NODESxLOCAL with NODES x LOCAL = 4, "
                                         "e.g. 2x2"):
        distributed.mesh_devices(devices, 2)        # every process must take part
    one_host = [Device(0, i) for i in range(8)]
    assert distributed.mesh_devices(one_host, 4) == one_host[:4]
    with pytest.raises(ValueError, match="only 8 are available"):
        distributed.mesh_devices(one_host, 16)


def test_job_mesh_takes_the_first_devices_and_refuses_more_than_there_are():
    import jax

    assert len(jax.devices()) == 8
    mesh = distributed.job_mesh((3, 1))
    assert mesh.devices.shape == (3, 1) and list(mesh.devices.flat) == jax.devices()[:3]
    assert distributed.job_mesh((2, 2), stages=2).devices.shape == (2, 2, 2)
    with pytest.raises(ValueError, match="--mesh has 16 devices but only 8 are available; "
                                         "accepted: a --mesh NODESxLOCAL with NODES x LOCAL <= 8"):
        distributed.job_mesh((4, 4))


def test_lines_split_on_newline_and_carriage_return():
    assert launch.split_lines(b"a\nb\rprogress") == ([b"a\n", b"b\r"], b"progress")
    assert launch.split_lines(b"") == ([], b"")


def test_exit_descriptions():
    assert launch.describe_exit(1, 3) == "rank 1 exited with status 3"
    assert launch.describe_exit(0, -9) == "rank 0 was killed by signal SIGKILL"


# ---- the launcher --------------------------------------------------------------------------------

CHILD = """
import os, sys, time
rank = int(os.environ["ZEROXLA_PROCESS_ID"])
print(f"hello {rank} of {os.environ['ZEROXLA_NUM_PROCESSES']}", flush=True)
print(f"flags {os.environ.get('XLA_FLAGS')}", file=sys.stderr, flush=True)
if rank == 0:
    open("rank0.printed", "w").close()     # rank 1 dies only once rank 0 has spoken
if rank == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists("rank0.printed") and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(300)
"""


def test_a_dead_rank_stops_the_others_and_launch_exits_naming_it(tmp_path):
    start = time.perf_counter()
    result = subprocess.run(zeroxla("launch", "--nproc", "2", "--devices-per-proc", "3", "--",
                                    sys.executable, "-c", CHILD),
                            cwd=tmp_path, env=cpu_env(), capture_output=True, text=True,
                            timeout=120)
    elapsed = time.perf_counter() - start
    print(f"launch exited {elapsed:.1f} s after start")
    assert result.returncode == 3
    assert "zeroxla launch: rank 1 exited with status 3" in result.stderr
    assert "stopping rank 0" in result.stderr
    assert elapsed < 60
    assert "[rank 0] hello 0 of 2" in result.stdout and "[rank 1] hello 1 of 2" in result.stdout
    assert (f"[rank 1] flags {xla_flags.CODEGEN_FLAGS} --xla_force_host_platform_device_count=3"
            in result.stderr)


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    child = "import os, signal, time\nif os.environ['ZEROXLA_PROCESS_ID'] == '0':\n" \
            "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(300)\n"
    result = subprocess.run(zeroxla("launch", "--nproc", "2", "--grace-period", "1", "--",
                                    sys.executable, "-c", child),
                            cwd=tmp_path, env=cpu_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 128 + 9
    assert "rank 0 was killed by signal SIGKILL" in result.stderr


def test_launch_without_a_command_is_an_error(capsys):
    from zeroxla.app import cli

    assert cli.main(["launch", "--nproc", "2", "--"]) == 2
    assert "no COMMAND given" in capsys.readouterr().err


# ---- zeroxla train on 2 processes ----------------------------------------------------------------

TRAIN = ["train", "--steps", "5", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1",
         "--sample-tokens", "5", "--no-progress", "--save-every", "2", "--keep-last", "1"]


@pytest.mark.slow
def test_two_processes_of_zeroxla_train_match_one(tmp_path):
    """`zeroxla launch --nproc 2 --devices-per-proc 4 -- zeroxla train` on the 2 x 4 mesh (one
    node per process) logs the same losses as one process with 8 devices."""
    from zeroxla.app import cli

    multi = tmp_path / "multi"
    result = subprocess.run(zeroxla("launch", "--nproc", "2", "--devices-per-proc", "4", "--",
                                    *zeroxla(*TRAIN, "--out", str(multi))),
                            cwd=tmp_path, env=cpu_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 0] zeroxla train: run directory" in result.stdout
    assert "2x4 mesh of cpu devices in 2 processes" in result.stdout
    assert "[rank 1] zeroxla train:" not in result.stdout         # only rank 0 reports

    single = tmp_path / "single"
    assert cli.main([*TRAIN, "--out", str(single)]) == 0            # this process: 8 devices
    losses = {}
    for name, run_dir in (("multi", multi), ("single", single)):
        records = rundir.read_metrics(run_dir / rundir.METRICS_FILE)
        losses[name] = np.array([r["loss"] for r in records if "loss" in r])
    diff = np.max(np.abs(losses["multi"] - losses["single"]) / np.abs(losses["single"]))
    print(f"2 processes x 4 vs 1 x 8: max relative loss difference {diff:.2e}")
    assert len(losses["multi"]) == 5
    np.testing.assert_allclose(losses["multi"], losses["single"], rtol=1e-5)
    # Rank 0 wrote the reports; the checkpoints were written by both, collectively.
    summary = json.loads((multi / rundir.SUMMARY_FILE).read_text())
    assert summary["settings"]["processes"] == 2 and summary["samples"]
    assert sorted(os.listdir(multi / "checkpoint")) == ["5"]
