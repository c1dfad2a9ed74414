"""Attention sinks (gpt-oss's learned per-head logit in every row's softmax, its column dropped)
through every route that takes them, against a float64 numpy softmax-with-sink computed here
with its gradient derived by hand: the naive route (`online_softmax.sink_softmax`), blockwise
(`online_softmax.sink_rescale` from the logsumexp, differentiated through the custom backward's
lse cotangent), the dense and paged KV-cache decode and prefill, and ring, all-gather and
Ulysses sequence parallelism on a 2-device mesh; outputs and gradients (q, k, v, sinks) within
1e-5 in float32. The routes that cannot take sinks refuse them by name. And the blockwise
forward + backward with sinks stays memory-linear in T."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from zeroxla.models.attention import attention, cached_attention, choose
from zeroxla.models.blockwise_attention import blockwise_attention
from zeroxla.models.layers import init_kv_cache
from zeroxla.models.paged_attention import NULL_PAGE, PagedKV
from zeroxla.models.sequence_parallel import SequenceParallel, zigzag_order

B, H, G, K = 2, 4, 2, 8
TOL = 1e-5


def _reference(q, k, v, sinks, d_out, q_pos=None, window=None):
    """float64 softmax over [scores, sink] with the sink's column dropped, and its gradients.
    q [B, T, H, K] at positions q_pos [T] (default 0..T-1), k, v [B, S, G, K] at 0..S-1,
    sinks [H], d_out [B, T, H, K] -> out, (dq, dk, dv, dsinks)."""
    q, k, v, sinks, d_out = (np.asarray(x, np.float64) for x in (q, k, v, sinks, d_out))
    t, s = q.shape[1], k.shape[1]
    q_pos = np.arange(t) if q_pos is None else np.asarray(q_pos)
    key_pos = np.arange(s)
    visible = key_pos[None, :] <= q_pos[:, None]                              # [T, S]
    if window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    rep = H // G
    kh, vh = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)            # [B, S, H, K]
    scores = np.einsum("bthk,bshk->bhts", q, kh) / np.sqrt(K)
    scores = np.where(visible, scores, -np.inf)
    logits = np.concatenate([scores, np.broadcast_to(sinks[None, :, None, None],
                                                     scores.shape[:3] + (1,))], axis=-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    p, p_sink = probs[..., :-1], probs[..., -1]                              # [B,H,T,S], [B,H,T]
    out = np.einsum("bhts,bshk->bthk", p, vh)
    # d out_t = Σ_s p_ts v_s; d p_ts / d z_u = p_ts (δ_su - p_tu) over z = [scores, sink].
    dp = np.einsum("bthk,bshk->bhts", d_out, vh)
    row = np.einsum("bthk,bthk->bht", d_out, out)                            # Σ_s p_ts dp_ts
    ds = p * (dp - row[..., None])
    d_sinks = -(p_sink * row).sum(axis=(0, 2))                               # [H]
    dq = np.einsum("bhts,bshk->bthk", ds, kh) / np.sqrt(K)
    dkh = np.einsum("bhts,bthk->bshk", ds, q) / np.sqrt(K)
    dvh = np.einsum("bhts,bthk->bshk", p, d_out)
    fold = lambda x: x.reshape(x.shape[0], s, G, rep, K).sum(3)              # noqa: E731
    return out, (dq, fold(dkh), fold(dvh), d_sinks)


def _inputs(t, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, cot = (rng.standard_normal(shape) for shape in
                    [(B, t, H, K), (B, t, G, K), (B, t, G, K), (B, t, H, K)])
    sinks = rng.standard_normal(H) + 1.0          # comparable to the scores: weights that matter
    return q, k, v, sinks, cot


def _check(fn, inputs, **reference_options):
    """fn(q, k, v, sinks) in float32 (jit, value and gradients) against `_reference`."""
    q, k, v, sinks, cot = inputs
    want, want_grads = _reference(q, k, v, sinks, cot, **reference_options)

    def loss(q, k, v, sinks):
        out = fn(q, k, v, sinks)
        return jnp.sum(out * jnp.asarray(cot, jnp.float32)), out

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, sinks)]
    (_, got), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*f32)
    for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks"), (got, *grads), (want, *want_grads)):
        err = float(np.max(np.abs(np.asarray(a, np.float64) - w)))
        assert err <= TOL * max(1.0, float(np.max(np.abs(w)))), (name, err)


@pytest.mark.parametrize("route,window", [("naive", None), ("blockwise", None),
                                          ("blockwise", 7)])
def test_attention_routes_equal_the_float64_softmax_with_sink(route, window):
    inputs = _inputs(40)
    if route == "naive":
        fn = lambda q, k, v, s: attention(q, k, v, sinks=s, window=window,  # noqa: E731
                                          implementation="naive")
    else:      # blocks of 16 and 8: several blocks, a padded last one, the window across them
        fn = lambda q, k, v, s: blockwise_attention(q, k, v, sinks=s, window=window,  # noqa
                                                    q_block=16, kv_block=8)
    _check(fn, inputs, window=window)


def test_a_minus_infinity_sink_is_plain_attention_and_a_padding_row_stays_zero():
    q, k, v, _, _ = (jnp.asarray(x, jnp.float32) for x in _inputs(20))
    segments = jnp.asarray(np.r_[np.ones(15), np.zeros(5)][None].repeat(B, 0), jnp.int32)
    plain = attention(q, k, v, segment_ids=segments, implementation="blockwise")
    none = attention(q, k, v, segment_ids=segments, sinks=jnp.full((H,), -jnp.inf),
                     implementation="blockwise")
    np.testing.assert_array_equal(np.asarray(none), np.asarray(plain))
    some = attention(q, k, v, segment_ids=segments, sinks=jnp.zeros((H,)),
                     implementation="blockwise")
    assert float(jnp.max(jnp.abs(some[:, 15:]))) == 0.0


@pytest.mark.parametrize("implementation", ["naive", "blockwise"])
def test_dense_cache_prefill_then_decode(implementation):
    t = 12
    q, k, v, sinks, cot = _inputs(t + 1, seed=1)
    want, _ = _reference(q, k, v, sinks, cot)
    f32 = lambda x: jnp.asarray(x, jnp.float32)                              # noqa: E731
    cache = {name: c[0] for name, c in init_kv_cache(1, B, 32, G, K).items()}
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    run = jax.jit(lambda q, k, v, pos, cache: cached_attention(
        q, k, v, pos, cache, sinks=f32(sinks), implementation=implementation))
    prefill, cache = run(f32(q[:, :t]), f32(k[:, :t]), f32(v[:, :t]), positions, cache)
    step, _ = run(f32(q[:, t:]), f32(k[:, t:]), f32(v[:, t:]),
                  jnp.full((B, 1), t, jnp.int32), cache)
    got = np.concatenate([np.asarray(prefill), np.asarray(step)], axis=1)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_paged_decode_and_prefill_in_one_step():
    """Sequence 0 holds 9 tokens and decodes its 10th; sequence 1's 6-token prompt is
    prefilled in the same step; two filler tokens write into the null page. Pages are
    scattered over the pool."""
    rng = np.random.default_rng(2)
    page, pages, max_pages = 4, 12, 4
    held, prompt = 9, 6
    first = lambda x: x[:1] if x.ndim > 1 else x                          # noqa: E731
    a = [first(x) for x in _inputs(held + 1, seed=3)]                    # sequence 0, B = 1
    b = [first(x) for x in _inputs(prompt, seed=4)]                      # sequence 1
    sinks = a[3]
    tables = [[5, 2, 9], [7, 3]]
    pool_k, pool_v = np.zeros((1, 1, G, pages, page, K)), np.zeros((1, 1, G, pages, page, K))
    for p in range(held):
        pool_k[0, 0, :, tables[0][p // page], p % page] = a[1][0, p]
        pool_v[0, 0, :, tables[0][p // page], p % page] = a[2][0, p]
    tokens = [(0, held)] + [(1, p) for p in range(prompt)]            # (sequence, position)
    n = len(tokens) + 2
    q, k_new, v_new = (rng.standard_normal((1, n, m, K)) for m in (H, G, G))
    positions = np.zeros((1, n), np.int32)
    token_pages = np.full((1, n, max_pages), NULL_PAGE, np.int32)
    for i, (s, p) in enumerate(tokens):
        src = a if s == 0 else b
        q[0, i], k_new[0, i], v_new[0, i] = src[0][0, p], src[1][0, p], src[2][0, p]
        positions[0, i] = p
        token_pages[0, i, :len(tables[s])] = tables[s]
    f32 = lambda x: jnp.asarray(x, jnp.float32)                              # noqa: E731
    cache = PagedKV(f32(pool_k), f32(pool_v), jnp.asarray(token_pages), jnp.int32(0))
    out, _ = jax.jit(lambda *xs: cached_attention(*xs, sinks=f32(sinks)))(
        f32(q), f32(k_new), f32(v_new), jnp.asarray(positions), cache)
    want_a, _ = _reference(a[0][:, held:], a[1], a[2], sinks, a[0][:, held:], q_pos=[held])
    want_b, _ = _reference(b[0], b[1], b[2], sinks, b[0])
    want = np.concatenate([want_a, want_b], axis=1)[0]
    np.testing.assert_allclose(np.asarray(out)[0, :len(tokens)], want, atol=TOL, rtol=0)


DEGREE, CHUNK = 2, 10


def _layout(x, zigzag):
    """[B, T, ...] in sequence order -> the devices' layout (zigzag chunks, or P runs)."""
    if not zigzag:
        return x
    chunks = x.reshape(x.shape[0], 2 * DEGREE, CHUNK, *x.shape[2:])
    return chunks[:, zigzag_order(DEGREE)].reshape(x.shape)


def _unlayout(x, zigzag):
    if not zigzag:
        return x
    chunks = x.reshape(x.shape[0], 2 * DEGREE, CHUNK, *x.shape[2:])
    return chunks[:, np.argsort(zigzag_order(DEGREE))].reshape(x.shape)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_sequence_parallel_attention_with_sinks(strategy):
    sequence = SequenceParallel("sequence", DEGREE, strategy)
    mesh = Mesh(np.asarray(jax.devices()[:DEGREE]), ("sequence",))
    spec = P(None, "sequence")
    sharded = jax.shard_map(lambda q, k, v, s: attention(q, k, v, sinks=s, sequence=sequence),
                            mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec,
                            check_vma=False)

    def fn(q, k, v, sinks):
        zz = sequence.zigzag
        return _unlayout(sharded(*(_layout(x, zz) for x in (q, k, v)), sinks), zz)

    _check(fn, _inputs(2 * DEGREE * CHUNK, seed=5))


def test_routes_without_sinks_refuse_them_by_name():
    q = jnp.zeros((1, 128, H, 16), jnp.bfloat16)
    k = jnp.zeros((1, 128, G, 16), jnp.bfloat16)
    sinks = jnp.zeros((H,))
    for implementation in ("cudnn", "pallas"):
        with pytest.raises(ValueError, match="sinks given"):
            choose(q, k, k, sinks=sinks, implementation=implementation)
    assert choose(q, k, k, sinks=sinks) == "blockwise"
    with pytest.raises(ValueError, match=r"sinks \(3,\) float32 must be float \[H\]"):
        attention(q, k, k, sinks=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="sinks under sequence_parallel_strategy='usp'"):
        attention(q, k, k, sinks=sinks, sequence=SequenceParallel("sequence", 2, "usp"))


# ---- memory: the compiled forward + backward with sinks ------------------------------------

LENGTHS = (1024, 2048, 4096)


def _temp_bytes(t: int) -> int:
    """Temporaries of the compiled d sum(blockwise attention with sinks) / d(q, k, v, sinks) at
    B = 1, H = G = 2, K = 32, blocks of 256."""
    x = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    sinks = jax.ShapeDtypeStruct((2,), jnp.float32)
    loss = lambda q, k, v, s: blockwise_attention(q, k, v, sinks=s, q_block=256,  # noqa: E731
                                                  kv_block=256).sum()
    program = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, x, sinks).compile()
    return program.memory_analysis().temp_size_in_bytes


def test_sink_layer_temporaries_grow_linearly():
    sizes = [_temp_bytes(t) for t in LENGTHS]
    for short, long in zip(sizes, sizes[1:]):
        assert long / short <= 2.1, sizes
