"""Decode over long caches: `layers.cached_attention` (the cache read block by block with an
online softmax) equals `layers.cached_attention_naive` (the whole [B, H, T, S] scores) within
2e-6 in float32 - rows at different positions, GQA, sliding windows, Gemma 2's soft-cap and
scale, a cache length that is not a multiple of the block, prefill (T > 1) and one-token steps -
and writes the same cache; its compiled temporaries do not grow with the cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.models import layers

TOL = 2e-6


def _inputs(seed, b, t, h, g, d, s):
    """q [B, T, H, K], k, v [B, T, G, K] and a cache {"k", "v"} [B, S, G, K] of junk (slots
    above a row's position hold data no correct mask lets through), standard normal."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, t, h, d), (b, t, g, d), (b, t, g, d)))
    cache = {name: jnp.asarray(rng.standard_normal((b, s, g, d)), jnp.float32)
             for name in ("k", "v")}
    return q, k, v, cache


def _check(q, k, v, positions, cache, block, **options):
    got, got_cache = jax.jit(lambda *a: layers.cached_attention(*a, block=block, **options))(
        q, k, v, positions, cache)
    want, want_cache = jax.jit(lambda *a: layers.cached_attention_naive(*a, **options))(
        q, k, v, positions, cache)
    assert float(jnp.max(jnp.abs(got - want))) < TOL
    for name in ("k", "v"):
        np.testing.assert_array_equal(got_cache[name], want_cache[name])


# Rows at positions far apart: one in the first block, one in the last (S = 100 with blocks of
# 16: the last block overlaps the one before it).
STEP_POSITIONS = [[3], [97], [40], [64]]


@pytest.mark.parametrize("window,softcap,scale", [(None, None, None), (7, None, None),
                                                  (30, 5.0, 0.2), (None, 5.0, 0.2)])
def test_one_token_steps(window, softcap, scale):
    q, k, v, cache = _inputs(0, 4, 1, 4, 2, 16, 100)
    positions = jnp.asarray(STEP_POSITIONS, jnp.int32)                   # [B, 1]
    _check(q, k, v, positions, cache, 16, window=window, softcap=softcap, scale=scale)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_of_right_padded_prompts(window):
    """T = 11 tokens at positions 0..10 (the prefill), and a second chunk at 20..30."""
    q, k, v, cache = _inputs(1, 2, 11, 4, 1, 16, 37)
    for first in (0, 20):
        positions = jnp.broadcast_to(jnp.arange(first, first + 11, dtype=jnp.int32), (2, 11))
        _check(q, k, v, positions, cache, 8, window=window)


def test_cache_shorter_than_a_block():
    q, k, v, cache = _inputs(2, 2, 1, 2, 2, 8, 5)
    _check(q, k, v, jnp.asarray([[0], [4]], jnp.int32), cache, 512)


def _compiled_step(attention, s):
    """One decode step, B = 1, T = 1, 16 query heads on 8 kv heads, K = 128 (Qwen3-0.6B's
    attention), against a cache of `s` slots: compiled from shapes, nothing allocated."""
    f32 = jnp.float32
    q = jax.ShapeDtypeStruct((1, 1, 16, 128), f32)
    k = jax.ShapeDtypeStruct((1, 1, 8, 128), f32)
    cache = {n: jax.ShapeDtypeStruct((1, s, 8, 128), f32) for n in ("k", "v")}
    positions = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.jit(attention).lower(q, k, k, positions, cache).compile()


def test_a_steps_temporaries_do_not_grow_with_the_cache():
    """From S = 8K to 32K the naive step's temporaries grow with S (it holds [16, S] scores and
    a transposed copy of the cache); the blockwise step's, a few [512]-slot blocks, do not."""
    temp = {(fn.__name__, s): _compiled_step(fn, s).memory_analysis().temp_size_in_bytes
            for fn in (layers.cached_attention_naive, layers.cached_attention)
            for s in (8192, 32768)}
    naive, blockwise = "cached_attention_naive", "cached_attention"
    assert temp[naive, 32768] >= 3.5 * temp[naive, 8192], temp
    assert temp[blockwise, 32768] <= 1.05 * temp[blockwise, 8192], temp
    assert temp[blockwise, 32768] * 32 < temp[naive, 32768], temp
