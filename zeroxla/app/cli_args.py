"""argparse value types, the checks between options, and the simulated-device flag shared by the
`zeroxla` subcommands.

Nothing here starts JAX: the CLI sets the device count before a JAX backend exists.
`check_batch` refuses, before any compute, a global batch that `--mesh NODESxLOCAL`'s
data replicas (and the micro-batches) do not divide, which would otherwise fail inside JAX's
sharding with a message about array axes. Under `--sequence-parallel-size P` (DeepSpeed-Ulysses)
`--mesh` still names every device: each node's LOCAL devices are LOCAL/P data replicas x P
sequence devices (DeepSpeed's dp = world / sp), so P must divide LOCAL
(`zeroxla.app.distributed.check_sequence_parallel`), the batch's rows divide over NODES x LOCAL/P replicas, and every
sequence's length over P (`check_sequence_length`). The temperature check is the engine's own
(`zeroxla.inference.sampling.check_temperature`, plain Python), so the option accepts exactly
what `HybridEngine.generate` does.
"""

from __future__ import annotations

import argparse
import os

from zeroxla.app.distributed import SEQUENCE_OPTION
from zeroxla.app.launch import DEVICE_COUNT_FLAG, set_host_threads
from zeroxla.inference.sampling import TEMPERATURE_ACCEPTED, check_temperature


def mesh_shape(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4)."""
    try:
        nodes, local = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r} is invalid; accepted: NODESxLOCAL with "
                                         "positive integers, e.g. 2x4") from None
    if nodes < 1 or local < 1:
        raise argparse.ArgumentTypeError(f"--mesh {text!r} is invalid; accepted: NODESxLOCAL with "
                                         "positive integers, e.g. 2x4")
    return nodes, local


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: an integer >= 0")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):             # refuses nan too
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: a finite positive "
                                         "number")
    return value


def finite_float(text: str) -> float:
    """A finite number of either sign (not nan, not inf), e.g. a reward weight."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not abs(value) < float("inf"):             # refuses nan too
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: a finite number")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (not nan, not inf)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: a finite number >= 0")
    return value


def unit_interval(text: str) -> float:
    """A number in [0, 1] (a discount or a trace decay)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: a number in [0, 1]")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or a finite positive number (not nan, not inf), as
    the engine's `check_temperature` accepts it."""
    try:
        return check_temperature(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: "
                                         f"{TEMPERATURE_ACCEPTED}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_sequence_length(length: int, option: str, sequence: int,
                          given_as: str | None = None) -> None:
    """ValueError unless `length` (the value of `option`, e.g. "--seq-len") is a multiple of
    `sequence` (--sequence-parallel-size, or as `given_as` says: "sequence_parallel_size=4 in
    ds.json"): each sequence device holds length / P tokens."""
    if sequence <= 1 or length % sequence == 0:
        return
    lower, upper = length // sequence * sequence, -(-length // sequence) * sequence
    use = " or ".join(str(n) for n in (lower, upper) if n > 0)
    given_as = given_as or f"{SEQUENCE_OPTION} {sequence}"
    raise ValueError(f"{option} {length} is not a multiple of {given_as} "
                     f"(each of the {sequence} sequence devices holds 1/{sequence} of every "
                     f"sequence); use {use} (accepted: a multiple of {sequence})")


def check_batch(batch: int, option: str, mesh: tuple[int, int], accum: int = 1,
                sequence: int = 1) -> None:
    """ValueError unless `batch` (the value of `option`, e.g. "--batch-size") is a multiple of
    the mesh's data replicas times `accum` micro-batches (--grad-accum). The replicas are the
    NODES x LOCAL devices of --mesh, or NODES x LOCAL / P under --sequence-parallel-size P
    (`sequence`, which `distributed.check_sequence_parallel` has checked)."""
    replicas = mesh[0] * (mesh[1] // sequence)
    unit = replicas * accum
    if batch % unit == 0:
        return
    per_step = f" x --grad-accum {accum}" if accum > 1 else ""
    lower = max(unit, batch // unit * unit)
    devices, product = "NODES x LOCAL", ""
    if sequence > 1:
        devices = f"NODES x LOCAL / {sequence}"
        product = f" with {SEQUENCE_OPTION} {sequence} ({mesh[0]} x {mesh[1]}/{sequence})"
    meshes = (f", or a --mesh whose {devices} is one of "
              f"{', '.join(map(str, _divisors(batch // accum)))}" if batch % accum == 0 else "")
    what = "data-parallel devices" if sequence == 1 else "data replicas"
    raise ValueError(
        f"{option} {batch} is not a multiple of the {replicas} {what} of --mesh "
        f"{mesh[0]}x{mesh[1]}{product}{per_step}; use {lower} (accepted: a multiple of "
        f"{unit}{meshes})")


def host_device_count(environ: dict | None = None) -> int | None:
    """The device count XLA_FLAGS already sets (`--xla_force_host_platform_device_count=N`),
    or None when it sets none."""
    environ = os.environ if environ is None else environ
    for flag in environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == DEVICE_COUNT_FLAG and value.isdigit():
            return int(value)
    return None


def set_host_device_count(count: int, environ: dict | None = None) -> bool:
    """Adds `--xla_force_host_platform_device_count=count` to XLA_FLAGS unless a count is set,
    and the CPU client's threads for the count XLA_FLAGS then holds (`launch.set_host_threads`:
    without them, 8 simulated devices on a 2-core host can deadlock in a collective).

    Returns whether it set the flag. Must run before JAX creates its CPU backend. Both only
    affect the host (CPU) platform, so they are harmless on GPU/TPU machines.
    """
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    added = DEVICE_COUNT_FLAG not in flags
    if added:
        environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()
    set_host_threads(environ, host_device_count(environ) or count)
    return added


__all__ = ["check_batch", "check_sequence_length", "finite_float", "host_device_count", "mesh_shape", "non_negative_float",
           "non_negative_int", "positive_float", "positive_int", "set_host_device_count",
           "temperature", "unit_interval"]
