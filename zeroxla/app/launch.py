"""`zeroxla launch`: N local processes of one command, joined by JAX's distributed runtime.

    zeroxla launch --nproc 2 --devices-per-proc 4 -- zeroxla train --mesh 2x4

Process i gets the environment of `zeroxla.app.distributed` (ZEROXLA_COORDINATOR=127.0.0.1:<a
free port>, ZEROXLA_NUM_PROCESSES=N, ZEROXLA_PROCESS_ID=i), PYTHONUNBUFFERED=1, and, with
`--devices-per-proc M`, `--xla_force_host_platform_device_count=M` in XLA_FLAGS (M simulated CPU
devices per process) and the CPU client's threads for them (`set_host_threads`). Every line a
process writes is copied to the same stream here, prefixed with `[rank i]`.

Supervision, torchrun's rule: the job lives while every process does. When one exits non-zero or
is killed by a signal, the others are stopped (SIGTERM to each process group, SIGKILL after
`grace_s`), a line names the rank that died, and `launch` returns non-zero; a process blocked in
a collective with a dead peer would otherwise wait for JAX's heartbeat timeout. Ctrl-C is
forwarded as SIGINT to every process (`zeroxla train` saves a checkpoint and exits) and `launch`
waits for them; a second Ctrl-C stops them at once. SIGTERM to `launch` stops them too.

This module does not import JAX.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import BinaryIO

from zeroxla.app.distributed import DistributedEnv
from zeroxla.app.interrupt import stop_requests

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The size of the XLA:CPU client's thread pools (jaxlib reads it when the CPU backend starts; its
# default is the core count, raised to the device count). Each simulated device's program runs on
# them, and a collective holds its thread until every participant arrives. XLA assumes one
# collective per device at a time, so that as many threads as devices suffice; XLA:CPU may also
# run collectives that do not depend on each other at once (a program that jaxlib 0.10 read back
# from JAX's persistent compilation cache was seen in an all-reduce before a layer loop and in
# the loop's all-gather at once: tests/support/xla_flags.py, PERSISTENT_CACHE_SAFE). With 8
# devices on 2 cores, the threads two such devices hold leave another device none: every device
# then waits in a collective until XLA's rendezvous timeout aborts the process (docs/testing.md,
# "XLA flags and the compilation cache"). Threads beyond the cores cost only their stacks.
HOST_THREADS_ENV = "PJRT_NPROC"
HOST_THREADS_PER_DEVICE = 4
DEFAULT_GRACE_S = 10.0
INTERRUPTED = 130                   # the shell's status for a SIGINT exit
_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice), for the coordinator."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_device_count(xla_flags: str, count: int) -> str:
    """`xla_flags` with the host device count set to `count` (replacing any count there)."""
    kept = [flag for flag in xla_flags.split() if not flag.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={count}"])


def set_host_threads(environ: MutableMapping[str, str], device_count: int) -> None:
    """Sets HOST_THREADS_ENV to HOST_THREADS_PER_DEVICE threads per simulated device (at least the
    core count) unless it is set: a collective blocked on one device cannot then starve another
    device of the thread its part of the collective needs (above). Must run before JAX creates
    its CPU backend; the variable only sizes the CPU client, so it is harmless on GPU/TPU."""
    if HOST_THREADS_ENV not in environ:
        threads = max(os.cpu_count() or 1, HOST_THREADS_PER_DEVICE * device_count)
        environ[HOST_THREADS_ENV] = str(threads)


def rank_environ(base: Mapping[str, str], rank: int, nproc: int, coordinator: str,
                 devices_per_proc: int | None) -> dict[str, str]:
    """The environment of process `rank` of `nproc`: `base` plus the distributed variables."""
    env = dict(base)
    env.update(DistributedEnv(coordinator=coordinator, num_processes=nproc,
                              process_id=rank).to_environ())
    env["PYTHONUNBUFFERED"] = "1"            # lines arrive as they are written, not at exit
    if devices_per_proc is not None:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices_per_proc)
        set_host_threads(env, devices_per_proc)
    return env


def split_lines(buffer: bytes) -> tuple[list[bytes], bytes]:
    """(complete lines, rest): each line ends with b"\\n" or b"\\r" (progress bars redraw with
    a carriage return), the rest is an unfinished line."""
    lines, start = [], 0
    for i, byte in enumerate(buffer):
        if byte in b"\r\n":
            lines.append(buffer[start:i + 1])
            start = i + 1
    return lines, buffer[start:]


def describe_exit(rank: int, returncode: int) -> str:
    """'rank 1 exited with status 3' or 'rank 1 was killed by signal SIGKILL'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"rank {rank} was killed by signal {name}"
    return f"rank {rank} exited with status {returncode}"


def _copy_prefixed(source: BinaryIO, sink: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copies `source` to `sink` line by line with `prefix` before each line, until EOF."""
    rest = b""
    fd = source.fileno()
    while chunk := os.read(fd, 65536):
        lines, rest = split_lines(rest + chunk)
        if lines:
            with lock:
                sink.write(b"".join(prefix + line for line in lines))
                sink.flush()
    if rest:
        with lock:
            sink.write(prefix + rest + b"\n")
            sink.flush()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to the process group of `proc` (it and anything it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every live process group, SIGKILL to those still alive after `grace_s`."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


@contextlib.contextmanager
def _started(command: Sequence[str], nproc: int, devices_per_proc: int | None,
             environ: Mapping[str, str], stdout: BinaryIO, stderr: BinaryIO,
             grace_s: float) -> Iterator[list[subprocess.Popen]]:
    """The `nproc` processes, their output copied with prefixes; all stopped on the way out."""
    coordinator = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    copiers: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            # A session of its own: a terminal's Ctrl-C reaches only `launch`, which forwards it,
            # and a signal to the group also reaches what the command started.
            proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=rank_environ(environ, rank, nproc, coordinator,
                                                     devices_per_proc),
                                    start_new_session=True)
            procs.append(proc)
            prefix = f"[rank {rank}] ".encode()
            for source, sink in ((proc.stdout, stdout), (proc.stderr, stderr)):
                thread = threading.Thread(target=_copy_prefixed, args=(source, sink, prefix, lock),
                                          daemon=True)
                thread.start()
                copiers.append(thread)
        yield procs
    finally:
        stop_all(procs, grace_s)
        for thread in copiers:
            thread.join(timeout=5)
        for proc in procs:
            for stream in (proc.stdout, proc.stderr):
                stream.close()


def launch(command: Sequence[str], nproc: int, *, devices_per_proc: int | None = None,
           grace_s: float = DEFAULT_GRACE_S, environ: Mapping[str, str] | None = None,
           stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> int:
    """Runs `nproc` copies of `command` as one distributed job; returns the exit status.

    0 when every process exits 0; the status of the first process that failed otherwise (128 +
    the signal number for a signal); 130 after a Ctrl-C. Messages go to `stderr`.
    """
    if not command:
        raise ValueError("launch: no command; accepted: zeroxla launch --nproc N -- COMMAND ...")
    if nproc < 1:
        raise ValueError(f"--nproc {nproc} is invalid; accepted: an integer >= 1")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"--devices-per-proc {devices_per_proc} is invalid; accepted: an "
                         "integer >= 1")
    environ = os.environ if environ is None else environ
    stdout = sys.stdout.buffer if stdout is None else stdout
    stderr = sys.stderr.buffer if stderr is None else stderr

    def say(line: str) -> None:
        stderr.write(f"zeroxla launch: {line}\n".encode())
        stderr.flush()

    start = time.monotonic()
    with stop_requests(signal.SIGINT) as ctrl_c, stop_requests(signal.SIGTERM) as term, \
            _started(command, nproc, devices_per_proc, environ, stdout, stderr,
                     grace_s) as procs:
        forwarded = False
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if term.requested:
                say(f"SIGTERM: stopping all {nproc} ranks")
                stop_all(procs, grace_s)
                return 128 + signal.SIGTERM
            if ctrl_c.requested and not forwarded:
                say(f"Ctrl-C: forwarding SIGINT to all {nproc} ranks and waiting for them to "
                    "exit (Ctrl-C again to stop them now)")
                for proc in procs:
                    _signal_group(proc, signal.SIGINT)
                forwarded = True
            expected = (0, INTERRUPTED, -signal.SIGINT) if forwarded else (0,)
            dead = [(rank, c) for rank, c in enumerate(codes) if c is not None
                    and c not in expected]
            if dead:
                rank, code = dead[0]
                alive = [str(r) for r, c in enumerate(codes) if c is None]
                say(f"{describe_exit(rank, code)} after {time.monotonic() - start:.1f} s; "
                    f"stopping rank{'s' if len(alive) > 1 else ''} {', '.join(alive)} (SIGTERM, "
                    f"then SIGKILL after {grace_s:g} s)")
                stop_all(procs, grace_s)
                return code if code > 0 else 128 - code
            time.sleep(_POLL_S)
    if forwarded:
        return INTERRUPTED
    failed = [(rank, c) for rank, c in enumerate(codes) if c != 0]
    if failed:
        rank, code = failed[0]
        say(describe_exit(rank, code))
        return code if code > 0 else 128 - code
    return 0


__all__ = ["DEFAULT_GRACE_S", "DEVICE_COUNT_FLAG", "HOST_THREADS_ENV", "HOST_THREADS_PER_DEVICE",
           "describe_exit", "free_port", "launch", "rank_environ", "set_host_threads",
           "split_lines", "stop_all", "with_device_count"]
