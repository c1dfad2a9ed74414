"""Choosing the next token from logits: the knobs (`Sampling`: greedy, temperature, top-k,
top-p (nucleus), and `vocab_limit`, the ids a padded vocabulary's tokenizer can decode), the
draw, and the keys the draws use.

Pure functions of (logits, key): the decode loop calls `next_token` once per step with one key
per row. A row's key is folded from the generation's seed, the row's prompt (a hash of its
token ids, `prompt_hash`) and the decode step (`row_keys`, `step_keys`), never from the row's
index or the batch's shape, so a prompt's tokens depend on (prompt, seed) alone: not on the other
prompts of the call, nor on its place among them, nor on the padding. (Two equal prompts in one
call therefore get equal continuations: draw several samples of a prompt with several seeds.)
The knobs are Python numbers (static under `jit`), checked by `Sampling` (any Python or NumPy
scalar in range; `check_temperature` is what the CLI and the job configs check with too);
`seed_key` refuses a bad seed by name.

The draw computes softmax((logits - max) / temperature) in float32, where the temperature
enters as the normal float32 constant 1/temperature (times a power of two: `scaled_logits`).
Float32 sets the two thresholds:
  temperature < 2**-126 (`FLOAT32_TINY`, float32's smallest normal number): the temperature is
      not a normal float32 (XLA flushes subnormals to zero, so 1/temperature would be inf), and
      softmax(logits / temperature) has reached its limit anyway (every token below the
      maximum by more than 745 * temperature has probability 0 even in float64): sampled as
      temperature 0, greedy (argmax; a tie at the maximum goes to the lowest id).
  temperature > 3.4028235e38 (`FLOAT32_MAX`, float32's largest number): the temperature is no
      float32 at all, and (logits - max) / temperature is below float32's resolution (2**-24)
      for every logit spread under 2**104 (2e31): sampled as its limit, uniform over the tokens
      top-k / top-p keep.
Between them the distribution is computed, and logits / temperature overflowing float32 (a
small temperature) is harmless: the logits are shifted by their maximum first, so an overflow
is a -inf, a probability that is 0 in float64 too.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.models.invariant import logprobs_at

FLOAT32_TINY = 2.0 ** -126                       # np.finfo(np.float32).tiny
FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127    # np.finfo(np.float32).max, 3.4028235e38

TEMPERATURE_RULE = ("0 is greedy; below 2**-126 (1.2e-38, float32's smallest normal) it samples "
                    "as 0 (greedy), above 3.4e38 (float32's largest) as uniform over the kept "
                    "tokens")
TEMPERATURE_ACCEPTED = "0 (greedy) or a finite positive number"
SCALAR_TYPES = "a Python or NumPy scalar, not a bool"


def _real(value: Any) -> float | None:
    """`value` as a Python float if it is a real scalar (Python or NumPy, bool excluded) that a
    float64 holds finitely; else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:                 # an int beyond float64
        return None
    return number if math.isfinite(number) else None


def check_temperature(temperature: Any) -> float:
    """`temperature` as a Python float; ValueError naming it unless it is 0 or a finite positive
    real number (an int, a float, a NumPy integer or floating scalar; not a bool)."""
    number = _real(temperature)
    if number is None or number < 0:
        raise ValueError(f"temperature={temperature!r} is invalid; accepted: "
                         f"{TEMPERATURE_ACCEPTED} ({SCALAR_TYPES})")
    return number


def check_top_k(top_k: Any) -> int | None:
    """`top_k` as a Python int (or None); ValueError naming it unless it is None or an integer
    >= 1 (a Python or NumPy integer; not a bool, not a float)."""
    if top_k is None:
        return None
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} is invalid; accepted: None or an integer >= 1 "
                         f"({SCALAR_TYPES})")
    return int(top_k)


def check_top_p(top_p: Any) -> float | None:
    """`top_p` as a Python float (or None); ValueError naming it unless it is None or a real
    number in (0, 1]."""
    if top_p is None:
        return None
    number = _real(top_p)
    if number is None or not 0 < number <= 1:
        raise ValueError(f"top_p={top_p!r} is invalid; accepted: None or a number in (0, 1] "
                         f"({SCALAR_TYPES})")
    return number


def check_vocab_limit(vocab_limit: Any, vocab_size: int | None = None) -> int | None:
    """`vocab_limit` as a Python int (or None); ValueError naming it unless it is None or an
    integer in [1, vocab_size] (the model's vocabulary, when given)."""
    if vocab_limit is None:
        return None
    upper = "" if vocab_size is None else f", at most the model's vocab_size={vocab_size}"
    if (not isinstance(vocab_limit, numbers.Integral) or isinstance(vocab_limit, bool)
            or vocab_limit < 1 or (vocab_size is not None and vocab_limit > vocab_size)):
        raise ValueError(f"vocab_limit={vocab_limit!r} is invalid; accepted: None or an integer "
                         f">= 1{upper} (the tokenizer's vocabulary size)")
    return int(vocab_limit)


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    """ValueError naming the first bad knob, its value and what is accepted."""
    check_temperature(temperature)
    check_top_k(top_k)
    check_top_p(top_p)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick a token: `temperature` 0 is greedy (argmax); otherwise a draw from
    softmax(logits / temperature) restricted to the `top_k` most likely tokens (all tied with
    the k-th kept, as Hugging Face's `TopKLogitsWarper`) and then to the smallest set whose
    probability reaches `top_p` (None or 1: no restriction). Temperatures float32 cannot carry
    sample as their limits (module docstring): below 2**-126 greedy, above 3.4e38 uniform over
    the kept tokens.

    `vocab_limit`: the ids a draw may pick are [0, vocab_limit), the tokenizer's vocabulary,
    when the model's is padded past it (Qwen2.5: 151,936 embedding rows for 151,665 tokens).
    The logits of the padded ids are -inf before any other knob acts (greedy included), so
    the draw is softmax over the tokenizer's ids alone; None: every id of the model.

    The knobs are checked and stored as Python numbers, so `Sampling(np.float32(0.5))` equals
    `Sampling(0.5)` (one compiled program for both)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "top_k", check_top_k(self.top_k))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        object.__setattr__(self, "vocab_limit", check_vocab_limit(self.vocab_limit))

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one below float32's normal range (its limit)."""
        return self.temperature < FLOAT32_TINY

    @property
    def uniform(self) -> bool:
        """A temperature beyond float32's range: uniform over the kept tokens (its limit)."""
        return self.temperature > FLOAT32_MAX


NEG_INF = -jnp.inf


def valid_ids(shape: tuple[int, ...], vocab_limit: int | None) -> jax.Array:
    """bool [..., V]: True for the ids below `vocab_limit` (every id when None)."""
    if vocab_limit is None or vocab_limit >= shape[-1]:
        return jnp.ones(shape, bool)
    return jnp.broadcast_to(jnp.arange(shape[-1]) < vocab_limit, shape)


def limited_logits(logits: jax.Array, vocab_limit: int | None) -> jax.Array:
    """float32 logits [B, V] with every id >= `vocab_limit` at -inf (None, or a limit of V or
    more: unchanged): the ids the tokenizer cannot decode are never drawn."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    return jnp.where(valid_ids(logits.shape, vocab_limit), logits, NEG_INF)


def scaled_logits(logits: jax.Array, temperature: float) -> jax.Array:
    """(logits - row max) / temperature: float32 [B, V] -> float32 [B, V], 0 at each row's
    maximum, for a temperature in [2**-126, 3.4e38] (module docstring); above that, its limit
    0 everywhere (uniform).

    Computed as (logits * a - max * a) * b with a = 2**-e and b = 2**e / temperature, both
    normal float32 constants (e = 1, or 64 past 2**127, where 2 / temperature is subnormal and
    XLA, which turns a division by a constant into a product with its reciprocal, would flush
    it to 0). Scaling by a first keeps the difference finite for any float32 logits; a product
    that overflows is -inf, a token whose probability is 0 in float64 too."""
    if temperature > FLOAT32_MAX:
        return jnp.zeros_like(logits)
    e = 1 if temperature <= 2.0 ** 127 else 64
    shifted = logits * 2.0 ** -e
    shifted = shifted - jnp.max(shifted, axis=-1, keepdims=True)             # [B, V] <= 0
    return shifted * (2.0 ** e / temperature)


def top_k_keep(logits: jax.Array, k: int) -> jax.Array:
    """bool [B, V]: the k largest logits of each row and every logit tied with the k-th (Hugging
    Face's `TopKLogitsWarper`). On the logits themselves, not on scaled ones, whose ties a
    large temperature would multiply."""
    if k >= logits.shape[-1]:
        return jnp.ones(logits.shape, bool)
    kth = jax.lax.top_k(logits, k)[0][:, -1:]                                 # [B, 1]
    return logits >= kth


def top_p_keep(logits: jax.Array, scaled: jax.Array, p: float | jax.Array) -> jax.Array:
    """bool [B, V]: each row's nucleus (Holtzman et al. 2020 §3.1), the most likely tokens in
    order up to and including the first whose cumulative probability reaches p, and every
    token tied with it. `scaled` [B, V] (`scaled_logits`, -inf where an earlier filter
    dropped the token) gives the probabilities; the order and the ties are the logits' own.
    `p`: a number, or float32 [B, 1], one per row (`row_sampling`; rows of p >= 1 keep all)."""
    if isinstance(p, jax.Array):
        return _nucleus(logits, scaled, p) | (p >= 1)
    if p >= 1:
        return jnp.ones(logits.shape, bool)
    return _nucleus(logits, scaled, p)


def _nucleus(logits: jax.Array, scaled: jax.Array, p: float | jax.Array) -> jax.Array:
    neg_sorted, sorted_scaled = jax.lax.sort((-logits, scaled), num_keys=1)   # [B, V] desc
    probs = jax.nn.softmax(sorted_scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1)[:, :-1]       # mass of the more likely tokens
    before = jnp.concatenate([jnp.zeros_like(probs[:, :1]), before], axis=-1)
    kept = jnp.sum(before < p, axis=-1, keepdims=True)   # >= 1: the first is always kept
    cutoff = -jnp.take_along_axis(neg_sorted, kept - 1, axis=-1)              # [B, 1]
    return logits >= cutoff


def log_weights(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The unnormalized log-probabilities of the draw: logits [B, V] -> float32 [B, V], -inf
    for every token the draw never picks (softmax of it is the sampling distribution). Greedy:
    0 at each row's argmax (the lowest id of a tie), -inf elsewhere. Ids >= `vocab_limit` are
    -inf in every case (`limited_logits`)."""
    logits = limited_logits(logits, sampling.vocab_limit)
    if sampling.greedy:
        top = jnp.argmax(logits, axis=-1)[:, None]                            # [B, 1]
        return jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, NEG_INF)
    keep = valid_ids(logits.shape, sampling.vocab_limit)   # also at the uniform limit
    if sampling.top_k is not None:
        keep = keep & top_k_keep(logits, sampling.top_k)
    scaled = jnp.where(keep, scaled_logits(logits, sampling.temperature), NEG_INF)
    if sampling.top_p is not None:
        scaled = jnp.where(top_p_keep(logits, scaled, sampling.top_p), scaled, NEG_INF)
    return scaled


def next_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row: logits float [B, V] -> int32 [B], drawn from
    softmax(`log_weights`) (greedy: the argmax).

    `key`: one PRNG key per row ([B], row b's draw uses key b and its own logits only), or one
    key for the whole batch (a scalar). Never an id >= `sampling.vocab_limit`."""
    if sampling.greedy:
        logits = limited_logits(logits, sampling.vocab_limit)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    weights = log_weights(logits, sampling)
    if key.ndim == 0:
        return jax.random.categorical(key, weights, axis=-1).astype(jnp.int32)
    draw = jax.vmap(lambda k, row: jax.random.categorical(k, row))
    return draw(key, weights).astype(jnp.int32)


def sampled_logprobs(logits: jax.Array, token: jax.Array, sampling: Sampling,
                     invariant: bool = False) -> jax.Array:
    """The log-probability of each row's drawn `token` int[B] under the distribution it was
    drawn from, log softmax(`log_weights`) at the token: logits float [B, V] -> float32 [B].
    At temperature 1 with no top-k / top-p this is the model's log softmax over the ids below
    `vocab_limit`, computed as `zeroxla.engine.loss.token_logprobs` computes it (the shift by
    the row maximum is exact), which the training forward's log-probs are compared against.
    Greedy: 0 (the draw is certain). `invariant` (a batch-invariant model's,
    `LlamaConfig.batch_invariant`): the log-softmax's sum in the fixed order its training
    forward uses (`models.invariant.logprobs_at`)."""
    if invariant:
        return logprobs_at(log_weights(logits, sampling), token.astype(jnp.int32))
    logp = jax.nn.log_softmax(log_weights(logits, sampling), axis=-1)          # [B, V]
    return jnp.take_along_axis(logp, token[:, None].astype(jnp.int32), axis=-1)[:, 0]


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
