"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), and the
keys the draws use.

Pure functions of (logits, key): the decode loop calls `next_token` once per step with one key
per row. A row's key is folded from the generation's seed, the row's prompt (a hash of its
token ids, `prompt_hash`) and the decode step (`row_keys`, `step_keys`), never from the row's
index or the batch's shape, so a prompt's tokens depend on (prompt, seed) alone: not on the other
prompts of the call, nor on its place among them, nor on the padding. (Two equal prompts in one
call therefore get equal continuations: draw several samples of a prompt with several seeds.)
The knobs are Python values (static under `jit`); `check_sampling` and `seed_key` refuse bad
ones by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} is invalid; accepted: 0 (greedy) or a "
                         "finite positive number")
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
    """The next token of each row: logits float [B, V] -> int32 [B].

    `key`: one PRNG key per row ([B], row b's draw uses key b and its own logits only), or one
    key for the whole batch (a scalar)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        logits = top_k_mask(logits, sampling.top_k)
    if sampling.top_p is not None:
        logits = top_p_mask(logits, sampling.top_p)
    if key.ndim == 0:
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    draw = jax.vmap(lambda k, row: jax.random.categorical(k, row))
    return draw(key, logits).astype(jnp.int32)


# ---- keys ------------------------------------------------------------------------------------

HASH_BASE = 1_000_003       # odd: multiplication by it is a bijection mod 2^32


def prompt_hash(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """A hash of each row's prompt: tokens int [B, P] (right-padded), lengths int [B] ->
    uint32 [B], sum over t < length of (token_t + 1) * HASH_BASE^t mod 2^32. Padding (t >=
    length) is left out, so the hash does not depend on the prompt bucket."""
    p = tokens.shape[1]
    powers = jnp.concatenate([jnp.ones((1,), jnp.uint32),                # B^t mod 2^32 [P]
                              jnp.cumprod(jnp.full((p - 1,), HASH_BASE, jnp.uint32))])
    terms = (tokens.astype(jnp.uint32) + 1) * powers                             # [B, P]
    real = jnp.arange(p)[None, :] < lengths[:, None]
    return jnp.sum(jnp.where(real, terms, jnp.uint32(0)), axis=1, dtype=jnp.uint32)


def row_keys(key: jax.Array, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """One key per row ([B]): the generation's `key` folded with the row's `prompt_hash`."""
    return jax.vmap(jax.random.fold_in, (None, 0))(key, prompt_hash(tokens, lengths))


def step_keys(keys: jax.Array, n: jax.Array) -> jax.Array:
    """The keys [B] of new token `n` (0 for the first) of each row."""
    return jax.vmap(jax.random.fold_in, (0, None))(keys, n)


def seed_key(seed: Any) -> jax.Array:
    """A generation's `seed` as a typed PRNG key: an integer in [-2^63, 2^63) (`jax.random.key`)
    or a typed key (`jax.random.key(...)`, a scalar) as it is; ValueError naming `seed`
    otherwise (a legacy uint32 `PRNGKey` included: wrap it with `jax.random.wrap_key_data`)."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        if -2**63 <= int(seed) < 2**63:
            return jax.random.key(int(seed))
    elif isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        if seed.shape == ():
            return seed
    legacy = (" (a legacy uint32 key: pass jax.random.wrap_key_data(seed))"
              if getattr(seed, "dtype", None) == np.uint32 and np.shape(seed) == (2,) else "")
    shown = f"{type(seed).__name__} of shape {np.shape(seed)}" if hasattr(seed, "shape") \
        else repr(seed)
    raise ValueError(f"seed={shown} is invalid{legacy}; accepted: an integer in [-2**63, 2**63) "
                     "or a typed PRNG key of shape () (jax.random.key(...))")
