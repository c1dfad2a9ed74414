"""The XLA flags, the compilation cache and the tracing setting every test process runs with, in
one place: conftest.py sets them for pytest's own process, and `child_environ()` hands them to
the processes tests start (workers, `zeroxla train`, `zeroxla launch`, notebook kernels inherit
them).

The suite compiles about a thousand programs and runs each a few times on tiny shapes, so XLA
compilation is most of its time (test_parity.py: 114 of 159 s). Four XLA:CPU code-generation
flags cut it, and a fifth cuts what running costs two processes of 8 simulated devices on two
cores:

- `--xla_backend_optimization_level=0` runs LLVM at -O0 (a gpt-tiny ZeRO-2 parity test: 15.6 ->
  9.7 s of XLA compilation over its compiles). It changes no HLO.
- `--xla_cpu_use_fusion_emitters=false` emits XLA:CPU's loop fusions with its older IR emitters
  instead of the MLIR fusion emitters (test_parity.py: 181 -> 104 CPU-seconds). XLA:CPU then
  forms slightly different fusions, so a compiled step's temporary buffer differs by a few
  percent from the default CPU build (gpt-tiny ZeRO-3 step: 1,194,832 vs 1,253,328 bytes).
- `--xla_llvm_disable_expensive_passes=true` skips LLVM's costliest passes
  (test_sequence_parallel.py daily, one process: 9.3 -> 8.7 s of XLA compilation). It changes
  no HLO, and the golden loss curves (tests/zeroxla/golden) hold to 1e-6 under it.
- `--xla_cpu_parallel_codegen_split_count=1` generates each program's code as one LLVM module
  instead of splitting it into parts compiled on threads: two busy worker processes on two cores
  leave those threads no core to run on, so splitting only adds work (the daily tests of
  tests/models and tests/zeroxla/engine under `-n 2`, back to back: XLA compiling 117.3 and
  120.0 -> 94.5 and 101.7 worker-seconds, the run 128 -> 115 and 120 s). It changes no HLO; the
  code differs in the last bits of some float results on jaxlib 0.10 (7 of the 9 golden loss
  curves moved by up to 2.7e-6 relative, so they are stored as compiled under it; on 0.12 none
  moved).
- `--xla_cpu_multi_thread_eigen=false` runs XLA:CPU's dots and convolutions on the thread of
  the device that issued them instead of Eigen's thread pool: with 8 device threads in each of
  two worker processes on two cores, the pool's threads only contend with them
  (test_parity.py + test_zeropp.py under `-n 2`: 251 -> 237 CPU-seconds, 147 -> 139 s). A
  contraction split over the pool may add in another order, so results can differ from a
  default build in the last bits, as the -O0 build's do (below).

None of them touches what zeroxla emits or what the SPMD partitioner makes of it: the collectives,
their replica groups and bytes, named scopes and trip counts that zeroxla.analysis reads, and
argument/output sizes are those of a default build. Memory checks that read temporaries compare
programs compiled under the same flags with each other (1F1B vs GPipe stash, remat policies,
ZeRO stages) or with a bound, which are properties of zeroxla's program, not of a CPU fusion
choice; GPU users get another compiler anyway. One property does depend on the emitters: the
same arithmetic in two differently shaped programs giving the same bits (a frozen leaf's int8
scales quantized on 8 devices and on 4 agree bit for bit under the default emitters, and differ in
the last bit of 9 of 68 scales under the older ones). Tests of that carry the `fusion_emitters`
mark and run in a child pytest with XLA's fusion emitters (tests/conftest.py). Float results differ in the last bits from a
default build (FMA contraction; gpt-tiny's third AdamW loss 3.74925423 at -O3, 3.74925447 at
-O0); every comparison in the suite is between programs built under these same flags, in this
process or in one started with `child_environ()`. (Notebooks add their device count to the
XLA_FLAGS they find, so their test kernels run with these flags too; users' runs get XLA's
default. A run whose time is running its programs, not compiling them, is faster at the
default: the README's job and the GRPO notebook's test start theirs with
`child_environ(codegen_flags=False)`, whose comparisons are within that one process.)
"""

import os
import sys
import tempfile
from collections.abc import MutableMapping, Mapping
from importlib import metadata

from zeroxla.app.launch import DEVICE_COUNT_FLAG  # no JAX backend starts on import


def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor), read without importing JAX."""
    return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])


# An XLA flag the installed XLA does not know aborts the process at backend start, so a flag
# some jaxlib versions lack is added only where it exists. The table (flag -> the first jaxlib
# without it):
#   --xla_cpu_use_fusion_emitters   0.12: XLA:CPU emits every fusion with its MLIR emitters,
#                                   the suite's default there (`fusion_emitters` tests then run
#                                   in-process: there is nothing else to compare with)
OLDER_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
HAS_OLDER_EMITTERS = jaxlib_version() < (0, 12)
CODEGEN_FLAGS = " ".join(["--xla_backend_optimization_level=0",
                          *([OLDER_EMITTERS_FLAG] if HAS_OLDER_EMITTERS else []),
                          "--xla_llvm_disable_expensive_passes=true",
                          "--xla_cpu_parallel_codegen_split_count=1",
                          "--xla_cpu_multi_thread_eigen=false"])

# JAX's persistent compilation cache, one directory per test run (`use_compilation_cache`), on
# jaxlib 0.12 and later (PERSISTENT_CACHE_SAFE, below, says why not before):
# tests build many identical programs (the same gpt-tiny step in parity, optimizer, memory and
# checkpoint tests; single-device references), and `make_step` makes a new `jax.jit` each time,
# so JAX's in-memory cache never hits; the persistent cache is keyed by the HLO, the flags and
# the JAX version, so an identical program is compiled once per run, in whichever process.
# Checked before using it: a cache hit gives the same `memory_analysis()`, `cost_analysis()`
# and op_name metadata (what zeroxla.analysis reads: named scopes, collectives, trip counts);
# `as_text()` differs only in its source-location tables (file names and lines of whichever
# process compiled it first), which nothing reads. A gpt-tiny ZeRO-3 step: 6.2 s -> 1.2 s.
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# Set in the child pytest that runs a `fusion_emitters` test (tests/conftest.py): CODEGEN_FLAGS
# without OLDER_EMITTERS_FLAG.
FUSION_EMITTERS_ENV = "ZEROXLA_TEST_FUSION_EMITTERS"
CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
# JAX writes up to 100 frames of the Python stack that traced an op into its MLIR location; the
# compiled HLO carries them as source tables (FileNames ... StackFrames) and op metadata. With
# none, XLA has less to carry through its passes (7 compile-heavy daily files, one process,
# back to back: 61.1 and 62.9 s against 64.0 and 66.4 s, XLA's compile seconds 8% fewer); the
# HLO, op_name metadata (named scopes, what zeroxla.analysis reads) and the cache key (JAX
# strips debug info before hashing) are unchanged. Set for every test process like the cache
# settings (`use_trace_settings`); conftest.py also sets it in pytest's own process, which
# imported JAX before it.
TRACE_SETTINGS = {"JAX_TRACEBACK_IN_LOCATIONS_LIMIT": "0"}


# A cache kept between runs on one machine: `ZEROXLA_TEST_JAX_CACHE=keep` uses one
# directory per jaxlib and Python version under the user's cache folder, a path names another.
# It is never needed for correctness, and a stale entry cannot be used: JAX keys each entry by
# the program's HLO, the compile options and XLA flags, and the jaxlib / backend version, so a
# changed program or flag is a new key (a miss), never another program's executable. An entry
# that cannot be read (one another process is still writing, or one a prune removed under it)
# is a miss too: JAX warns and compiles. The bound is kept once per run, by the process that
# names the cache, before any test runs (`prune_kept_cache`: the entries written longest ago go
# first), not by JAX's LRU eviction (`jax_compilation_cache_max_size`), which lists and stats
# the whole folder, under a file lock every process waits on, at each entry it writes: a cold
# daily run filling a kept cache so spent 922 worker-seconds compiling, against 236 with the
# prune and 217 with a per-run cache (2026-11-29). It is not the default; `.ci/run` uses it
# for leg 2 (jaxlib 0.12).
PERSISTENT_CACHE_ENV = "ZEROXLA_TEST_JAX_CACHE"
COLD, KEEP = "cold", "keep"
PERSISTENT_CACHE_MAX_BYTES = 4 << 30

# Before jaxlib 0.12 the suite uses no persistent cache at all, and refuses one named for it:
# an XLA:CPU executable read back from the cache can run its collectives out of program order.
# JAX gives every collective of a sharded program the same channel id (1), so XLA:CPU's
# rendezvous (keyed by run, devices, kind and that id) pairs each device's k-th all-gather with
# the others' k-th, whichever all-gather of the program it is; that holds only while each
# device starts them in program order. A freshly compiled executable does (its collectives
# share one communicator resource that orders their starts); one deserialized from the cache,
# on jaxlib 0.10.2, does not. A 4-device ZeRO-2 step compiled under CODEGEN_FLAGS and read
# back from the cache deadlocked or failed XLA's check on its rendezvous ("Unexpected number of
# participants: 5 vs. 4", a reduce-scatter) within its first runs, in 10 of 10 processes; the
# same step compiled in-process ran 15,000 times bit for bit alike (2026-11-30,
# docs/testing.md "XLA flags and the compilation cache"). Two collectives of the same kind and
# size that cross would exchange the wrong data without an error. The warm runs' lost workers
# came from this: test_sequence_parallel.py's directly, test_reshard_floor.py's through
# collectives that a read-back program started together until they held every thread of the
# CPU client (zeroxla.app.launch.set_host_threads). On jaxlib 0.12.0.1 the read-back step ran
# 16,000 times alike, and tests/test_kept_cache.py keeps checking that there.
PERSISTENT_CACHE_SAFE = jaxlib_version() >= (0, 12)


def persistent_cache_dir(environ: Mapping[str, str]) -> str:
    """The kept cache of this jaxlib and Python: $XDG_CACHE_HOME (or ~/.cache)/zeroxla-tests/."""
    root = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    version = ".".join(map(str, sys.version_info[:2]))
    return os.path.join(root, "zeroxla-tests",
                        f"jax-cache-jaxlib{metadata.version('jaxlib')}-py{version}")


def prune_kept_cache(path: str, max_bytes: int = PERSISTENT_CACHE_MAX_BYTES) -> list[str]:
    """Removes the files of the kept cache at `path` written longest ago (modification time,
    then name) until the rest hold at most `max_bytes`; returns the names removed."""
    entries = []
    with os.scandir(path) as found:
        for entry in found:
            if entry.is_file(follow_symlinks=False):
                stat = entry.stat(follow_symlinks=False)
                entries.append((stat.st_mtime_ns, entry.name, stat.st_size))
    total = sum(size for _, _, size in entries)
    removed = []
    for _, name, size in sorted(entries):
        if total <= max_bytes:
            break
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:       # another run's prune took it first
            pass
        total -= size
        removed.append(name)
    return removed


def use_compilation_cache(environ: MutableMapping[str, str], *,
                          safe: bool = PERSISTENT_CACHE_SAFE) -> str | None:
    """Points `environ` (before JAX is imported) at the run's compilation cache: the one it
    names already (a worker of this run, or a developer's own), else a new temporary directory,
    returned so that the process that made it removes it at the end; with
    `ZEROXLA_TEST_JAX_CACHE=keep` (or a path) the kept cache, pruned to its bound. Where the
    cache is not `safe` (jaxlib before 0.12, PERSISTENT_CACHE_SAFE), none: every process
    compiles what it runs, and a cache named by either variable is a ValueError."""
    environ.update({k: v for k, v in CACHE_SETTINGS.items() if k not in environ})
    if not safe:
        named = [f"{name}={environ[name]}" for name in (CACHE_ENV, PERSISTENT_CACHE_ENV)
                 if environ.get(name) and not (name == PERSISTENT_CACHE_ENV
                                               and environ[name] == COLD)]
        if named:
            raise ValueError(
                f"{', '.join(named)}: jaxlib {metadata.version('jaxlib')} runs collectives "
                f"of an XLA:CPU program read back from JAX's persistent compilation cache out "
                f"of order (deadlocks, or collectives paired with the wrong partner), so the "
                f"suite runs without that cache before jaxlib 0.12; unset it, or use "
                f"{PERSISTENT_CACHE_ENV}={COLD} (tests/support/xla_flags.py says why)")
        return None
    if environ.get(CACHE_ENV):
        return None
    chosen = environ.get(PERSISTENT_CACHE_ENV, COLD)
    if chosen == COLD:
        environ[CACHE_ENV] = tempfile.mkdtemp(prefix="zeroxla-test-jax-cache-")
        return environ[CACHE_ENV]
    path = persistent_cache_dir(environ) if chosen == KEEP else chosen
    os.makedirs(path, exist_ok=True)
    prune_kept_cache(path)
    environ[CACHE_ENV] = path
    return None


def use_trace_settings(environ: MutableMapping[str, str]) -> None:
    """Puts TRACE_SETTINGS in `environ` where it names none (a developer's own value stays)."""
    environ.update({k: v for k, v in TRACE_SETTINGS.items() if k not in environ})


def with_codegen_flags(xla_flags: str, *, older_emitters: bool = True) -> str:
    """`xla_flags` with each of CODEGEN_FLAGS added (once); without OLDER_EMITTERS_FLAG when
    `older_emitters` is False."""
    wanted = [f for f in CODEGEN_FLAGS.split() if older_emitters or f != OLDER_EMITTERS_FLAG]
    kept = [f for f in xla_flags.split() if older_emitters or f != OLDER_EMITTERS_FLAG]
    return " ".join([*kept, *(f for f in wanted if f not in kept)])


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
