"""Per-row sampling knobs as arrays: the continuous-batching engine runs one compiled step for
rows with different temperatures, top-k, top-p and vocabulary limits, where the static decode
loop compiles its `Sampling` in.

Each function computes what its `sampling.py` counterpart computes for that row's `Sampling`,
with the same float32 arithmetic (the temperature enters as the same two float32 factors,
2**-e and 2**e / temperature, computed on the host in float64 as Python folds them into the
static program), so a row draws the same token from the same logits and key either way:

    RowSampling.of([Sampling, ...], vocab_size)  -> host arrays, one entry per row [R]
    row_log_weights(logits [R, V], rows)         -> float32 [R, V]  (`sampling.log_weights`)
    row_next_token(logits, keys [R], rows)       -> int32 [R]       (`sampling.next_token`)
    row_logprobs(logits, token [R], rows)        -> float32 [R]     (`sampling.sampled_logprobs`)
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.inference.sampling import FLOAT32_MAX, NEG_INF, Sampling, top_p_keep


@flax.struct.dataclass
class RowSampling:
    """One entry per row [R]: greedy bool; a, b float32 (scaled logits are (logits * a -
    max * a) * b, `sampling.scaled_logits`); uniform bool (temperature past float32's
    largest); top_k int32 (0: none); top_p float32 (1: none); vocab_limit int32 (V: none)."""

    greedy: jax.Array
    a: jax.Array
    b: jax.Array
    uniform: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    vocab_limit: jax.Array

    @staticmethod
    def of(samplings: Sequence[Sampling | None], vocab_size: int) -> "RowSampling":
        """Host (numpy) arrays for `samplings` (None: a greedy filler row)."""
        rows = [s if s is not None else Sampling(0.0, None, None, None) for s in samplings]
        temps = [s.temperature for s in rows]
        exps = [1 if t <= 2.0 ** 127 else 64 for t in temps]
        return RowSampling(
            greedy=np.asarray([s.greedy for s in rows], bool),
            a=np.asarray([2.0 ** -e for e in exps], np.float32),
            b=np.asarray([2.0 ** e / t if not s.greedy and t <= FLOAT32_MAX else 1.0
                          for s, t, e in zip(rows, temps, exps)], np.float32),
            uniform=np.asarray([not s.greedy and t > FLOAT32_MAX for s, t in zip(rows, temps)],
                               bool),
            top_k=np.asarray([0 if s.top_k is None else min(s.top_k, vocab_size)
                              for s in rows], np.int32),
            top_p=np.asarray([1.0 if s.top_p is None else s.top_p for s in rows], np.float32),
            vocab_limit=np.asarray([vocab_size if s.vocab_limit is None
                                    else min(s.vocab_limit, vocab_size) for s in rows],
                                   np.int32))


def _limited(logits: jax.Array, rows: RowSampling) -> tuple[jax.Array, jax.Array]:
    valid = jnp.arange(logits.shape[-1])[None, :] < rows.vocab_limit[:, None]     # [R, V]
    return jnp.where(valid, logits.astype(jnp.float32), NEG_INF), valid


def _top_k_keep(logits: jax.Array, k: jax.Array) -> jax.Array:
    """bool [R, V]: `sampling.top_k_keep` with row r's k (0: every token)."""
    ordered = -jnp.sort(-logits, axis=-1)                                      # [R, V] desc
    kth = jnp.take_along_axis(ordered, jnp.maximum(k - 1, 0)[:, None], axis=-1)  # [R, 1]
    return (logits >= kth) | (k == 0)[:, None]


def row_log_weights(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """float32 [R, V]: each row's `sampling.log_weights` under its own knobs (the sorts that
    top-k and top-p need run only when some row uses them)."""
    logits, keep = _limited(logits, rows)
    top = jnp.argmax(logits, axis=-1)[:, None]
    greedy = jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, NEG_INF)
    keep = jax.lax.cond(jnp.any(rows.top_k > 0),
                        lambda: keep & _top_k_keep(logits, rows.top_k), lambda: keep)
    shifted = logits * rows.a[:, None]
    shifted = shifted - jnp.max(shifted, axis=-1, keepdims=True)
    scaled = jnp.where(rows.uniform[:, None], 0.0, shifted * rows.b[:, None])
    scaled = jnp.where(keep, scaled, NEG_INF)
    scaled = jax.lax.cond(
        jnp.any(rows.top_p < 1),
        lambda: jnp.where(top_p_keep(logits, scaled, rows.top_p[:, None]), scaled, NEG_INF),
        lambda: scaled)
    return jnp.where(rows.greedy[:, None], greedy, scaled)


def row_next_token(logits: jax.Array, keys: jax.Array,
                   rows: RowSampling) -> tuple[jax.Array, jax.Array]:
    """(token int32 [R], its log-probability float32 [R]): row r's draw with key r
    (`sampling.next_token`; greedy rows the argmax of their limited logits) and what
    `sampling.sampled_logprobs` gives for it."""
    weights = row_log_weights(logits, rows)
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, weights)
    argmax = jnp.argmax(_limited(logits, rows)[0], axis=-1)
    token = jnp.where(rows.greedy, argmax, drawn).astype(jnp.int32)
    logp = jax.nn.log_softmax(weights, axis=-1)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


__all__ = ["RowSampling", "row_log_weights", "row_next_token"]
