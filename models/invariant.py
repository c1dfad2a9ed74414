"""Batch-invariant kernels: every per-row reduction summed in one fixed order, whatever the
number of rows, the chunking or the cache length (vLLM's batch-invariant mode, SGLang's
deterministic inference), so a rollout engine's log-probs equal the training forward's bit for
bit (`LlamaConfig.batch_invariant`).

Why not `jnp.dot` / `jnp.sum`: XLA:CPU's dot and reduce pick their summation order from the
shapes. A [M, 60] x [60, 65] dot gives row 0 different bits at M = 1 and M = 80, and a fused
multiply-then-reduce does too (the reduce emitter's order depends on M; neither is a plain
sequential sum). What is fixed is elementwise code: each output element of an elementwise
fusion runs the same expression. So every sum here is a chain of elementwise adds,
acc = acc + a[k] * b[k] for k = 0, 1, ... in order (a fused multiply-add where the backend
contracts one, the same for every element), run as a `lax.scan` over chunks of `CHUNK` terms
unrolled inside the step. Terms that are exact zeros (masked keys, padding) leave the chain's
value unchanged, so attention over a KV cache of any length and over the training sequence
visit the same keys in the same order with the same result.

RoPE's rotation h cos + r sin takes the same exact products (`rope.rope(..., exact=True)`),
and a row maximum that a softmax's exp consumes is a chain of elementwise maxima (`max_last`).

Attention is the two-pass exact softmax (the row maximum first, which is order-free, then the
ordered sums of exp(s - max) and of its products with the values), not the online softmax of
`online_softmax`: the online form rescales its running sums at block boundaries that depend on
where a query's keys start, and rescaling rounds.

Costs: each contraction is K elementwise passes over the output (no BLAS), for the tiny models
the mode is tested on a few times the default's time (`benchmarks/batch_invariant.py`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Terms per unrolled step of an ordered sum (the scan's trip count is K // CHUNK).
CHUNK = 8


def _terms(acc: jax.Array, a: jax.Array, b: jax.Array | None) -> jax.Array:
    """acc + a[0] * b[0] + a[1] * b[1] + ... left to right (b None: acc + a[0] + a[1] ...);
    a [n, ...] and b [n, ...] each broadcast to acc's shape."""
    for j in range(a.shape[0]):
        acc = acc + (a[j] if b is None else exact_product(a[j], b[j]))
    return acc


# float32 with its 12 low mantissa bits cleared: 12 significant bits, so the product of two
# such halves (24 bits) is exact.
_HIGH_HALF = 0xFFFFF000


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 x -> (hi, lo), x = hi + lo exactly, each with at most 12 significant bits: hi by
    masking the bits (integer ops, which no float rewrite sees through), lo = x - hi (exact)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(_HIGH_HALF)
    hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return hi, x - hi


def exact_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b (float32, broadcast) as the sum of four exact partial products of their 12-bit
    halves, ((ah bh + ah bl) + al bh) + al bl. Why: XLA:CPU contracts some of a fusion's
    multiply-adds into fused multiply-adds and not others, as the fusion's shape decides (with
    its older emitters even behind a select; an `optimization_barrier` is removed before code
    generation), and a fused and an unfused acc + a * b round differently. Every product here
    is exact, so contracted or not, each add rounds the same value (products that fall below
    float32's normal range excepted)."""
    if jnp.result_type(a, b) != jnp.float32:
        raise ValueError(f"batch-invariant product of {jnp.result_type(a, b)}: not built; "
                         "accepted: float32 (the mode computes in float32)")
    (ah, al), (bh, bl) = _halves(a), _halves(b)
    return ((ah * bh + ah * bl) + al * bh) + al * bl


def ordered_sum(acc: jax.Array, a: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """acc + sum_k a[k] * b[k] (or + a[k]) with k = 0 .. K-1 added one after the other: a
    [K, ...] and b [K, ...] (the summed dim leading) each broadcast to acc [...]. The order, and
    so every output element's bits, depend on K and the values alone."""
    n = a.shape[0]
    full = n // CHUNK * CHUNK
    if full:
        chunks = (a[:full].reshape((n // CHUNK, CHUNK) + a.shape[1:]),
                  None if b is None else b[:full].reshape((n // CHUNK, CHUNK) + b.shape[1:]))
        acc, _ = jax.lax.scan(lambda c, ab: (_terms(c, *ab), None), acc, chunks)
    return _terms(acc, a[full:], None if b is None else b[full:])


def sum_last(x: jax.Array) -> jax.Array:
    """x [..., N] summed over its last dim in index order -> [...]."""
    return ordered_sum(jnp.zeros(x.shape[:-1], x.dtype), jnp.moveaxis(x, -1, 0))


def max_last(x: jax.Array) -> jax.Array:
    """x [..., N] -> its maximum over the last dim [...], as a chain of elementwise maxima. Why
    not `jnp.max`: the maximum itself is exact either way, but XLA:CPU emits what consumes a
    reduce (a softmax's exp of x - max over a short row) in a fusion whose exp rounds
    differently at different row counts (1 ulp; [N, 8] rows differ between N = 16 and 624)."""
    top = x[..., 0]
    for j in range(1, x.shape[-1]):
        top = jnp.maximum(top, x[..., j])
    return top


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in the promoted dtype, each output element summed over
    k = 0 .. K-1 in order."""
    dtype = jnp.promote_types(jnp.promote_types(x.dtype, w.dtype), jnp.float32)
    acc = jnp.zeros(x.shape[:-1] + w.shape[1:], dtype)
    return ordered_sum(acc, jnp.moveaxis(x.astype(dtype), -1, 0)[..., None], w.astype(dtype))


@functools.lru_cache(maxsize=None)
def _split_spec(spec: str) -> tuple[int, int]:
    """'<batch><contracted>,<contracted><out>-><batch><out>' -> (number of contracted dims,
    number of out dims); ValueError naming `spec` for any other form."""
    try:
        inputs, out = spec.replace(" ", "").split("->")
        x, w = inputs.split(",")
    except ValueError:
        x = w = out = ""
    c = next((n for n in range(min(len(x), len(w)), 0, -1) if x[-n:] == w[:n]), 0)
    if not c or out != x[:-c] + w[c:]:
        raise ValueError(f"invariant einsum spec={spec!r} is not supported; accepted: "
                         "'<batch><contracted>,<contracted><out>-><batch><out>', e.g. "
                         "'BTD,DHK->BTHK' or 'BTHK,HKD->BTD'")
    return c, len(w) - c


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a projection (`_split_spec`'s form): the contracted dims
    flattened into one K and summed in order (`matmul`)."""
    c, n_out = _split_spec(spec)
    k = math.prod(x.shape[x.ndim - c:])
    out = matmul(x.reshape(x.shape[:x.ndim - c] + (k,)), w.reshape(k, -1))
    return out.reshape(x.shape[:x.ndim - c] + w.shape[w.ndim - n_out:])


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x [..., D] / sqrt(mean(x^2) + eps), the squares summed in order (float32 or wider in)."""
    squares = sum_last(x * x)
    return x * jax.lax.rsqrt(squares / x.shape[-1] + eps)[..., None]


def logprobs_at(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(logits [..., V]) at `labels` [...] -> [...]: the shift by the row maximum
    (order-free), exp summed over the vocabulary in order. -inf logits add exact zeros."""
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(sum_last(jnp.exp(shifted)))
    return jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0] - lse


def untied_projection(weight: jax.Array, h: jax.Array) -> jax.Array:
    """h [B, T, D] @ weight [D, V] -> logits [B, T, V], float32 at least, summed in order
    (`chunked_logits.untied_projection`'s contract)."""
    return matmul(h.astype(jnp.promote_types(h.dtype, jnp.float32)), weight)


def tied_projection(weight: jax.Array, h: jax.Array) -> jax.Array:
    """h [B, T, D] @ weight [V, D]^T -> logits [B, T, V] (an embedding read as the head)."""
    return untied_projection(weight.T, h)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax attention with grouped-query heads, each query's keys visited in index order.

    q [B, T, H, K]; k, v [B, S, G, K] with H a multiple of G; visible bool [B, T, S] (which
    keys each query sees; a query that sees none gives zeros) -> [B, T, H, K]. Scores
    q.k / sqrt(K) and the softmax in float32 (float64 for float64 input)."""
    b, t, h, d = q.shape
    g = k.shape[2]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = jnp.moveaxis(q.reshape(b, t, g, h // g, d).astype(acc), -1, 0)    # [K, B, T, G, R]
    qg = jnp.einsum("KBTGR->KBGRT", qg)[..., None]                          # [K, B, G, R, T, 1]
    kt = jnp.einsum("BSGK->KBGS", k.astype(acc))[:, :, :, None, None, :]    # [K, B, G, 1, 1, S]
    scores = ordered_sum(jnp.zeros((b, g, h // g, t, k.shape[1]), acc), qg, kt)
    scores = scores / jnp.sqrt(jnp.asarray(d, acc))                         # [B, G, R, T, S]
    mask = visible[:, None, None]                                           # [B, 1, 1, T, S]
    top = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = sum_last(p)                                                     # [B, G, R, T]
    vt = jnp.einsum("BSGK->SBGK", v.astype(acc))[:, :, :, None, None, :]    # [S, B, G, 1, 1, K]
    out = ordered_sum(jnp.zeros((b, g, h // g, t, d), acc),
                      jnp.moveaxis(p, -1, 0)[..., None], vt)                # [B, G, R, T, K]
    out = jnp.where(total[..., None] > 0, out / jnp.maximum(total, 1e-30)[..., None], 0.0)
    return jnp.einsum("BGRTK->BTGRK", out).reshape(b, t, h, d).astype(v.dtype)


__all__ = ["CHUNK", "attention", "einsum", "exact_product", "logprobs_at", "matmul", "max_last",
           "ordered_sum", "rms_norm", "sum_last", "tied_projection", "untied_projection"]
