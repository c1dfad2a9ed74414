"""The decode loop shared by the Hybrid Engine and the ZeRO-3 re-gather baseline, and the
host-side packing of prompts into (batch bucket, prompt bucket) arrays.

Prompts are right-padded: row b holds its prompt at positions 0..len_b-1. Prefill runs the
whole [B, P] block once (pad slots are written to the cache but lie above the row's position
until a real token overwrites them, so they are never attended: `models.layers.cached_attention`),
then each step feeds every row's newest token at its own position. A recurrent model's prefill
is also given the pad mask (`segment_ids`: `checks` module docstring), so its state ends at each
row's last prompt token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.inference.checks import state_entries
from zeroxla.inference.sampling import (Sampling, check_vocab_limit, next_token, row_keys,
                                        sampled_logprobs, seed_key, step_keys)


def decode_loop(model: Any, cache: Any, tokens: jax.Array, lengths: jax.Array,
                live: jax.Array, max_new: jax.Array, eos_id: jax.Array, key: jax.Array,
                sampling: Sampling, max_len: int,
                all_done: Callable[[jax.Array], jax.Array] = jnp.all,
                with_logprobs: bool = False, with_routing: bool = False
                ) -> tuple[jax.Array, ...]:
    """Generates up to `max_new` (>= 1) tokens after each row's prompt.

    model: `decode(tokens, positions, cache) -> (logits, cache)`; cache {"k", "v"} [L, B, S, G,
    K] and a recurrent model's state entries (its prefill then takes `segment_ids=`);
    tokens int32 [B, P] right-padded prompts; lengths int32 [B] (>= 1); live bool [B] (False:
    a filler row of the batch bucket, which never holds the loop up); eos_id int32 scalar
    (-1: none); key: this generation's PRNG key (from its seed). Row b's n-th new token is drawn
    with `step_keys(row_keys(key, tokens, lengths), n)[b]` from its own logits: it depends on
    the seed and the row's prompt, not on the other rows, their number or the buckets
    (`sampling.py`). Returns (buffer int32 [B, max_len] with the prompt then the new tokens of
    each row, steps taken (int32 scalar), cache). The loop stops early once `all_done(done
    [B])` holds: every row has produced `eos_id` (inside a `shard_map` it must agree across
    devices, which then run the same number of steps). `with_logprobs`: a fourth output,
    float32 [B, max_len], holds at each new token's place in the buffer the log-probability it
    was drawn with (`sampling.sampled_logprobs`; 0 elsewhere), computed in this program.
    `with_routing` (an MoE model's `decode_choices`): a last output, int32 [B, max_len, L, k],
    holds at each fed token's place in the buffer the experts each layer routed it to (the
    prompt's from the prefill, a new token's from the step that fed it; -1 where no token was
    fed): the rollout's record for routing replay.
    """
    b, p = tokens.shape
    rows = jnp.arange(b)
    invariant = getattr(getattr(model, "config", None), "batch_invariant", False)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    # a recurrent model's state must skip the right pads: 1 on a prompt token, 0 on a pad
    pads = ((positions < lengths[:, None]).astype(jnp.int32) if state_entries(cache)
            else None)
    logits, chosen, cache = _decode(model, tokens, positions, cache, with_routing,
                                    pads)                                    # [B, P, V]
    routing = jnp.full((b, max_len if with_routing else 0) + chosen.shape[:1] + chosen.shape[3:],
                       -1, jnp.int32)                                     # [B, S, L, k]
    if with_routing:                       # the prompt's slots (a pad's is a later feed's)
        routing = routing.at[:, :p].set(jnp.moveaxis(chosen, 0, 2))
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]   # [B, V]
    keys = row_keys(key, tokens, lengths)                                    # [B]
    token = next_token(last, step_keys(keys, 0), sampling)                   # [B]
    buffer = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(tokens)
    buffer = buffer.at[rows, lengths].set(token)
    logprobs = jnp.zeros((b, max_len if with_logprobs else 0), jnp.float32)
    if with_logprobs:
        logprobs = logprobs.at[rows, lengths].set(
            sampled_logprobs(last, token, sampling, invariant))
    done = (token == eos_id) | ~live

    def more(carry):
        n, done = carry[3], carry[5]
        return (n < max_new) & ~all_done(done)

    def step(carry):
        buffer, logprobs, routing, n, cache, done = carry
        pos = lengths + n - 1                                                # newest token's
        fed = buffer[rows, pos][:, None]                                     # [B, 1]
        logits, chosen, cache = _decode(model, fed, pos[:, None], cache,
                                        with_routing)                        # [B, 1, V]
        token = next_token(logits[:, 0], step_keys(keys, n), sampling)
        buffer = buffer.at[rows, pos + 1].set(token)
        if with_logprobs:
            logprobs = logprobs.at[rows, pos + 1].set(
                sampled_logprobs(logits[:, 0], token, sampling, invariant))
        if with_routing:
            routing = routing.at[rows, pos].set(jnp.moveaxis(chosen[:, :, 0], 0, 1))
        return buffer, logprobs, routing, n + 1, cache, done | (token == eos_id)

    buffer, logprobs, routing, n, cache, _ = jax.lax.while_loop(
        more, step, (buffer, logprobs, routing, jnp.int32(1), cache, done))
    return ((buffer, n, cache) + ((logprobs,) if with_logprobs else ())
            + ((routing,) if with_routing else ()))


def _decode(model: Any, tokens: jax.Array, positions: jax.Array, cache: Any,
            with_routing: bool, segment_ids: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, Any]:
    """(logits [B, T, V], the experts each layer routed each token to int32 [L, B, T, k] with
    `with_routing` (`decode_choices`), else an empty int32 [0, B, T, 0], the cache).
    `segment_ids` int32 [B, T]: a recurrent model's prefill pad mask, passed only when given."""
    pads = {} if segment_ids is None else {"segment_ids": segment_ids}
    if with_routing:
        return model.decode_choices(tokens, positions, cache, **pads)
    logits, cache = model.decode(tokens, positions, cache, **pads)
    return logits, jnp.zeros((0,) + tokens.shape + (0,), jnp.int32), cache


def _count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def row_max_new(max_new_tokens: Any, rows: int, per_row: bool = False) -> list[int]:
    """`max_new_tokens` (an integer >= 0, or with `per_row` one per prompt) as one integer per
    prompt; ValueError naming the field otherwise."""
    if per_row and isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        values = list(max_new_tokens)
        if len(values) != rows or not all(_count(v) for v in values):
            raise ValueError(f"max_new_tokens has {len(values)} entries "
                             f"{[v for v in values if not _count(v)][:3] or ''}; accepted: an "
                             f"integer >= 0, or one per prompt ({rows})")
        return [int(v) for v in values]
    if not _count(max_new_tokens):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid; accepted: an integer "
                         ">= 0" + (", or a list of one per prompt" if per_row else ""))
    return [int(max_new_tokens)] * rows


def check_prompts(prompts: Sequence[Any], max_new_tokens: Any, max_out_tokens: int,
                  vocab_size: int, per_row: bool = False) -> list[np.ndarray]:
    """The prompts as 1-D int32 arrays; ValueError naming the field for an empty list, an empty
    or non-1-D prompt, a token outside [0, vocab_size), a negative or non-integer
    `max_new_tokens` (with `per_row`, a list of one per prompt is accepted: `row_max_new`), or
    a prompt (plus its new tokens) longer than `max_out_tokens`."""
    if isinstance(prompts, (np.ndarray, jax.Array)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of 1-D int arrays; got "
                         f"{type(prompts).__name__}" + ("" if len(prompts) else " of length 0"))
    news = row_max_new(max_new_tokens, len(prompts), per_row)
    rows = []
    for i, (prompt, new) in enumerate(zip(prompts, news)):
        row = np.asarray(prompt)
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompts[{i}] has shape {row.shape} and dtype {row.dtype}; "
                             "accepted: a 1-D int array of at least one token")
        if row.min() < 0 or row.max() >= vocab_size:
            bad = int(row.min() if row.min() < 0 else row.max())
            raise ValueError(f"prompts[{i}] holds token {bad}; accepted: ids in "
                             f"[0, {vocab_size})")
        if row.size + new > max_out_tokens:
            raise ValueError(
                f"prompts[{i}] has {row.size} tokens and max_new_tokens={new}: "
                f"{row.size + new} > HybridEngineConfig.max_out_tokens="
                f"{max_out_tokens}; accepted: prompt length + max_new_tokens <= max_out_tokens")
        rows.append(row.astype(np.int32))
    return rows


def check_request(prompts: Sequence[Any], max_new_tokens: Any, max_out_tokens: int,
                  vocab_size: int, *, temperature: Any, top_k: Any, top_p: Any, eos_id: Any,
                  seed: Any, vocab_limit: Any = None, per_row: bool = False
                  ) -> tuple[list[np.ndarray], Sampling, jax.Array]:
    """A `generate` call's arguments, each checked and named in its error, in the order every
    generator checks them: (the prompts as int32 rows, the sampling knobs, the seed's key).
    `vocab_limit` (None, or 1..vocab_size): the draws pick ids below it only."""
    sampling = Sampling(temperature, top_k, top_p,
                        check_vocab_limit(vocab_limit, vocab_size))
    key = seed_key(seed)
    check_eos_id(eos_id, vocab_size)
    return (check_prompts(prompts, max_new_tokens, max_out_tokens, vocab_size, per_row),
            sampling, key)


KNOBS = {"temperature": 0.0, "top_k": None, "top_p": None}     # the per-row knobs, defaults


def row_samplings(knobs: dict[str, Any], rows: int, vocab_size: int) -> list[Sampling] | None:
    """One `Sampling` per prompt when a knob of `KNOBS` is a list (one entry per prompt, the
    scalar knobs shared), None when all are scalars; ValueError naming the knob, or the prompt
    whose knobs are refused."""
    lists = [k for k in KNOBS if isinstance(knobs[k], (list, tuple))]
    if not lists:
        return None
    for k in lists:
        if len(knobs[k]) != rows:
            raise ValueError(f"{k} has {len(knobs[k])} entries; accepted: a scalar, or one per "
                             f"prompt ({rows})")
    out = []
    for i in range(rows):
        row = {k: knobs[k][i] if k in lists else knobs[k] for k in KNOBS}
        try:
            out.append(Sampling(**row, vocab_limit=check_vocab_limit(knobs["vocab_limit"],
                                                                     vocab_size)))
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
    return out


def by_sampling(samplings: list[Sampling], run: Callable[[list[int], Sampling], tuple]
                ) -> tuple[list, ...]:
    """`run(indices, sampling) -> (outputs, log-probs, ...)` (lists, one entry per index) once
    per distinct `Sampling` of the prompts, each list merged back in prompt order (a row's
    tokens depend on its own prompt, seed and knobs only, so a subset decodes as in the whole
    call)."""
    merged: tuple[list, ...] = ()
    for sampling in dict.fromkeys(samplings):
        index = [i for i, s in enumerate(samplings) if s == sampling]
        parts = run(index, sampling)
        merged = merged or tuple([None] * len(samplings) for _ in parts)
        for whole, part in zip(merged, parts):
            for i, value in zip(index, part):
                whole[i] = value
    return merged


def check_eos_id(eos_id: Any, vocab_size: int) -> None:
    """ValueError naming `eos_id` unless it is None or a token id in [0, vocab_size)."""
    if eos_id is not None and not (isinstance(eos_id, (int, np.integer))
                                   and not isinstance(eos_id, bool)
                                   and 0 <= eos_id < vocab_size):
        raise ValueError(f"eos_id={eos_id!r} is invalid; accepted: None or a token id in "
                         f"[0, {vocab_size})")


def bucket(n: int, multiple: int = 1, limit: int | None = None) -> int:
    """The smallest power of two >= n, rounded up to a multiple of `multiple` and capped at
    `limit`: few distinct shapes, so few compiled programs."""
    size = 1 << max(0, (n - 1).bit_length())
    size = -(-size // multiple) * multiple
    return max(n, min(size, limit)) if limit is not None else size


def pack(rows: list[np.ndarray], batch: int,
         prompt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded int32 tokens [batch, prompt], lengths int32 [batch] and live bool [batch];
    filler rows are one token 0 long and not live (their output is dropped)."""
    tokens = np.zeros((batch, prompt), np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :row.size] = row
        lengths[i] = row.size
    return tokens, lengths, np.arange(batch) < len(rows)


def unpack(rows: list[np.ndarray], buffer: np.ndarray, steps: int,
           eos_id: int | None) -> list[np.ndarray]:
    """Each prompt followed by its new tokens, cut after the first `eos_id` (kept)."""
    out = []
    for i, row in enumerate(rows):
        new = buffer[i, row.size:row.size + steps]
        if eos_id is not None:
            hits = np.flatnonzero(new == eos_id)
            if hits.size:
                new = new[:hits[0] + 1]
        out.append(np.concatenate([row, new]).astype(np.int32))
    return out


def unpack_routing(outputs: list[np.ndarray], routing: np.ndarray) -> list[np.ndarray]:
    """Each output's record int32 [len(output), L, k] (`unpack`'s rows) from the decode loop's
    `routing` [B, max_len, L, k]: the experts of every token fed (the prompt, the new tokens
    but the last), -1 on the last token (never fed)."""
    out = []
    for i, row in enumerate(outputs):
        record = np.full((row.size,) + routing.shape[2:], -1, np.int32)
        record[:row.size - 1] = routing[i, :row.size - 1]
        out.append(record)
    return out


def unpack_logprobs(rows: list[np.ndarray], outputs: list[np.ndarray],
                    logprobs: np.ndarray) -> list[np.ndarray]:
    """The float32 log-probs [new] of each output's new tokens (`unpack`'s rows), from the
    decode loop's `logprobs` [B, max_len] (aligned with its token buffer)."""
    return [logprobs[i, row.size:out.size].astype(np.float32)
            for i, (row, out) in enumerate(zip(rows, outputs))]
