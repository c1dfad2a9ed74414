"""The compilation cache kept between test runs (`ZEROXLA_TEST_JAX_CACHE=keep` or a path,
tests/support/xla_flags.py): bounded once per run by removing the entries written longest ago,
and never a source of a wrong or failed compile: an entry that cannot be read is a miss."""

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
    assert xla_flags.use_compilation_cache(environ) is None      # the run does not remove it
    assert environ[xla_flags.CACHE_ENV] == str(kept)
    assert os.listdir(kept) == ["new-cache"]
    assert "JAX_COMPILATION_CACHE_MAX_SIZE" not in environ       # JAX's default: no eviction
    home = tmp_path / "home"
    environ = {xla_flags.PERSISTENT_CACHE_ENV: "keep", "XDG_CACHE_HOME": str(home)}
    xla_flags.use_compilation_cache(environ)
    python = ".".join(map(str, sys.version_info[:2]))
    assert environ[xla_flags.CACHE_ENV] == str(
        home / "zeroxla-tests" / f"jax-cache-jaxlib{metadata.version('jaxlib')}-py{python}")
    assert os.path.isdir(environ[xla_flags.CACHE_ENV])


_COMPILE = textwrap.dedent("""
    import sys, warnings
    import jax, jax.numpy as jnp
    from jax import monitoring
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []
    monitoring.register_event_listener(
        lambda name, **_: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
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
