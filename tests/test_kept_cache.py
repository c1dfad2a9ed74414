"""The compilation cache kept between test runs (`ZEROXLA_TEST_JAX_CACHE=keep` or a path,
tests/support/xla_flags.py): bounded once per run by removing the entries written longest ago,
and never a source of a wrong or failed compile: an entry that cannot be read is a miss. Before
jaxlib 0.12 the suite uses no persistent cache (a sharded program read back from it runs its
collectives out of order there); from 0.12 a read-back ZeRO-2 step runs as the one compiled in
its own process does, run after run."""

import ast
import os
import subprocess
import sys
import textwrap
from importlib import metadata

import numpy as np
import pytest

import xla_flags


def _write(path, name, size, mtime):
    """A file of `size` bytes (sparse: no blocks written) modified at `mtime` ns."""
    with open(path / name, "wb") as f:
        f.truncate(size)
    os.utime(path / name, ns=(mtime, mtime))


def test_the_prune_removes_the_entries_written_longest_ago_until_the_bound_holds(tmp_path):
    for name, size, mtime in [("a-cache", 100, 1), ("b-cache", 200, 2), ("c-cache", 300, 3),
                              ("d-cache", 50, 4)]:
        _write(tmp_path, name, size, mtime)
    # 650 bytes against 400: a (100) leaves 550, b (200) leaves 350; c and d stay.
    assert xla_flags.prune_kept_cache(str(tmp_path), 400) == ["a-cache", "b-cache"]
    assert sorted(os.listdir(tmp_path)) == ["c-cache", "d-cache"]
    assert xla_flags.prune_kept_cache(str(tmp_path), 350) == []
    assert xla_flags.prune_kept_cache(str(tmp_path), 0) == ["c-cache", "d-cache"]


def test_a_kept_cache_is_named_pruned_and_left_without_jaxs_per_write_eviction(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    _write(kept, "old-cache", xla_flags.PERSISTENT_CACHE_MAX_BYTES // 2 + 1, 1)
    _write(kept, "new-cache", xla_flags.PERSISTENT_CACHE_MAX_BYTES // 2, 2)
    environ = {xla_flags.PERSISTENT_CACHE_ENV: str(kept)}
    assert xla_flags.use_compilation_cache(environ, safe=True) is None   # the run keeps it
    assert environ[xla_flags.CACHE_ENV] == str(kept)
    assert os.listdir(kept) == ["new-cache"]
    assert "JAX_COMPILATION_CACHE_MAX_SIZE" not in environ       # JAX's default: no eviction
    home = tmp_path / "home"
    environ = {xla_flags.PERSISTENT_CACHE_ENV: "keep", "XDG_CACHE_HOME": str(home)}
    xla_flags.use_compilation_cache(environ, safe=True)
    python = ".".join(map(str, sys.version_info[:2]))
    assert environ[xla_flags.CACHE_ENV] == str(
        home / "zeroxla-tests" / f"jax-cache-jaxlib{metadata.version('jaxlib')}-py{python}")
    assert os.path.isdir(environ[xla_flags.CACHE_ENV])


def test_before_jaxlib_0_12_no_cache_is_used_and_one_named_is_refused(tmp_path):
    environ = {xla_flags.PERSISTENT_CACHE_ENV: xla_flags.COLD}
    assert xla_flags.use_compilation_cache(environ, safe=False) is None
    assert xla_flags.CACHE_ENV not in environ          # no folder made, none named
    for named in ({xla_flags.PERSISTENT_CACHE_ENV: xla_flags.KEEP},
                  {xla_flags.PERSISTENT_CACHE_ENV: str(tmp_path)},
                  {xla_flags.CACHE_ENV: str(tmp_path)}):
        with pytest.raises(ValueError, match=r"=.*jaxlib .*out of order.*before jaxlib 0\.12"):
            xla_flags.use_compilation_cache(dict(named), safe=False)
    # and this process runs so: a cache from jaxlib 0.12 on, none before
    import jax
    assert (jax.config.jax_compilation_cache_dir is not None) == xla_flags.PERSISTENT_CACHE_SAFE
    # the jaxlibs the read-back step ran on (xla_flags): 0.10 aborted it, 0.12 ran it alike
    measured = {(0, 10): False, (0, 12): True}
    jaxlib = xla_flags.jaxlib_version()
    if jaxlib in measured:
        assert xla_flags.PERSISTENT_CACHE_SAFE == measured[jaxlib]


# The opening of each child script: JAX's persistent cache at argv[1], every program written to it,
# and `hits`, the programs read back from it.
_CACHED = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax import monitoring
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []
    monitoring.register_event_listener(lambda name, **_: hits.append(name)
                                       if name == "/jax/compilation_cache/cache_hits" else None)
""")


# A 4-device ZeRO-2 step of a small Llama: compiled in this process (argv[2] == 0 runs: the
# cache written) or read back from the cache and run argv[2] times on copies of one state.
# Prints the cache hits, the runs that differ from the first in any bit, and saves the first's
# leaves. Under the suite's codegen flags, jaxlib 0.10.2 aborted such a read-back step in its
# first runs (a rendezvous of 5 participants for 4 devices, or a deadlock).
_ZERO2_STEP = _CACHED + textwrap.dedent("""
    import optax
    from flax import nnx
    import zeroxla
    from zeroxla.models import Llama, LlamaConfig
    runs, out = int(sys.argv[2]), sys.argv[3]
    config = LlamaConfig(init_std=0.2, d_model=64, num_heads=8, num_kv_heads=2, mlp_chunk=4)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (4, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((4, 32), np.float32)}
    step = zeroxla.make_step(lambda: Llama(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(2, 2, devices=jax.devices()[:4]),
                             optimizer=optax.sgd(1.0),
                             config=zeroxla.ZeroConfig(stage=2, persistence_threshold=0))
    state = step.init()
    leaves = lambda: [np.asarray(x) for x in jax.tree.leaves(step(jax.tree.map(jnp.copy, state),
                                                                  batch))]
    first = leaves()
    differ = sum(any(not np.array_equal(a, b) for a, b in zip(first, leaves()))
                 for _ in range(runs))
    np.savez(out, *first)
    print(len(hits), differ)
""")


@pytest.mark.skipif(not xla_flags.PERSISTENT_CACHE_SAFE,
                    reason="before jaxlib 0.12 the suite uses no persistent cache (xla_flags)")
def test_a_sharded_step_read_back_from_the_cache_runs_as_the_one_compiled_fresh(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k != xla_flags.CACHE_ENV}

    def run(runs, out):
        done = subprocess.run([sys.executable, "-c", _ZERO2_STEP, str(tmp_path / "cache"),
                               str(runs), str(out)], env=environ, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        hits, differ = map(int, done.stdout.split())
        with np.load(out) as saved:
            return hits, differ, [saved[k] for k in sorted(saved.files, key=lambda k: int(
                k.split("_")[1]))]

    hits, _, compiled = run(0, tmp_path / "compiled.npz")
    assert hits == 0
    hits, differ, read_back = run(200, tmp_path / "read_back.npz")
    assert hits > 0 and differ == 0                  # the step itself came from the cache
    assert len(read_back) == len(compiled)
    for got, want in zip(read_back, compiled):
        np.testing.assert_array_equal(got, want)


_COMPILE = _CACHED + textwrap.dedent("""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.jit(lambda x: jnp.sin(x) * 3.0 + x)(jnp.arange(5.0))
    print(len(hits), sum("Error reading persistent compilation cache" in str(w.message)
                         for w in caught), repr(got.tolist()))
""")


@pytest.mark.slow
def test_an_entry_cut_short_is_a_miss_that_compiles_the_right_program(tmp_path):
    """A later process hits what an earlier one wrote; after every entry is cut to half its
    bytes (a writer killed mid-write), a process warns, compiles, and computes the same values."""
    environ = {k: v for k, v in os.environ.items() if k != xla_flags.CACHE_ENV}

    def run():
        out = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path)], env=environ,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        hits, read_errors, values = out.stdout.strip().split(" ", 2)
        return int(hits), int(read_errors), ast.literal_eval(values)

    x = np.arange(5.0)
    expected = np.sin(x) * 3.0 + x         # float64; the program computes in float32
    first = run()
    assert first[:2] == (0, 0)
    np.testing.assert_allclose(first[2], expected, rtol=1e-6)
    entries = [p for p in tmp_path.iterdir() if p.name.endswith("-cache")]
    assert entries
    assert run() == (len(entries), 0, first[2])       # every program read back
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    assert run() == (0, len(entries), first[2])
