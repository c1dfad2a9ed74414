"""JAX's persistent compilation cache and sharded programs on XLA:CPU: `check_persistent_cache`.

JAX gives every collective of a sharded program the same channel id (1), and XLA:CPU pairs the
participants of a collective by a rendezvous keyed by the run, the devices, the kind and that
id: each device's k-th all-gather meets the others' k-th, whichever all-gather of the program
it is. That holds while every device starts its collectives in program order, as an executable
XLA:CPU compiled in the process does. Before jax 0.12, an executable read back from JAX's
persistent compilation cache (`jax_compilation_cache_dir`) does not: a 4-device ZeRO-2 step
read back so deadlocked or failed XLA's check on its rendezvous (5 participants for 4 devices)
within its first runs, and two collectives of one kind and size that cross would exchange the
wrong data without an error (tests/support/xla_flags.py has the runs). That step was compiled
under the test suite's codegen flags; at XLA's default ones the same step read back ran 10,000
times alike: which programs meet it depends on how XLA schedules them. So before jax 0.12 any
step over more than one CPU device is refused while that cache is on: when `make_step` builds it,
and again where its programs compile and run (the step's init, update, `compile` and `eval_loss`,
the per-token forward, the Hybrid Engine's generation), since the cache can be switched on in
between. From 0.12 the read-back step ran as the one compiled fresh, run after run
(tests/test_kept_cache.py checks it there). GPU and TPU programs are not XLA:CPU's and are
never refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from zeroxla.compat.versions import jax_at_least


def check_persistent_cache(devices: Iterable[Any]) -> None:
    """ValueError when a program over `devices` would be read back from JAX's persistent
    compilation cache on a JAX whose XLA:CPU runs its collectives out of order there (above):
    more than one CPU device, the cache on, jax before 0.12. Reads only JAX's config."""
    directory = jax.config.jax_compilation_cache_dir
    if jax_at_least(0, 12) or not directory or not jax.config.jax_enable_compilation_cache:
        return
    cpu = sum(1 for device in devices if device.platform == "cpu")
    if cpu > 1:
        raise ValueError(
            f"jax_compilation_cache_dir={directory!r}: on jax {jax.__version__}, XLA:CPU runs "
            f"the collectives of a program read back from JAX's persistent compilation cache "
            f"out of order (a deadlock, or two collectives paired with each other's data), so "
            f"a step over {cpu} CPU devices is not built with that cache on; unset "
            f"jax_compilation_cache_dir (JAX_COMPILATION_CACHE_DIR), or use jax 0.12 or newer")


__all__ = ["check_persistent_cache"]
