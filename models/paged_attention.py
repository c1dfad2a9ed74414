"""Attention against a paged KV cache (vLLM's PagedAttention, Kwon et al. 2023): the cache of a
continuous-batching engine (`zeroxla.inference.continuous`).

The cache is a pool of fixed-size pages per data group; a sequence owns a list of pages (its
page table) and its token at position p lives in slot p % page_size of page
table[p // page_size]. A step of the engine is a flat budget of N tokens per group (decode tokens
and prompt chunks mixed, DeepSpeed-FastGen's Dynamic SplitFuse), each token with its own position
and its own sequence's page table, so the cache passed to a model's layers is

    PagedKV(k, v, token_pages)   k, v [L, D, G, NP, P, K]   token_pages int32 [D, N, M]

(L layers, D data groups, G kv heads, NP pages per group, P slots per page, K head dim; token n's
row of its sequence's page table, M pages at most per sequence; `models.layers.scan_layers`
carries it whole from layer to layer, `PagedKV.layer` saying which). A recurrent model's
state (Gated DeltaNet's) rides along in slots, one per sequence (`PagedKV.recurrent`,
`models.recurrent_slots`). Page 0 of each group is the null
page: unused page-table entries point at it and the budget's filler tokens write into it, and no
real token ever attends it (its logical slots lie above the token's position).

A model whose layers call `models.attention.cached_attention` decodes with a `PagedKV` unchanged:
the model sees tokens [D, N] at positions [D, N] (a "batch" of D rows of N tokens that belong to
many sequences), exactly as it sees a dense cache's [B, T].
"""

from __future__ import annotations

from typing import Any

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from . import kv_groups, online_softmax
from .layers import at_least_float32, attention_scores, call_block, visible_keys

NULL_PAGE = 0


# Token places attended together (`paged_attention`): each chunk reads the pages up to its own
# largest position, so an engine that sorts its places by position reads about what each
# token needs rather than the step's longest sequence for every token.
TOKEN_CHUNK = 8
# Logical slots read per block of the online softmax.
PAGED_BLOCK = 64


@flax.struct.dataclass
class PagedKV:
    """A paged KV cache (module docstring): k, v [L, D, G, NP, P, K] (heads before pages: a
    gathered block is [G, tokens, slots, K], its dots need no transpose), the page-table row of
    each of the step's tokens, token_pages int32 [D, N, M], and the layer the attention reads
    and writes. The layers carry it whole (`scan_layers`), each writing its own layer's pages in
    place: no per-layer slice of the pools is copied out and stacked back."""

    k: jax.Array
    v: jax.Array
    token_pages: jax.Array
    layer: jax.Array | int = 0
    # a recurrent model's per-sequence state slots (`recurrent_slots.RecurrentSlots`), carried
    # with the pages from layer to layer; None for a model with attention layers alone
    recurrent: Any = None

    @property
    def page_size(self) -> int:
        return self.k.shape[-2]

    def scan_layers(self, graphdef: Any, state: Any, x: Any, args: tuple) -> tuple[Any, Any]:
        """`models.layers.scan_layers` for this cache: the stacked blocks `state` run by
        `lax.scan`, the cache in the carry with `layer` counting up from its own (0 for a
        model's first stack; a stack after it, Gemma 3's tail, continues where it ended)."""

        def body(carry, layer_state):
            h, cache = carry
            h, cache = call_block(nnx.merge(graphdef, layer_state), h, args, cache)
            return (h, cache.replace(layer=cache.layer + 1)), None

        start = self.replace(layer=jnp.asarray(self.layer, jnp.int32))
        (x, cache), _ = jax.lax.scan(body, (x, start), state)
        return x, cache


def write_pages(k: jax.Array, v: jax.Array, positions: jax.Array,
                cache: PagedKV) -> PagedKV:
    """`cache` with token (d, n)'s k, v [D, N, G, K] written, in layer `cache.layer`, to slot
    positions[d, n] % P of page token_pages[d, n, positions[d, n] // P]; pools of C < G head
    groups hold G / C heads side by side per group (`kv_groups.fold_heads`)."""
    p = cache.page_size
    page = jnp.take_along_axis(cache.token_pages, (positions // p)[..., None], axis=-1)[..., 0]
    group = jnp.broadcast_to(jnp.arange(positions.shape[0])[:, None], positions.shape)

    def write(pool, new):                          # [D, N] indices, [D, N, C, G K / C] new
        new = kv_groups.fold_heads(new, pool.shape[2])
        return pool.at[cache.layer, group, :, page, positions % p].set(new.astype(pool.dtype))

    return cache.replace(k=write(cache.k, k), v=write(cache.v, v))


def _chunk_attention(q, pos, pages, pool_k, pool_v, *, kv_heads, window, scale, softcap, sinks,
                     per_block, dtype):
    """One chunk of C tokens of one group: q [C, H, K], pos [C], pages [C, M'] (M' a whole
    number of blocks), pools [Gp, NP, P, G K / Gp] (`kv_heads` G heads in Gp groups,
    `kv_groups`), sinks [H] or None -> out [C, H, K], reading the blocks up to the chunk's
    largest position (and from its smallest's window start)."""
    c, h, kd = q.shape
    g, p = kv_heads, pool_k.shape[2]
    bk = per_block * p
    qg = jnp.swapaxes(q.reshape(c, g, h // g, kd), 0, 1)                      # [G, C, R, K]
    hi = jnp.max(pos) // bk + 1
    lo = 0 if window is None else jnp.maximum(0, (jnp.min(pos) - window + 1) // bk)

    def read(pool, ids, as_dtype):            # pool [Gp, NP, P, W], ids [C, pb] -> [G, C, bk, K]
        blk = pool[:, ids].reshape(pool.shape[0], c, bk, -1)                # [Gp, C, bk, W]
        return kv_groups.unfold_leading(blk, g).astype(as_dtype)

    def kv_step(j, state):                        # m, l [G, C, R], acc [G, C, R, K]
        ids = jax.lax.dynamic_slice_in_dim(pages, j * per_block, per_block, axis=1)  # [C, pb]
        k_blk, v_blk = read(pool_k, ids, q.dtype), read(pool_v, ids, dtype)
        slot = j * bk + jnp.arange(bk)
        visible = visible_keys(pos[:, None], slot[None, :], window)[None, :, None]  # [1,C,1,bk]
        scores = attention_scores(qg, k_blk, scale, softcap, spec="GCRK,GCSK->GCRS")
        return online_softmax.step(state, scores, v_blk, visible, "GCRS,GCSK->GCRK")

    state = jax.lax.fori_loop(lo, hi, kv_step, online_softmax.start(
        (g, c, h // g), kd, at_least_float32(q.dtype)))
    out, lse = online_softmax.finish(state, jnp.inf)  # every token sees its own slot: l > 0
    if sinks is not None:                                 # [G, C, R, K] . [G, 1, R]
        out = online_softmax.sink_rescale(out, lse, sinks.reshape(g, 1, h // g))
    return jnp.swapaxes(out, 0, 1).reshape(c, h, kd).astype(dtype)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                    cache: PagedKV, *, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None, sinks: jax.Array | None = None,
                    block: int = PAGED_BLOCK,
                    chunk: int = TOKEN_CHUNK) -> tuple[jax.Array, PagedKV]:
    """Attention of the step's tokens against their sequences' pages, after writing their keys
    and values; what each token attends is what `layers.cached_attention_naive` attends for
    its sequence (logical slots <= its position, inside the `window`).

    q [D, N, H, K]; k, v [D, N, G, K]; positions int32 [D, N]; cache one layer's `PagedKV`.
    The tokens are taken `chunk` at a time (`lax.map`), each chunk reading its tokens' pages
    `block` logical slots at a time with an online softmax up to the chunk's own largest
    position: temporaries [G, chunk, block, K], and about each token's own length read when
    the places are sorted by position. `sinks` [H]: attention sinks
    (`online_softmax.sink_rescale`). Returns (out [D, N, H, K], updated cache).
    """
    d, n, h, kd = q.shape
    cache = write_pages(k, v, positions, cache)
    p, m = cache.page_size, cache.token_pages.shape[-1]
    per_block = max(1, min(block // p, m))
    blocks = -(-m // per_block)
    c = min(chunk, n)
    chunks = -(-n // c)
    pages = jnp.pad(cache.token_pages, ((0, 0), (0, chunks * c - n), (0, blocks * per_block - m)))
    pos = jnp.pad(positions, ((0, 0), (0, chunks * c - n)))      # pad places: position 0
    qc = jnp.pad(q, ((0, 0), (0, chunks * c - n), (0, 0), (0, 0)))
    attend = functools.partial(_chunk_attention, kv_heads=k.shape[2], window=window, scale=scale,
                               softcap=softcap, sinks=sinks, per_block=per_block, dtype=v.dtype)

    def group(q_d, pos_d, pages_d, pool_k, pool_v):             # one data group, chunk by chunk
        return jax.lax.map(lambda x: attend(*x, pool_k, pool_v),
                           (q_d.reshape(chunks, c, h, kd), pos_d.reshape(chunks, c),
                            pages_d.reshape(chunks, c, -1)))
    out = jax.vmap(group)(qc, pos, pages, cache.k[cache.layer],
                          cache.v[cache.layer])                          # [D, chunks, c, H, K]
    return out.reshape(d, chunks * c, h, kd)[:, :n], cache


def is_paged(cache: Any) -> bool:
    return isinstance(cache, PagedKV)


__all__ = ["NULL_PAGE", "PAGED_BLOCK", "PagedKV", "TOKEN_CHUNK", "is_paged", "paged_attention",
           "write_pages"]
