"""Multi-process runs: the environment contract between `zeroxla launch` (or a cluster) and a job.

A process learns that it is one of N from its environment, read *before* JAX starts:

    ZEROXLA_COORDINATOR     host:port of process 0's coordination service, e.g. 127.0.0.1:43211
    ZEROXLA_NUM_PROCESSES   N, the number of processes
    ZEROXLA_PROCESS_ID      this process's rank, 0 <= i < N
    ZEROXLA_DISTRIBUTED     "auto": let `jax.distributed.initialize()` detect the cluster itself
                            (SLURM, Open MPI, Kubernetes, TPU pods); the three above stay unset

`zeroxla launch` sets the first three (and XLA_FLAGS for the CPU device count); a SLURM script
sets ZEROXLA_DISTRIBUTED=auto. `initialize(env)` then starts JAX's distributed runtime before any
other JAX use (XLA fixes the process topology when the first backend starts), with gloo as the
CPU collectives (XLA:CPU has no cross-process collectives without it). `job_mesh` builds a job's
`--mesh` (and `--sequence-parallel-size`) on the devices of all processes (`mesh_devices`: ordered
by process, refused by name when there are too few), for `zeroxla train`, `dpo`, `grpo`, `reward`
and `ppo` alike.

This module imports JAX only inside the functions that need it: `zeroxla launch` and the option
checks of `zeroxla train` run without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

COORDINATOR_ENV = "ZEROXLA_COORDINATOR"
NUM_PROCESSES_ENV = "ZEROXLA_NUM_PROCESSES"
PROCESS_ID_ENV = "ZEROXLA_PROCESS_ID"
AUTO_ENV = "ZEROXLA_DISTRIBUTED"
ENV_VARS = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, AUTO_ENV)
CPU_COLLECTIVES = "gloo"
SEQUENCE_OPTION = "--sequence-parallel-size"
EXPERT_OPTION = "--expert-parallel-size"


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    """How this process joins a multi-process run.

    `auto`: `jax.distributed.initialize()` detects the cluster (the other fields are None).
    Otherwise all three of `coordinator`, `num_processes`, `process_id` are set.
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    def to_environ(self) -> dict[str, str]:
        """The environment variables that describe this process (inverse of `from_environ`)."""
        if self.auto:
            return {AUTO_ENV: "auto"}
        return {COORDINATOR_ENV: str(self.coordinator),
                NUM_PROCESSES_ENV: str(self.num_processes),
                PROCESS_ID_ENV: str(self.process_id)}


def _int_var(environ: Mapping[str, str], name: str, low: int, high: int | None) -> int:
    text = environ[name]
    accepted = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid; accepted: {accepted}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={text!r} is invalid; accepted: {accepted}")
    return value


def from_environ(environ: Mapping[str, str]) -> DistributedEnv | None:
    """The multi-process settings in `environ`, or None for a single-process run.

    Raises ValueError naming the variable when the settings are incomplete or out of range.
    """
    given = [name for name in (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
             if environ.get(name)]
    auto = environ.get(AUTO_ENV, "")
    if auto:
        if auto != "auto":
            raise ValueError(f"{AUTO_ENV}={auto!r} is invalid; accepted: auto (or leave it unset)")
        if given:
            raise ValueError(f"{AUTO_ENV}=auto and {', '.join(given)} are both set; accepted: "
                             f"either {AUTO_ENV}=auto or all of {COORDINATOR_ENV}, "
                             f"{NUM_PROCESSES_ENV}, {PROCESS_ID_ENV}")
        return DistributedEnv(auto=True)
    if not given:
        return None
    missing = [name for name in (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
               if name not in given]
    if missing:
        raise ValueError(f"{', '.join(given)} set but {', '.join(missing)} not; a multi-process "
                         f"run needs all of {COORDINATOR_ENV}, {NUM_PROCESSES_ENV}, "
                         f"{PROCESS_ID_ENV} (`zeroxla launch` sets them)")
    coordinator = environ[COORDINATOR_ENV]
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR_ENV}={coordinator!r} is invalid; accepted: HOST:PORT, "
                         "e.g. 127.0.0.1:12345")
    num = _int_var(environ, NUM_PROCESSES_ENV, 1, None)
    rank = _int_var(environ, PROCESS_ID_ENV, 0, num - 1)
    return DistributedEnv(coordinator=coordinator, num_processes=num, process_id=rank)


def initialize(env: DistributedEnv) -> None:
    """Starts JAX's distributed runtime as `env` says. Call it before any other JAX use."""
    import jax

    # Only the CPU backend reads this; GPUs and TPUs bring their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    if env.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=env.coordinator,
                                   num_processes=env.num_processes, process_id=env.process_id)


def mesh_devices(devices: Sequence[Any], count: int) -> list[Any]:
    """The `count` devices a `(node, local)` mesh is built from, ordered by (process, id).

    In that order `make_mesh(nodes, local)` puts each process's devices in consecutive rows, so
    with one process per host the mesh's `node` axis is the host axis (ZeRO++'s hpZ and qgZ keep
    the `local` traffic inside a host). A single process may have more devices than the mesh
    needs (a CPU host simulating devices): the first `count` are used. A multi-process run must
    use every device, since each process has to take part in every step.
    """
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    processes = {d.process_index for d in ordered}
    if len(processes) > 1 and len(ordered) != count:
        raise ValueError(f"--mesh has {count} devices but the {len(processes)} processes have "
                         f"{len(ordered)}; accepted: a --mesh NODESxLOCAL with NODES x LOCAL = "
                         f"{len(ordered)}, e.g. {len(processes)}x{len(ordered) // len(processes)}")
    if len(ordered) < count:
        raise ValueError(f"--mesh has {count} devices but only {len(ordered)} are available; "
                         f"accepted: a --mesh NODESxLOCAL with NODES x LOCAL <= {len(ordered)}")
    return ordered[:count]


def check_sequence_parallel(mesh: tuple[int, int], sequence: int) -> None:
    """ValueError unless `sequence` (--sequence-parallel-size) is an integer >= 1 dividing the
    LOCAL devices of `mesh` (--mesh NODESxLOCAL): each node's LOCAL devices become LOCAL/P data
    replicas x P sequence devices, a sequence's all-to-alls inside one node."""
    nodes, local = mesh
    accepted = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
    if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 1:
        raise ValueError(f"{SEQUENCE_OPTION} {sequence!r} is invalid; accepted: one of "
                         f"{accepted} (the divisors of the LOCAL {local} of --mesh "
                         f"{nodes}x{local})")
    if local % sequence:
        raise ValueError(f"{SEQUENCE_OPTION} {sequence} does not divide the {local} local "
                         f"devices of --mesh {nodes}x{local} (each node's LOCAL devices are "
                         f"LOCAL/P data replicas x P sequence devices); accepted: "
                         f"{SEQUENCE_OPTION} one of {accepted}, or a --mesh whose LOCAL is a "
                         f"multiple of {sequence}")


def check_expert_parallel(mesh: tuple[int, int], sequence: int, expert: int) -> None:
    """ValueError unless `expert` (--expert-parallel-size EP) is an integer >= 1 dividing the
    LOCAL / P data replicas of each node of `mesh` (--mesh NODESxLOCAL, P =
    --sequence-parallel-size): an MoE layer's experts are split over EP consecutive replicas
    of one node, whose token exchange stays inside it."""
    nodes, local = mesh
    replicas = local // sequence
    accepted = ", ".join(str(d) for d in range(1, replicas + 1) if replicas % d == 0)
    if (not isinstance(expert, int) or isinstance(expert, bool) or expert < 1
            or replicas % expert):
        over = f" / {SEQUENCE_OPTION} {sequence}" if sequence > 1 else ""
        raise ValueError(f"{EXPERT_OPTION} {expert!r} does not divide the {replicas} data "
                         f"replicas per node (the LOCAL {local} of --mesh {nodes}x{local}{over}); "
                         f"accepted: one of {accepted}")


def job_mesh(mesh: tuple[int, int], stages: int = 1, sequence: int = 1,
             expert: int = 1) -> Any:
    """The `jax.sharding.Mesh` of `--mesh` (with `stages` pipeline stages in front) on the
    first `stages x nodes x local` devices; ValueError naming --mesh when there are fewer.

    `--mesh NODESxLOCAL` names every device; `sequence` (--sequence-parallel-size P, which
    must divide LOCAL: `check_sequence_parallel`) splits each node's LOCAL devices
    into LOCAL/P data replicas x P sequence devices: `make_mesh(nodes, local // P,
    sequence=P)`, the sequence devices of a replica consecutive inside one host. `expert`
    (--expert-parallel-size EP, dividing LOCAL/P: `check_expert_parallel`) makes EP
    consecutive replicas of a node an expert group: `make_mesh(nodes, local // (P EP),
    expert=EP, sequence=P)`."""
    import jax

    from zeroxla.sharding.mesh import make_mesh

    nodes, local = mesh
    check_sequence_parallel(mesh, sequence)
    check_expert_parallel(mesh, sequence, expert)
    return make_mesh(nodes, local // (sequence * expert), stages=stages, expert=expert,
                     sequence=sequence,
                     devices=mesh_devices(jax.devices(), stages * nodes * local))


def broadcast_text(text: str, max_bytes: int = 4096) -> str:
    """Process 0's `text`, on every process (e.g. a run directory only process 0 can name)."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = text.encode("utf-8")
    if len(data) > max_bytes:
        raise ValueError(f"broadcast_text: {len(data)} bytes exceed max_bytes={max_bytes}")
    buffer = np.zeros(max_bytes, np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    length = np.array([len(data)], np.int32)
    buffer, length = multihost_utils.broadcast_one_to_all((buffer, length))
    return bytes(np.asarray(buffer)[:int(np.asarray(length)[0])]).decode("utf-8")


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (a collective: every process must call it)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag], np.int32))))


__all__ = ["AUTO_ENV", "COORDINATOR_ENV", "CPU_COLLECTIVES", "DistributedEnv", "ENV_VARS",
           "NUM_PROCESSES_ENV", "PROCESS_ID_ENV", "SEQUENCE_OPTION", "EXPERT_OPTION",
           "any_process", "broadcast_text", "check_expert_parallel", "check_sequence_parallel",
           "from_environ", "initialize", "job_mesh", "mesh_devices"]
