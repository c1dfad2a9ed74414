"""Memory-linear causal attention: FlashAttention-2's blockwise algorithm in plain JAX.

`blockwise_attention` computes what `layers.causal_attention` computes (grouped-query heads,
sliding window, scale, Gemma 2 soft-capping) plus packed sequences (`segment_ids`), without ever
holding a [T, S] score tensor: the compiled program's temporaries grow linearly in T, not as T².

Forward (FlashAttention-2, Dao 2023, Algorithm 1): a `lax.scan` over query blocks; per query
block a loop over only the key/value blocks the causal mask and the sliding window leave visible,
with an online softmax (running max `m`, running sum `l`). It keeps the output and one logsumexp
per query row. Backward (Algorithm 2), a `jax.custom_vjp`: a scan over key/value blocks, per
block a loop over the query blocks that can see it, recomputing the scores from q, k and the
saved logsumexp: P = exp(S - lse), dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - D) with D = rowsum(dO O),
times the soft-cap's derivative 1 - tanh², then dQ = dS K and dK = dSᵀ Q (summed over the query
heads of a group, for GQA). The logsumexp is an output too, with its own cotangent dL: since
d lse / dS = P, it enters as D - dL, so attention sinks (`online_softmax.sink_rescale`, a
function of out and lse) are differentiated by JAX outside, memory-linear as the rest.

Both read 16-bit q, k, v and dO blocks through their bits and write their stacked outputs into
buffers made inside the layer loop (`layers.as_bits`, `layers.scan_stacked`): XLA:CPU would
otherwise hold float32 images of them, and zero buffers hoisted out of the layer loop.

Lengths that are not a multiple of a block are padded to one inside; the padded keys lie after
every real query, so the causal mask hides them, and the padded queries' rows are cut away.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import layers, online_softmax

# Segment id of padding in `segment_ids` (`layers.PAD_SEGMENT`, MaxText's convention): such a
# query attends to no key, its output is zeros and no gradient flows through it.
PAD_SEGMENT = layers.PAD_SEGMENT

# Block sizes. The per-step temporaries are a few [B, H, q_block, kv_block] float32 blocks
# (16 MiB each for 16 heads at 512 x 512), independent of T; larger blocks mean fewer loop trips
# (each costs a little on CPU) but more work wasted on the diagonal blocks the causal mask half
# hides. Rabe & Staats use 1024-query / 4096-key chunks, FlashAttention-2 128 x 128 tiles.
Q_BLOCK = 512
KV_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static half of one call (hashable: `custom_vjp`'s non-differentiable argument).
    `q_block` / `kv_block` are the block sizes actually used (at most T)."""

    window: int | None
    scale: float | None
    softcap: float | None
    q_block: int
    kv_block: int


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                        scale: float | None = None, softcap: float | None = None,
                        segment_ids: jax.Array | None = None, sinks: jax.Array | None = None,
                        q_block: int = Q_BLOCK, kv_block: int = KV_BLOCK) -> jax.Array:
    """Causal softmax attention with grouped-query heads, computed block by block.

    q [B, T, H, K], k and v [B, T, G, K] with H a multiple of G -> [B, T, H, K] in v's dtype,
    equal to `layers.causal_attention(q, k, v, window=, scale=, softcap=)` (sliding `window`:
    `layers.visible_keys`; `scale` (a Python float, default 1/sqrt(K)) and `softcap`:
    `layers.attention_scores`). Scores and softmax in float32 (float64 for float64 input).

    `segment_ids` int [B, T] packs several sequences in a row: a query attends only to keys of
    its own segment (on top of the causal mask and window). Segment `PAD_SEGMENT` (0) is
    padding: its queries attend to nothing, give zeros and pass no gradient.

    `sinks` [H] (float): gpt-oss's learned attention sinks, applied from the logsumexp
    (`online_softmax.sink_rescale`); their gradient flows.

    `q_block` / `kv_block`: the block sizes (clipped to T); T need not be a multiple of them.
    """
    _check(q, k, v, window, segment_ids, q_block, kv_block)
    return blockwise_attention_at(q, k, v, 0, window=window, scale=scale, softcap=softcap,
                                  q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                  sinks=sinks, q_block=q_block, kv_block=kv_block)


def blockwise_attention_at(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array | int,
                           *, window: int | None = None, scale: float | None = None,
                           softcap: float | None = None, q_segment_ids: jax.Array | None = None,
                           kv_segment_ids: jax.Array | None = None,
                           sinks: jax.Array | None = None, q_block: int = Q_BLOCK,
                           kv_block: int = KV_BLOCK) -> jax.Array:
    """`blockwise_attention` of queries q [B, Tq, H, K] at positions q_offset .. q_offset + Tq - 1
    (`q_offset` an int or a traced int32 scalar, with q_offset + Tq <= Tk) against keys and
    values k, v [B, Tk, G, K] at 0 .. Tk - 1 -> [B, Tq, H, K]: one chunk of a sequence's queries
    against the whole sequence's keys (context parallelism). Only the key blocks the chunk's
    causal mask and window leave visible are visited. `q_segment_ids` [B, Tq] and
    `kv_segment_ids` [B, Tk] are given together or not at all; `sinks` [H] as
    `blockwise_attention`'s."""
    b, tq, h, d = q.shape
    t_k, g = k.shape[1], k.shape[2]
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids are given together or not at all")
    bq, bk = min(q_block, tq), min(kv_block, t_k)
    tq_pad, tk_pad = _round_up(tq, bq), _round_up(t_k, bk)
    plan = _Plan(window, scale, softcap, bq, bk)
    qg = _pad_time(q.reshape(b, tq, g, h // g, d), tq_pad)                # [B, Tq, G, R, K]
    kp, vp = _pad_time(k, tk_pad), _pad_time(v, tk_pad)                   # [B, Tk, G, K]
    segments = None
    if q_segment_ids is not None:                                         # [B, Tq], [B, Tk]
        segments = (_pad_time(q_segment_ids.astype(jnp.int32), tq_pad, PAD_SEGMENT),
                    _pad_time(kv_segment_ids.astype(jnp.int32), tk_pad, PAD_SEGMENT))
    offset = jnp.asarray(q_offset, jnp.int32)
    out, lse = _attention(qg, kp, vp, segments, offset, plan)   # [B, Tq, G, R, K], [B, G, R, Tq]
    if sinks is not None:
        out = online_softmax.sink_rescale(out, jnp.moveaxis(lse, 3, 1), sinks.reshape(g, h // g))
    return out[:, :tq].reshape(b, tq, h, d)


def _check(q, k, v, window, segment_ids, q_block, kv_block) -> None:
    """ValueError naming the argument, its value and the fix, for shapes the function does not
    take."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q {q.shape} must be [B, T, H, K] and k {k.shape} [B, T, G, K]")
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d:
        raise ValueError(f"k {k.shape} and v {v.shape} must both be [B, T, G, K] with q's "
                         f"B, T, K (q {q.shape})")
    if h % k.shape[2]:
        raise ValueError(f"q's {h} heads are not a multiple of k's {k.shape[2]} heads; GQA "
                         "needs H = G * R")
    if window is not None and window < 1:
        raise ValueError(f"window={window}: use a window of at least 1 token, or None")
    for name, size in (("q_block", q_block), ("kv_block", kv_block)):
        if size < 1:
            raise ValueError(f"{name}={size}: a block holds at least 1 token")
    if segment_ids is not None and (segment_ids.shape != (b, t)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids {segment_ids.shape} {segment_ids.dtype} must be int "
                         f"[B, T] = {(b, t)}")


def _block(bits: jax.Array, start, size: int, axis: int, dtype) -> jax.Array:
    """The `size` entries from `start` along `axis` of an array read through its bits
    (`layers.as_bits`), as `dtype`."""
    return layers.from_bits(lax.dynamic_slice_in_dim(bits, start, size, axis), dtype)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _pad_time(x: jax.Array, length: int, value: int = 0) -> jax.Array:
    """`x` padded along dim 1 (time) to `length` with `value`."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, segments, offset, plan):
    """q [B, Tq, G, R, K] at positions offset + (0 .. Tq - 1), k and v [B, Tk, G, K] (Tq, Tk
    multiples of the plan's blocks), segments (q's [B, Tq], k's [B, Tk]) or None -> (out
    [B, Tq, G, R, K], lse [B, G, R, Tq]) (`_forward`)."""
    return _forward(q, k, v, segments, offset, plan)


def _attention_fwd(q, k, v, segments, offset, plan):
    out, lse = _forward(q, k, v, segments, offset, plan)
    return (out, lse), (q, k, v, segments, offset, out, lse)


def _attention_bwd(plan, residuals, cotangents):
    q, k, v, segments, offset, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(q, k, v, segments, offset, out, lse, d_out, plan, d_lse=d_lse)
    return dq, dk, dv, None, None      # segment ids and the offset are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def _visible(plan: _Plan, q_start, k_start, segments, offset) -> jax.Array:
    """Which keys of the block at `k_start` the queries of the block at `q_start` (positions
    offset + q_start ..) attend: bool [B or 1, 1, 1, bq, bk] (broadcasts against scores
    [B, G, R, bq, bk])."""
    q_pos = offset + q_start + jnp.arange(plan.q_block)                   # [bq]
    k_pos = k_start + jnp.arange(plan.kv_block)                           # [bk]
    visible = layers.visible_keys(q_pos[:, None], k_pos[None, :], plan.window)[None]
    if segments is not None:
        seg_q = lax.dynamic_slice_in_dim(segments[0], q_start, plan.q_block, 1)   # [B, bq]
        seg_k = lax.dynamic_slice_in_dim(segments[1], k_start, plan.kv_block, 1)  # [B, bk]
        visible = (visible & (seg_q[:, :, None] == seg_k[:, None, :])
                   & (seg_q != PAD_SEGMENT)[:, :, None])                # [B, bq, bk]
    return visible[:, None, None]


def _kv_range(plan: _Plan, i, num_kv_blocks: int, offset) -> tuple[jax.Array, jax.Array]:
    """The key/value blocks [lo, hi) query block `i` can see: up to its last query (causal)
    and, with a window, from its first query's first visible key (first query - window + 1)."""
    bq, bk = plan.q_block, plan.kv_block
    first = offset + i * bq                                               # its first position
    hi = jnp.minimum(num_kv_blocks, (first + bq - 1) // bk + 1)
    lo = 0 if plan.window is None else jnp.maximum(0, (first - plan.window + 1) // bk)
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def _query_range(plan: _Plan, j, num_q_blocks: int, offset) -> tuple[jax.Array, jax.Array]:
    """The query blocks [lo, hi) that can see key/value block `j`: from its first key on
    (causal) and, with a window, up to its last key + window - 1."""
    bq, bk = plan.q_block, plan.kv_block
    lo = jnp.clip((j * bk - offset) // bq, 0, num_q_blocks)
    hi = num_q_blocks
    if plan.window is not None:
        hi = jnp.clip(((j + 1) * bk + plan.window - 2 - offset) // bq + 1, 0, num_q_blocks)
    return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


def blocks_visited(q_len: int, kv_len: int, q_offset: int, *, window: int | None = None,
                   q_block: int = Q_BLOCK, kv_block: int = KV_BLOCK) -> int:
    """How many (query block, key block) pairs the forward of `blockwise_attention_at` visits
    for these lengths: the loop bounds it runs (`_kv_range`), counted (load balance)."""
    bq, bk = min(q_block, q_len), min(kv_block, kv_len)
    plan = _Plan(window, None, None, bq, bk)
    nk = _round_up(kv_len, bk) // bk
    return sum(int(hi) - int(lo) for lo, hi in (
        _kv_range(plan, i, nk, q_offset) for i in range(_round_up(q_len, bq) // bq)))


def _forward(q, k, v, segments, offset, plan: _Plan,
             cast: bool = True) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tq, G, R, K] in v's dtype, lse [B, G, R, Tq]): the online softmax over the
    visible key/value blocks of each query block. A row that sees no key (padding) gets
    out 0 and lse +inf, so the backward's exp(s - lse) is 0 there. `offset`: the queries'
    first position less the keys' (causal mask and window see relative positions only);
    `cast` False: out in the accumulation dtype (float32 or float64)."""
    b, tq, g, r, d = q.shape
    bq, bk = plan.q_block, plan.kv_block
    acc_dtype = layers.at_least_float32(q.dtype)
    q_bits, k_bits, v_bits = layers.as_bits(q), layers.as_bits(k), layers.as_bits(v)

    def query_block(_, i):
        q_blk = _block(q_bits, i * bq, bq, 1, q.dtype)                    # [B, bq, G, R, K]

        def kv_step(j, state):                     # m, l [B, G, R, bq], acc [B, G, R, bq, K]
            k_blk = _block(k_bits, j * bk, bk, 1, k.dtype)                # [B, bk, G, K]
            v_blk = _block(v_bits, j * bk, bk, 1, v.dtype)
            s = layers.attention_scores(q_blk, k_blk, plan.scale, plan.softcap)  # [B,G,R,bq,bk]
            # p @ v in float32 (`online_softmax`): rounding p to a 16-bit v's dtype biased bf16
            # training (gpt-tiny, ZeRO-2: parameters travelled 0.96e-3 less than float32's;
            # 1.3e-4 in float32, as the naive path).
            visible = _visible(plan, i * bq, j * bk, segments, offset)
            return online_softmax.step(state, s, v_blk, visible, "BGRQS,BSGK->BGRQK")

        state = lax.fori_loop(*_kv_range(plan, i, k.shape[1] // bk, offset), kv_step,
                              online_softmax.start((b, g, r, bq), d, acc_dtype))
        out, lse = online_softmax.finish(state, jnp.inf)   # +inf: exp(s - lse) = 0 backward
        out = jnp.einsum("BGRQK->BQGRK", out)
        out = out.astype(v.dtype) if cast else out
        return None, (out, lse)

    _, (out, lse) = layers.scan_stacked(query_block, None, tq // bq, after=q_bits)
    out = jnp.moveaxis(out, 0, 1).reshape(b, tq, g, r, d)                # [nq, B, bq, ...] ->
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, g, r, tq)                    # [nq, B, G, R, bq] ->
    return out, lse


def _backward(q, k, v, segments, offset, out, lse, d_out, plan: _Plan, cast: bool = True,
              d_lse=None):
    """(dq, dk, dv) in the inputs' dtypes: FlashAttention-2's backward, one scan over key/value
    blocks (each accumulating its own dk, dv) and, per block, a loop over the query blocks that
    see it (adding into dq, carried whole: [B, Tq, G, R, K], linear in T). `cast` False: in
    the float32 (float64) accumulation dtype, for a caller that sums several (the ring).

    `offset` is the queries' first position less the keys' first position (negative for keys
    after the queries' start), `out` and `lse` the rows' whole attention and logsumexp: with
    keys that are one part of what the rows attend (ring attention), these are that part's
    exact gradients, P = exp(S - lse) being the rows' true softmax over it. `d_lse`
    [B, G, R, Tq] or None: the cotangent of the rows' lse (module docstring)."""
    b, tq, g, r, d = q.shape
    tk = k.shape[1]
    bq, bk = plan.q_block, plan.kv_block
    acc_dtype = layers.at_least_float32(q.dtype)
    scale = 1.0 / math.sqrt(d) if plan.scale is None else plan.scale
    delta = jnp.einsum("BQGRK,BQGRK->BGRQ", d_out.astype(acc_dtype),
                       out.astype(acc_dtype))                             # D: [B, G, R, Tq]
    if d_lse is not None:                            # d lse / dS = P: dS = P (dP - D + dL)
        delta = delta - d_lse.astype(acc_dtype)
    q_bits, k_bits, v_bits = layers.as_bits(q), layers.as_bits(k), layers.as_bits(v)
    do_bits = layers.as_bits(d_out)

    def kv_block(dq, j):
        k_blk = _block(k_bits, j * bk, bk, 1, k.dtype)                    # [B, bk, G, K]
        v_blk = _block(v_bits, j * bk, bk, 1, v.dtype)

        def q_step(i, carry):
            dq, dk, dv = carry                     # [B, Tq, G, R, K], [B, bk, G, K] x2
            q_blk = _block(q_bits, i * bq, bq, 1, q.dtype)                # [B, bq, G, R, K]
            do_blk = _block(do_bits, i * bq, bq, 1, d_out.dtype)
            lse_blk = lax.dynamic_slice_in_dim(lse, i * bq, bq, 3)        # [B, G, R, bq]
            delta_blk = lax.dynamic_slice_in_dim(delta, i * bq, bq, 3)
            s = layers.attention_scores(q_blk, k_blk, plan.scale, plan.softcap)  # [B,G,R,bq,bk]
            p = jnp.where(_visible(plan, i * bq, j * bk, segments, offset),
                          jnp.exp(s - lse_blk[..., None]), 0.0)
            dv = dv + jnp.einsum("BGRQS,BQGRK->BSGK", p, do_blk.astype(acc_dtype))
            dp = jnp.einsum("BQGRK,BSGK->BGRQS", do_blk.astype(acc_dtype),
                            v_blk.astype(acc_dtype))
            ds = p * (dp - delta_blk[..., None])
            if plan.softcap is not None:           # d/dx c tanh(x / c) = 1 - tanh²
                ds = ds * (1.0 - jnp.square(s / plan.softcap))
            ds = ds * scale
            dq_blk = jnp.einsum("BGRQS,BSGK->BQGRK", ds, k_blk.astype(acc_dtype))
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, i * bq, bq, 1) + dq_blk, i * bq, 1)
            dk = dk + jnp.einsum("BGRQS,BQGRK->BSGK", ds, q_blk.astype(acc_dtype))
            return dq, dk, dv

        zeros = jnp.zeros((b, bk, g, d), acc_dtype)
        dq, dk, dv = lax.fori_loop(*_query_range(plan, j, tq // bq, offset), q_step,
                                   (dq, zeros, zeros))
        return dq, ((dk.astype(k.dtype), dv.astype(v.dtype)) if cast else (dk, dv))

    # dq is summed over every key/value block: float32, whole, made after d_out exists (a
    # zeros made in the layer loop is otherwise hoisted out of it, `layers.fresh_zeros`).
    dq, (dk, dv) = layers.scan_stacked(kv_block, layers.fresh_zeros(q.shape, acc_dtype, do_bits),
                                       tk // bk, after=do_bits)
    dk = jnp.moveaxis(dk, 0, 1).reshape(b, tk, g, d)                      # [nk, B, bk, G, K] ->
    dv = jnp.moveaxis(dv, 0, 1).reshape(b, tk, g, d)
    return (dq.astype(q.dtype) if cast else dq), dk, dv
