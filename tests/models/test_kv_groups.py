"""One KV cache for layers of different key-value shapes (`models.kv_groups`): a layer's heads
folded into the cache's C head groups, decoded through the dense cache (`cached_attention`,
blockwise and naive) and the paged one (`paged_attention`, pages scattered over the pool), a
6-token prefill then 3 one-token steps, against a float64 numpy causal attention of the whole
sequence (1e-5), for (G, K) layer shapes whose C = gcd of the head counts is 1 and 2; each
group holds a contiguous run of the layer's heads (what tensor parallelism, splitting the
groups, relies on)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.models import kv_groups
from zeroxla.models.attention import cached_attention
from zeroxla.models.paged_attention import PagedKV

H, T, PREFILL, PAGE = 4, 9, 6, 4
# two layers sharing a cache: (kv heads, head dim) each
SHAPES = {"one-group": ((2, 8), (1, 16)), "two-groups": ((4, 8), (2, 16))}


def _reference(q, k, v):
    """float64 causal attention: q [T, H, K], k, v [T, G, K] -> [T, H, K]."""
    t, h, d = q.shape
    g = k.shape[1]
    out = np.zeros((t, h, d))
    for i in range(t):
        for j in range(h):
            s = k[:i + 1, j // (h // g)] @ q[i, j] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[i, j] = (w / w.sum()) @ v[:i + 1, j // (h // g)]
    return out


def _decode(layer_cache, q, k, v, implementation):
    """A 6-token prefill, then one token at a time, of q [T, H, K], k, v [T, G, K] through
    one layer's cache (`layer_cache(n)`: the cache for the step's n tokens, row 0) ->
    (out [T, H, K], the last cache)."""
    step = jax.jit(lambda q, k, v, pos, c: cached_attention(
        q, k, v, pos, c, implementation=implementation))
    outs, cache = [], None
    for lo, hi in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, T)]:
        cache = layer_cache(hi - lo, cache)
        pos = jnp.arange(lo, hi, dtype=jnp.int32)[None]
        out, cache = step(*(jnp.asarray(x[None, lo:hi], jnp.float32) for x in (q, k, v)),
                          pos, cache)
        outs.append(np.asarray(out[0]))
    return np.concatenate(outs), cache


@pytest.mark.parametrize("route", ["dense-blockwise", "dense-naive", "paged"])
@pytest.mark.parametrize("shapes", sorted(SHAPES))
def test_layers_of_different_shapes_share_one_cache(shapes, route):
    rng = np.random.default_rng(0)
    groups = kv_groups.cache_groups([g for g, _ in SHAPES[shapes]])
    widths = kv_groups.fold_widths(SHAPES[shapes])
    assert groups == {"one-group": 1, "two-groups": 2}[shapes]
    pages = 1 + rng.permutation(7)[:3]                   # the sequence's pages, scattered
    dense = {n: jnp.zeros((1, 16, groups, sum(widths)), jnp.float32) for n in "kv"}
    pool = jnp.zeros((1, 1, groups, 8, PAGE, sum(widths)), jnp.float32)
    for j, (g, d) in enumerate(SHAPES[shapes]):
        q, k, v = (rng.standard_normal((T, n, d)) for n in (H, g, g))
        part = slice(sum(widths[:j]), sum(widths[:j + 1]))     # the layer's own entries

        def layer_cache(n, cache):
            if route == "paged":
                table = jnp.broadcast_to(jnp.asarray(pages, jnp.int32), (1, n, 3))
                return (PagedKV(pool[..., part], pool[..., part], table) if cache is None
                        else cache.replace(token_pages=table))
            return cache if cache is not None else {x: c[..., part] for x, c in dense.items()}

        got, cache = _decode(layer_cache, q, k, v,
                             "naive" if route == "dense-naive" else "blockwise")
        np.testing.assert_allclose(got, _reference(q, k, v), atol=1e-5, rtol=0)
        # group c holds heads c G / C .. (c + 1) G / C - 1 side by side
        held = (np.asarray(cache["k"])[0, :T] if route != "paged" else np.concatenate(
            [np.asarray(cache.k)[0, 0, :, p] for p in pages], axis=1).transpose(1, 0, 2)[:T])
        np.testing.assert_allclose(held.reshape(T, g, d), k, atol=1e-6)
