"""argparse value types and the simulated-device flag shared by the `zeroxla` subcommands.

Nothing here starts JAX: the CLI sets the device count before a JAX backend exists. The
temperature check is the engine's own (`zeroxla.inference.sampling.check_temperature`, plain
Python), so the option accepts exactly what `HybridEngine.generate` does.
"""

from __future__ import annotations

import argparse
import os

from zeroxla.app.launch import DEVICE_COUNT_FLAG
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


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or a finite positive number (not nan, not inf), as
    the engine's `check_temperature` accepts it."""
    try:
        return check_temperature(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: "
                                         f"{TEMPERATURE_ACCEPTED}") from None


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
    """Adds `--xla_force_host_platform_device_count=count` to XLA_FLAGS unless a count is set.

    Returns whether it set the flag. Must run before JAX creates its CPU backend. The flag only
    affects the host (CPU) platform, so it is harmless on GPU/TPU machines.
    """
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()
    return True


__all__ = ["host_device_count", "mesh_shape", "non_negative_int", "positive_float",
           "positive_int", "set_host_device_count", "temperature"]
