"""Token log-probs (and entropies) of a linear head whose logits never exist whole.

A head's logits are [B, T, V] float32: 20 GB at T = 32K with Qwen's 151,936-token vocabulary.
The loss needs only two numbers per token, log-sum-exp and the target's logit, so the
projection, the log-softmax and the target's pick run per chunk of the sequence inside a
`lax.scan` (the fused linear + cross-entropy of Liger and of DeepSpeed ALST's tiled loss): the
largest logits buffer is one chunk's [B, C, V]. A custom VJP keeps only the inputs, so
backward recomputes each chunk's logits instead of storing them; the gradients of the head's
weight (accumulated over the chunks in float32) and of the hidden states are those of the
whole-logits computation.

The caller is a method of the module owning the projection's weight (`TokenEmbed`, `Head`, ...):
under ZeRO-3 that weight is gathered once around the method's call, and every chunk reads it.

    tied_projection / untied_projection                          a head's `project`
    chunked_token_logprobs(h, labels, weight, project, ...)      -> logprobs [B, T]
    chunked_token_entropy(h, weight, project, ...)               -> entropy [B, T]
    token_logprobs_reference / token_entropy_reference           the same from whole logits
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .invariant import logprobs_at as invariant_logprobs_at
from .layers import at_least_float32

# Tokens per chunk: one chunk's logits are [B, LOGITS_CHUNK, V] (B = 1, V = 151,936: 622 MB in
# float32), small beside the whole [B, T, V] at long T and large enough that the per-chunk
# overhead of the loop is negligible.
LOGITS_CHUNK = 1024

# project(weight, h [B, C, D]) -> logits [B, C, V], float32 at least.
Project = Callable[[Any, jax.Array], jax.Array]


def tied_projection(weight: jax.Array, h: jax.Array) -> jax.Array:
    """h [B, T, D] @ weight[V, D]^T (an embedding read as the head) -> logits [B, T, V] in
    float32 at least (float64 for float64 h)."""
    return jnp.einsum("BTD,VD->BTV", h, weight, preferred_element_type=at_least_float32(h.dtype))


def untied_projection(weight: jax.Array, h: jax.Array) -> jax.Array:
    """h [B, T, D] @ weight[D, V] -> logits [B, T, V] in float32 at least."""
    return jnp.einsum("BTD,DV->BTV", h, weight, preferred_element_type=at_least_float32(h.dtype))


def head_logits(weight: Any, h: jax.Array, project: Project, *, softcap: float | None = None,
                vocab_limit: Any = None) -> jax.Array:
    """logits [B, C, V] of h [B, C, D] in float32 at least (float64 stays float64), soft-capped
    (`softcap * tanh(logits / softcap)`, Gemma 2's final_logit_softcapping) when `softcap` is
    set, and -inf at every id >= `vocab_limit` (an int, possibly traced) when it is given: the
    softmax over the ids a tokenizer can decode (`zeroxla.inference.Sampling.vocab_limit`)."""
    logits = project(weight, h)
    logits = logits.astype(at_least_float32(logits.dtype))
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if vocab_limit is not None:
        ids = jnp.arange(logits.shape[-1])
        logits = jnp.where(ids < vocab_limit, logits, -jnp.inf)
    return logits


def _logprobs_of(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(logits) [..., V] at `labels` [...]: `jax.nn.log_softmax`'s arithmetic (shift
    by the stopped max, subtract the shifted log-sum-exp) on the target alone."""
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    return jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0] - lse


def _entropy_of(logits: jax.Array) -> jax.Array:
    """-sum p log p over the last dim of `logits` [..., V], as log-sum-exp - E_p[logit]: ids
    masked to -inf (p = 0) add nothing, and their gradient is 0, not NaN (0 * -inf)."""
    finite = jnp.where(jnp.isneginf(logits), 0.0, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(probs * finite, axis=-1)


_KINDS = ("logprobs", "invariant_logprobs", "entropy")


def _per_chunk(kind: str, project: Project, softcap: float | None, weight: Any, h: jax.Array,
               labels: jax.Array, vocab_limit: Any) -> jax.Array:
    """One chunk: h [B, C, D] (labels [B, C]) -> the chunk's log-probs or entropies [B, C]."""
    logits = head_logits(weight, h, project, softcap=softcap, vocab_limit=vocab_limit)
    if kind == "invariant_logprobs":
        return invariant_logprobs_at(logits, labels)
    return _logprobs_of(logits, labels) if kind == "logprobs" else _entropy_of(logits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(kind: str, project: Project, softcap: float | None, weight: Any, hs: jax.Array,
             labels: jax.Array, vocab_limit: Any) -> jax.Array:
    """hs [N, B, C, D], labels [N, B, C] -> [N, B, C], one chunk at a time (`lax.map`).

    A custom VJP, FlashAttention's rule applied to the head: forward keeps only its inputs
    (`weight` as given, so a ZeRO-3 unit recognises its gathered parameter and does not save
    it, `zeroxla.engine.remat.linearize_keeping`), and backward recomputes each chunk's logits
    and pulls the chunk's cotangent through them, the weight's gradient summed over the chunks
    in float32 at least (a bf16 head's gradient is rounded once, as the whole-logits einsum
    rounds it)."""
    return jax.lax.map(lambda xs: _per_chunk(kind, project, softcap, weight, *xs, vocab_limit),
                       (hs, labels))


def _chunked_fwd(kind, project, softcap, weight, hs, labels, vocab_limit):
    out = _chunked(kind, project, softcap, weight, hs, labels, vocab_limit)
    return out, (weight, hs, labels, vocab_limit)


def _chunked_bwd(kind, project, softcap, residuals, g):
    weight, hs, labels, vocab_limit = residuals

    def step(d_weight, xs):                                   # d_weight: float32 at least
        h_c, labels_c, g_c = xs
        _, pull = jax.vjp(lambda w, h: _per_chunk(kind, project, softcap, w, h, labels_c,
                                                  vocab_limit), weight, h_c)
        dw_c, dh_c = pull(g_c)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), d_weight, dw_c), dh_c

    zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, at_least_float32(w.dtype)), weight)
    d_weight, d_hs = jax.lax.scan(step, zeros, (hs, labels, g))
    d_weight = jax.tree.map(lambda d, w: d.astype(w.dtype), d_weight, weight)
    return d_weight, d_hs, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _over_chunks(kind: str, project: Project, softcap: float | None, weight: Any, h: jax.Array,
                 labels: jax.Array, vocab_limit: Any, chunk: int) -> jax.Array:
    """The chunk function `kind` of `_per_chunk` over h [B, T, D] / labels [B, T] in chunks of
    `chunk` tokens (the last one padded: exact for any T) -> [B, T]."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid; accepted: an integer >= 1 (tokens per "
                         "chunk of the head's logits)")
    b, t, d = h.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:           # padded tokens: zero hidden states, label 0; dropped below, no gradient
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)))
    hs = h.reshape(b, n, c, d).swapaxes(0, 1)                              # [N, B, C, D]
    ls = labels.reshape(b, n, c).swapaxes(0, 1)                            # [N, B, C]
    out = _chunked(kind, project, softcap, weight, hs, ls, vocab_limit)   # [N, B, C]
    return out.swapaxes(0, 1).reshape(b, n * c)[:, :t]                    # [B, T]


def chunked_token_logprobs(h: jax.Array, labels: jax.Array, weight: Any, project: Project, *,
                           softcap: float | None = None, vocab_limit: Any = None,
                           chunk: int = LOGITS_CHUNK, invariant: bool = False) -> jax.Array:
    """log softmax(head(h))[labels]: h [B, T, D] (the final hidden states, normed), labels
    int [B, T], `weight` the head's parameters as `project` reads them -> [B, T] float32
    (float64 for float64 h), computed `chunk` tokens at a time (module docstring). Equals
    `token_logprobs_reference`. `invariant`: the log-softmax's sum in a fixed order
    (`models.invariant.logprobs_at`, the batch-invariant mode)."""
    kind = "invariant_logprobs" if invariant else "logprobs"
    return _over_chunks(kind, project, softcap, weight, h, labels, vocab_limit, chunk)


def chunked_token_entropy(h: jax.Array, weight: Any, project: Project, *,
                          softcap: float | None = None, vocab_limit: Any = None,
                          chunk: int = LOGITS_CHUNK) -> jax.Array:
    """The entropy of each token's next-token distribution softmax(head(h)) -> [B, T], `chunk`
    tokens at a time (as `chunked_token_logprobs`). Equals `token_entropy_reference`."""
    labels = jnp.zeros(h.shape[:2], jnp.int32)
    return _over_chunks("entropy", project, softcap, weight, h, labels, vocab_limit, chunk)


def token_logprobs_reference(h: jax.Array, labels: jax.Array, weight: Any, project: Project, *,
                             softcap: float | None = None, vocab_limit: Any = None) -> jax.Array:
    """`chunked_token_logprobs` from the whole logits [B, T, V] (`jax.nn.log_softmax`)."""
    logits = head_logits(weight, h, project, softcap=softcap, vocab_limit=vocab_limit)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def token_entropy_reference(h: jax.Array, weight: Any, project: Project, *,
                            softcap: float | None = None, vocab_limit: Any = None) -> jax.Array:
    """`chunked_token_entropy` from the whole logits [B, T, V]."""
    return _entropy_of(head_logits(weight, h, project, softcap=softcap, vocab_limit=vocab_limit))
