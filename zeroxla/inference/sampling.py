"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

Pure functions of (logits, key): the decode loop calls `next_token` once per step with a key
split from the generation's seed, so a seed fixes every draw. The knobs are Python values
(static under `jit`); `check_sampling` refuses bad ones by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick a token: `temperature` 0 is greedy (argmax); otherwise a draw from
    softmax(logits / temperature) restricted to the `top_k` most likely tokens and to the
    smallest set whose probability reaches `top_p` (None: no restriction)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the first bad knob, its value and what is accepted."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or temperature < 0:
        raise ValueError(f"temperature={temperature!r} is invalid; accepted: 0 (greedy) or a "
                         "positive number")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)
                              or top_k < 1):
        raise ValueError(f"top_k={top_k!r} is invalid; accepted: None or an integer >= 1")
    if top_p is not None and (not isinstance(top_p, (int, float)) or isinstance(top_p, bool)
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} is invalid; accepted: None or a number in (0, 1]")


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
    """logits [B, V] with all but the k largest of each row set to -inf (ties at the k-th
    value are all kept)."""
    k = min(k, logits.shape[-1])
    kth = jax.lax.top_k(logits, k)[0][:, -1:]                                 # [B, 1]
    return jnp.where(logits >= kth, logits, NEG_INF)


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
    """logits [B, V] restricted to each row's nucleus (Holtzman et al. 2020 §3.1): the most
    likely tokens, in order, up to and including the first whose cumulative probability
    reaches p; the rest set to -inf."""
    sorted_logits = -jnp.sort(-logits, axis=-1)                               # [B, V] desc
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass of the more likely tokens
    kept = jnp.sum(before < p, axis=-1, keepdims=True)   # >= 1: the first is always kept
    cutoff = jnp.take_along_axis(sorted_logits, kept - 1, axis=-1)            # [B, 1]
    keep = logits >= cutoff                              # ties at the cutoff are all kept
    return jnp.where(keep, logits, NEG_INF)


def next_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row: logits float [B, V] -> int32 [B]."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        logits = top_k_mask(logits, sampling.top_k)
    if sampling.top_p is not None:
        logits = top_p_mask(logits, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
