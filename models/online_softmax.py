"""The online softmax (Milakov & Gimelshein 2018; FlashAttention-2, Dao 2023, Algorithm 1): a
softmax over keys that arrive a block at a time, written once for every attention route that
reads keys in blocks (the cached decode `layers.cached_attention`, `blockwise_attention`,
`paged_attention`) and the merge of partial results that ring attention sums over its hops.

A row's partial result over the blocks seen so far is `Running(m, l, acc)`: the running max m
of its visible scores, the denominator l = Σ exp(s - m) and the unnormalised output acc =
Σ exp(s - m) v. `step` adds a block; `finish` gives the normalised output acc / l and the
log-sum-exp m + log l; `merge` combines two finished results over disjoint keys by their
log-sum-exps (jax's `pallas/ops/gpu/decode_attention.py` and MaxText's `normalize_attention`
split the work the same way). `sink_rescale` adds gpt-oss's attention sinks to a finished
result from its log-sum-exp alone, for every route.

Numerics every route shares: everything is kept in the accumulation dtype the caller chooses
(`layers.at_least_float32`: float32, float64 for a float64 verification run), p @ v included
(p is unnormalised and rescaled as the max moves; rounding it to a 16-bit v's dtype biased
bf16 training). A hidden score is the dtype's lowest finite value, never -inf (exp(-inf - -inf)
is nan), and where() zeroes its weight, so a row that sees no key keeps l = 0, acc = 0 and
finishes with output exactly 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Running(NamedTuple):
    """A partial softmax over the blocks seen so far: m, l [..., T] and acc [..., T, K], all in
    the accumulation dtype (a loop carry: a pytree)."""

    m: jax.Array          # running max of the visible scores (the dtype's lowest: none yet)
    l: jax.Array          # Σ exp(s - m) over the visible scores
    acc: jax.Array        # Σ exp(s - m) v, unnormalised


def start(rows: tuple[int, ...], head_dim: int, dtype: Any) -> Running:
    """Nothing seen yet, for rows of shape `rows` (e.g. [B, G, R, T]) and values of `head_dim`,
    in the accumulation `dtype`."""
    return Running(jnp.full(rows, jnp.finfo(dtype).min, dtype), jnp.zeros(rows, dtype),
                   jnp.zeros(rows + (head_dim,), dtype))


def step(state: Running, scores: jax.Array, values: jax.Array, visible: jax.Array,
         spec: str) -> Running:
    """`state` with one block added: scores [..., T, S] in the accumulation dtype, `visible`
    bool broadcasting against them (False: the key is not attended), `values` the block's
    values, laid out for the einsum `spec` of p [..., T, S] . values -> [..., T, K] (e.g.
    "BGRTS,BSGK->BGRTK")."""
    m, l, acc = state
    dtype = m.dtype
    scores = jnp.where(visible, scores, jnp.finfo(dtype).min)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)              # rescales what was summed under the old max
    pv = jnp.einsum(spec, p, values.astype(dtype), preferred_element_type=dtype)
    return Running(m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv)


def finish(state: Running, empty_lse: float) -> tuple[jax.Array, jax.Array]:
    """(out [..., T, K] = acc / l, lse [..., T] = m + log l), in the accumulation dtype. A row
    that saw no key gets out 0 and lse `empty_lse`: +inf where a backward computes
    exp(s - lse) (0 there), -inf where partial results are `merge`d (no weight)."""
    m, l, acc = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    return acc / l_safe[..., None], jnp.where(seen, m + jnp.log(l_safe), empty_lse)


def merge(out: jax.Array, lse: jax.Array, other: jax.Array,
          other_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The softmax over two disjoint key sets from each one's `finish`ed (out [..., K],
    lse [...]; lse -inf: no key seen): o = Σ o_i exp(lse_i - lse), lse = log Σ exp(lse_i).
    A row neither saw gets out 0 and lse -inf."""
    total = jnp.logaddexp(lse, other_lse)
    safe = jnp.where(jnp.isfinite(total), total, 0.0)

    def weight(x):                                   # [...] -> [..., 1]
        return jnp.exp(x - safe)[..., None]
    return out * weight(lse) + other * weight(other_lse), total


def sink_rescale(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """A finished softmax (out [..., K], lse [...]) with one more logit per row, the learned
    attention sink (gpt-oss; Xiao et al. 2023), in the softmax and its column dropped:
    out * sigmoid(lse - sink) = out * Σ exp(s) / (Σ exp(s) + exp(sink)). `sinks` broadcasts
    against lse. From the log-sum-exp alone (torchtitan's `apply_attention_sink_rescale`), so a
    route's memory-linear backward needs only the cotangent of its lse. A row that saw no key
    (lse ±inf, out 0) stays 0. Returns out's dtype."""
    weight = jax.nn.sigmoid(lse - sinks.astype(lse.dtype))                # [...]
    return (out * weight[..., None]).astype(out.dtype)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """softmax(scores [B, G, R, T, S]) over S; with `sinks` [H = G * R], the softmax over
    [scores, sink] with the sink's column dropped, computed directly (transformers' gpt_oss
    `eager_attention_forward`): the naive routes' reference for `sink_rescale`."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    b, g, r, t, _ = scores.shape
    sink = jnp.broadcast_to(sinks.astype(scores.dtype).reshape(1, g, r, 1, 1), (b, g, r, t, 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


__all__ = ["Running", "finish", "merge", "sink_rescale", "sink_softmax", "start", "step"]
