"""The XLA flags and the compilation cache every test process runs with, in one place: conftest.py sets them for pytest's
own process, and `child_environ()` hands them to the processes tests start (workers, `zeroxla
train`, `zeroxla launch`, notebook kernels inherit them).

`--xla_backend_optimization_level=0` runs XLA:CPU's LLVM code generation at -O0. The suite
compiles about a thousand programs and runs each a few times on tiny shapes, so compile time is
most of its time; -O0 cuts it by about a third (a gpt-tiny ZeRO-2 parity test: 15.6 -> 9.7 s
of XLA compilation over its compiles). It changes no HLO: `compiled.as_text()`, `memory_analysis()` and `cost_analysis()`
are identical to an -O3 build, so every byte, memory and FLOP figure a test reads is what users
get. Only machine code differs, and with it float results in the last bits (FMA contraction):
gpt-tiny's third AdamW loss 3.74925423 at -O3, 3.74925447 at -O0. Every comparison in the suite is
between programs built under these same flags, in this process or in one started with
`child_environ()`. (Notebooks add their device count to the XLA_FLAGS they find, so their test
kernels run with these flags too; users' runs get XLA's default.)
"""

import os
import tempfile
from collections.abc import MutableMapping, Mapping

from zeroxla.app.launch import DEVICE_COUNT_FLAG  # no JAX backend starts on import

CODEGEN_FLAGS = "--xla_backend_optimization_level=0"

# JAX's persistent compilation cache, one directory per test run (`use_compilation_cache`):
# tests build many identical programs (the same gpt-tiny step in parity, optimizer, memory and
# checkpoint tests; single-device references), and `make_step` makes a new `jax.jit` each time,
# so JAX's in-memory cache never hits; the persistent cache is keyed by the HLO, the flags and
# the JAX version, so an identical program is compiled once per run, in whichever process.
# Checked before using it: a cache hit gives the same `memory_analysis()`, `cost_analysis()`
# and op_name metadata (what zeroxla.analysis reads: named scopes, collectives, trip counts);
# `as_text()` differs only in its source-location tables (file names and lines of whichever
# process compiled it first), which nothing reads. A gpt-tiny ZeRO-3 step: 6.2 s -> 1.2 s.
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def use_compilation_cache(environ: MutableMapping[str, str]) -> str | None:
    """Points `environ` (before JAX is imported) at the run's compilation cache: the one it
    names already (a worker of this run, or a developer's own), else a new temporary directory,
    returned so that the process that made it removes it at the end."""
    environ.update({k: v for k, v in CACHE_SETTINGS.items() if k not in environ})
    if environ.get(CACHE_ENV):
        return None
    environ[CACHE_ENV] = tempfile.mkdtemp(prefix="zeroxla-test-jax-cache-")
    return environ[CACHE_ENV]


def with_codegen_flags(xla_flags: str) -> str:
    """`xla_flags` with CODEGEN_FLAGS added (once)."""
    return xla_flags if CODEGEN_FLAGS in xla_flags else f"{xla_flags} {CODEGEN_FLAGS}".strip()


def child_environ(environ: Mapping[str, str] = os.environ, *,
                  codegen_flags: bool = True) -> dict[str, str]:
    """The environment for a process a test starts that sets its own device count (`zeroxla
    train`, `zeroxla launch --devices-per-proc`): `environ` with no device count in XLA_FLAGS,
    and JAX on the CPU. With `codegen_flags`, XLA_FLAGS holds CODEGEN_FLAGS; without, none of
    them: the process compiles at XLA's default, as a user's command does (a test of a long run
    that compiles little, like the README's job, is faster so: -O0 code runs slower)."""
    env = dict(environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith(DEVICE_COUNT_FLAG) and f not in CODEGEN_FLAGS.split()]
    env["XLA_FLAGS"] = " ".join([*flags, CODEGEN_FLAGS] if codegen_flags else flags)
    env["JAX_PLATFORMS"] = "cpu"
    return env
