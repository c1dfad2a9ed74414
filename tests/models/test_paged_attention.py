"""Paged attention (`models.paged_attention`) against a float64 numpy computation of what each
token attends: its own sequence's keys at positions <= its own (and inside a sliding window),
read through a page table whose pages are scattered over the pool, with decode tokens and a
prompt chunk of another sequence in one step, filler tokens on the null page, GQA, soft-capping
and reads longer than one block (across block boundaries, from tokens at a block start). The
engine-level comparisons against the static decode are in
tests/zeroxla/inference/test_continuous.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.models.paged_attention import NULL_PAGE, PagedKV, paged_attention

H, G, K, PAGE = 4, 2, 8, 4


def _reference(q, keys, values, pos, window, softcap):
    """float64: q [H, K] of one token over its sequence's keys/values [S, G, K]."""
    out = np.zeros((H, K))
    for h in range(H):
        g = h // (H // G)
        s = keys[:pos + 1, g] @ q[h] / np.sqrt(K)
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        lo = 0 if window is None else max(0, pos - window + 1)
        s = s[lo:]
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ values[lo:pos + 1, g]
    return out


def _step_tokens(rng, tokens, tables, seq_keys, seq_values, n, max_pages):
    """This step's inputs for `tokens` [(sequence, position)] and n - len(tokens) fillers on
    the null page: q [1, n, H, K], the new keys and values [1, n, G, K] (also written into
    `seq_keys` / `seq_values` at their positions, as the reference reads them), positions
    [1, n] and each token's page table [1, n, max_pages]."""
    q = rng.normal(size=(1, n, H, K))
    k_new, v_new = rng.normal(size=(1, n, G, K)), rng.normal(size=(1, n, G, K))
    positions = np.zeros((1, n), np.int32)
    token_pages = np.full((1, n, max_pages), NULL_PAGE, np.int32)
    for i, (s, p) in enumerate(tokens):
        positions[0, i] = p
        token_pages[0, i, :len(tables[s])] = tables[s]
        seq_keys[s][p], seq_values[s][p] = k_new[0, i], v_new[0, i]
    return q, k_new, v_new, positions, token_pages


@pytest.mark.parametrize("window,softcap,block,chunk", [(None, None, 512, 8),
                                                        (5, 3.0, 8, 3)],
                         ids=["causal", "window-softcap-small-blocks-and-chunks"])
def test_paged_attention_is_each_tokens_own_sequence(window, softcap, block, chunk):
    rng = np.random.default_rng(0)
    pages, max_pages = 24, 6
    # three sequences already holding 9, 14 and 0 tokens; this step: one decode token each
    # for the first two, a 7-token prompt chunk of the third, 3 filler tokens
    held = [9, 14, 0]
    order = rng.permutation(np.arange(1, pages))               # pages scattered, null excluded
    tables = [list(order[:4]), list(order[4:8]), list(order[8:10])]
    seq_keys = [rng.normal(size=(24, G, K)) for _ in held]
    seq_values = [rng.normal(size=(24, G, K)) for _ in held]
    # two layers, the attention in layer 1; garbage everywhere else
    pool_k = rng.normal(size=(2, 1, G, pages, PAGE, K))
    pool_v = rng.normal(size=(2, 1, G, pages, PAGE, K))
    for s, n in enumerate(held):
        for p in range(n):
            pool_k[1, 0, :, tables[s][p // PAGE], p % PAGE] = seq_keys[s][p]
            pool_v[1, 0, :, tables[s][p // PAGE], p % PAGE] = seq_values[s][p]
    tokens = [(0, 9), (1, 14)] + [(2, p) for p in range(7)]      # (sequence, position)
    n = len(tokens) + 3
    q, k_new, v_new, positions, token_pages = _step_tokens(rng, tokens, tables, seq_keys,
                                                           seq_values, n, max_pages)
    f32 = lambda x: jnp.asarray(x, jnp.float32)                 # noqa: E731
    out, cache = paged_attention(f32(q), f32(k_new), f32(v_new), jnp.asarray(positions),
                                 PagedKV(f32(pool_k), f32(pool_v), jnp.asarray(token_pages),
                                         jnp.int32(1)),
                                 window=window, softcap=softcap, block=block, chunk=chunk)
    for i, (s, p) in enumerate(tokens):
        want = _reference(q[0, i], seq_keys[s], seq_values[s], p, window, softcap)
        np.testing.assert_allclose(np.asarray(out[0, i]), want, atol=2e-5, rtol=2e-5)
        page, slot = tables[s][p // PAGE], p % PAGE            # written where it belongs
        np.testing.assert_array_equal(np.asarray(cache.k[1, 0, :, page, slot]),
                                      np.asarray(f32(k_new[0, i])))
    untouched = np.setdiff1d(np.arange(1, pages), np.concatenate(tables))
    np.testing.assert_array_equal(np.asarray(cache.k[1, 0, :, untouched]),
                                  np.asarray(f32(pool_k[1, 0, :, untouched])))
    np.testing.assert_array_equal(np.asarray(cache.k[0]), np.asarray(f32(pool_k[0])))
    assert np.all(np.isfinite(np.asarray(out)))                 # fillers too


def test_a_model_decodes_pages_as_it_decodes_its_dense_cache():
    """A Llama's logits through a paged cache (pages out of order, a page size that does not
    divide the prompt) equal its logits through the dense cache, prompt and next token."""
    from flax import nnx
    from zeroxla.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny().replace(init_std=0.2), rngs=nnx.Rngs(0))
    c = model.config
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, c.vocab_size, (1, 6)), jnp.int32)
    dense = model.init_cache(1, 16)
    logits, dense = model.decode(prompt, jnp.arange(6)[None], dense)
    nxt, _ = model.decode(jnp.array([[3]]), jnp.array([[6]]), dense)
    pool = jnp.zeros((c.num_layers, 1, c.num_kv_heads, 8, PAGE, c.head_dim))
    table = jnp.array([5, 2, 7, 0], jnp.int32)                  # pages 5, 2: the prompt

    def paged(tokens, positions, pools):
        pages = jnp.broadcast_to(table, (1, tokens.shape[1], 4))
        return model.decode(tokens, positions, PagedKV(*pools, pages))

    p_logits, cache = paged(prompt, jnp.arange(6)[None], (pool, pool))
    p_next, _ = paged(jnp.array([[3]]), jnp.array([[6]]), (cache.k, cache.v))
    np.testing.assert_allclose(np.asarray(p_logits), np.asarray(logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(p_next), np.asarray(nxt), atol=1e-5, rtol=1e-5)
    assert jax.tree.structure(cache) == jax.tree.structure(PagedKV(pool, pool, table))


# Issue 66: key blocks of 8 slots (2 pages of 4); every token's read crosses block boundaries
# and tokens sit exactly at block starts (8, 16, 24, 32: the last block a token reads holds
# only itself) and at block ends (15, 23), with windows starting at a block start (15 - 8 + 1)
# and one slot before it (22 - 8 + 1).
BLOCK = 8


@pytest.mark.parametrize("window,chunk", [(None, 1), (None, 3), (8, 1), (9, 3)])
def test_reads_across_key_blocks_and_from_a_block_start(window, chunk):
    rng = np.random.default_rng(1)
    # (held before the step, positions fed this step): a prompt chunk 16..24 and single
    # decode tokens at a block start (8, 32) and a block end (15)
    feeds = [(16, list(range(16, 25))), (8, [8]), (15, [15]), (32, [32])]
    pages, max_pages = 28, 10
    order = rng.permutation(np.arange(1, pages))                 # pages scattered
    tables, used = [], 0
    for _, fed in feeds:
        count = -(-(fed[-1] + 1) // PAGE)
        tables.append(list(order[used:used + count]))
        used += count
    seq_keys = [rng.normal(size=(40, G, K)) for _ in feeds]
    seq_values = [rng.normal(size=(40, G, K)) for _ in feeds]
    pool_k = rng.normal(size=(1, 1, G, pages, PAGE, K))           # garbage where nothing lies
    pool_v = rng.normal(size=(1, 1, G, pages, PAGE, K))
    for s, (held, _) in enumerate(feeds):
        for p in range(held):
            pool_k[0, 0, :, tables[s][p // PAGE], p % PAGE] = seq_keys[s][p]
            pool_v[0, 0, :, tables[s][p // PAGE], p % PAGE] = seq_values[s][p]
    tokens = [(s, p) for s, (_, fed) in enumerate(feeds) for p in fed]
    n = len(tokens) + 2                                            # two fillers
    q, k_new, v_new, positions, token_pages = _step_tokens(rng, tokens, tables, seq_keys,
                                                           seq_values, n, max_pages)
    f32 = lambda x: jnp.asarray(x, jnp.float32)                 # noqa: E731
    out, _ = paged_attention(f32(q), f32(k_new), f32(v_new), jnp.asarray(positions),
                             PagedKV(f32(pool_k), f32(pool_v), jnp.asarray(token_pages)),
                             window=window, block=BLOCK, chunk=chunk)
    for i, (s, p) in enumerate(tokens):
        want = _reference(q[0, i], seq_keys[s], seq_values[s], p, window, None)
        np.testing.assert_allclose(np.asarray(out[0, i]), want, atol=2e-5, rtol=2e-5,
                                   err_msg=f"token at position {p}")
    assert np.all(np.isfinite(np.asarray(out)))
