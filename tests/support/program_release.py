"""When a test process drops the programs it compiled (tests/conftest.py asks after each file).

Each XLA:CPU executable maps its code into the process, and a pytest-xdist worker that runs a
few hundred files without dropping any reaches the kernel's limit on memory maps
(`vm.max_map_count`, 65,530 here: a worker was at 51,110 near the end of the suite), where the
next compile's mmap fails and the worker dies with a segmentation fault. Dropping every program
after every file avoids that, but then the next file traces, lowers and compiles again what
the last one had (the eager primitives of every reference computation, the shared model
programs). So a worker keeps its programs across files while its map count is below
`MAX_MAPS`, a third of the kernel's default limit, and drops them all (`jax.clear_caches()`
between two full collections) when a file ends above it: about 4.4 s at 20,000 maps. Holding
more is slower, not faster: with the limit at 40,000 (twice the programs held) a daily run's
later, smaller files took 255 worker-seconds instead of 230 (2026-11-29, back to back on one
machine; the only changes among those files took 7.6 s of their tests out of the daily
subset), whatever the drops saved. Where /proc/self/maps cannot be read (not Linux), it drops
them after every file.

This changes which programs are compiled again, never what a program computes: a jit cache hit
runs the executable the same arguments built. A file's compile count (the compile budget,
tests/support/compile_budgets.py) can only fall below what it counts run alone.
"""

import gc

import jax

MAX_MAPS = 20_000


def map_count() -> int | None:
    """The memory maps this process holds (lines of /proc/self/maps), None where unreadable."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def crowded(count: int | None, limit: int) -> bool:
    """Whether a process holding `count` memory maps (None: it cannot tell) drops its
    programs under `limit`."""
    return count is None or count > limit


def release_if_crowded(limit: int = MAX_MAPS) -> bool:
    """Drops every compiled program when the process holds more than `limit` memory maps (or
    cannot tell); returns whether it did."""
    if not crowded(map_count(), limit):
        return False
    gc.collect()
    jax.clear_caches()
    gc.collect()
    return True
