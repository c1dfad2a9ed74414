"""Per-token values over a rollout's answers, the one module every RL algorithm reads them from:
the log-prob of each answer token under a model and a critic's value of the state before it,
from padded rows or a packed batch.

    padded rows   `tokens` int32[B, P + G]: row b's prompt at 0 .. L_b - 1 (`prompt_lengths`,
                  1 <= L_b <= P; PPO's left-padded prompts are all P) and its answer from L_b.
                  Answer token t is predicted at L_b - 1 + t.
    packed batch  {"inputs", "targets", "positions", "segment_ids"} int32[R, S]
                  (`packed_rollout`, `packed_pairs`): each slot holds the value of its own
                  target, so the slot whose target is answer token t holds the padded
                  forward's value at t. Under sequence parallelism the arrays are this
                  device's [R, S/P] slice (`sequence`).

With `vocab_limit` (a model vocabulary padded past its tokenizer's), pi is the softmax over the
ids below it, the distribution the rollouts draw from (`zeroxla.inference.Sampling`). The
logits never exist whole where the model is chunked (`engine.loss.model_token_logprobs`).
`experts`: an MoE model's `ExpertParallel` inside a step, passed to the model when given. The
algorithms' losses (`ppo.losses`, `grpo.losses`, `dpo.losses`) and the trainers' reads in the step's
layout (`answer_forward`) all call these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zeroxla.engine import router_aux
from zeroxla.engine.loss import model_token_logprobs


def _given(**options: Any) -> dict[str, Any]:
    """The keyword arguments of `options` that are not None (a dense model's forward takes no
    `experts`, and is never given one)."""
    return {name: value for name, value in options.items() if value is not None}


def token_logprob_rows(model: nnx.Module, tokens: jax.Array, experts: Any = None) -> jax.Array:
    """log p(token t+1 | tokens <= t) [B, T-1] for `tokens` int32[B, T]."""
    return model_token_logprobs(model, tokens[:, :-1], tokens[:, 1:],
                                experts=experts)                                 # [B, T-1]


def answer_logprobs(model: nnx.Module, tokens: jax.Array, answer_length: int,
                    vocab_limit: int | None = None, *, experts: Any = None) -> jax.Array:
    """log pi(answer token t | everything before it) [B, G] for `tokens` int32[B, P + G]
    (every prompt P tokens): the logits at positions P-1 .. P+G-2 against the tokens at
    P .. P+G-1."""
    logprobs = model_token_logprobs(model, tokens[:, :-1], tokens[:, 1:],
                                    vocab_limit=vocab_limit, experts=experts)  # [B, P+G-1]
    return logprobs[:, -answer_length:]                                   # [B, G]


def routed_ragged_answer_logprobs(model: nnx.Module, tokens: jax.Array,
                                  prompt_lengths: jax.Array, answer_length: int,
                                  vocab_limit: int | None = None, experts: Any = None):
    """`ragged_answer_logprobs` and an MoE model's router statistics over every position of
    the rows (None for a dense one: `engine.router_aux.routed_token_logprobs`)."""
    logprobs, stats = router_aux.routed_token_logprobs(
        model, tokens[:, :-1], tokens[:, 1:], vocab_limit=vocab_limit,
        **_given(experts=experts))                                        # [B, P+G-1]
    at = prompt_lengths[:, None] - 1 + jnp.arange(answer_length)          # [B, G]
    return jnp.take_along_axis(logprobs, at, axis=1), stats               # [B, G]


def ragged_answer_logprobs(model: nnx.Module, tokens: jax.Array, prompt_lengths: jax.Array,
                           answer_length: int, vocab_limit: int | None = None) -> jax.Array:
    """log pi(answer token t | its row before it) [B, G] for right-padded rows (module
    docstring): the logits at L_b - 1 + t against the token at L_b + t. Causal attention sees
    only the row's earlier (real) tokens, at their true positions, so each row's log-probs are
    those of its prompt and answer alone."""
    return routed_ragged_answer_logprobs(model, tokens, prompt_lengths, answer_length,
                                         vocab_limit)[0]


def answer_values(critic: nnx.Module, tokens: jax.Array, answer_length: int, *,
                  experts: Any = None) -> jax.Array:
    """The critic's value of the state before each answer token [B, G] (positions P-1 ..
    P+G-2, DeepSpeed-Chat's `values[:, :-1][:, start:]`) of `tokens` int32[B, P + G]."""
    return critic(tokens[:, :-1], **_given(experts=experts))[:, -answer_length:].astype(
        jnp.float32)


def padded_logprobs(model: nnx.Module, batch: dict[str, jax.Array], *, answer_length: int,
                    vocab_limit: int | None = None, experts: Any = None) -> jax.Array:
    """`ragged_answer_logprobs` [B, G] of padded rows {"tokens" int32[B, P + G],
    "prompt_lengths" int32[B]}: the `TokenForward` form."""
    return routed_ragged_answer_logprobs(model, batch["tokens"], batch["prompt_lengths"],
                                         answer_length, vocab_limit, experts)[0]


def padded_values(critic: nnx.Module, batch: dict[str, jax.Array], *, answer_length: int,
                  experts: Any = None) -> jax.Array:
    """The critic's value of the state before each answer token [B, G] of padded rows
    {"tokens" int32[B, P + G], "prompt_lengths" int32[B]}: the `TokenForward` form."""
    tokens = batch["tokens"]
    values = critic(tokens[:, :-1], **_given(experts=experts))            # [B, P+G-1]
    at = batch["prompt_lengths"][:, None] - 1 + jnp.arange(answer_length)  # [B, G]
    return jnp.take_along_axis(values, at, axis=1).astype(jnp.float32)


def packed_logprobs(model: nnx.Module, batch: dict[str, jax.Array],
                    vocab_limit: int | None = None, sequence: Any = None,
                    experts: Any = None) -> jax.Array:
    """The log-prob of each slot's target [R, S] of a packed batch (module docstring)."""
    return model_token_logprobs(model, batch["inputs"], batch["targets"],
                                positions=batch["positions"], segment_ids=batch["segment_ids"],
                                vocab_limit=vocab_limit, sequence=sequence,
                                experts=experts)                          # [R, S]


def packed_replayed_logprobs(model: nnx.Module, batch: dict[str, jax.Array],
                             vocab_limit: int | None = None, sequence: Any = None,
                             experts: Any = None, follow_record: bool = True
                             ) -> tuple[jax.Array, jax.Array]:
    """`packed_logprobs` [R, S] under routing replay, and per slot the number of MoE layers
    whose live choice is not the record, int32 [R, S]: batch["replay"] int32 [R, S, L, k] the
    experts recorded for each slot's input token (-1: none, routed live; `packed_rollout`).
    `follow_record=False`: every token routed live, the record only compared."""
    logprobs, _, mismatches = model.replayed_token_logprobs(
        batch["inputs"], batch["targets"], batch["replay"], positions=batch["positions"],
        segment_ids=batch["segment_ids"], vocab_limit=vocab_limit,
        follow_record=follow_record, **_given(sequence=sequence, experts=experts))
    return logprobs, mismatches                                           # [R, S] each


def packed_values(critic: nnx.Module, batch: dict[str, jax.Array],
                  sequence: Any = None, experts: Any = None) -> jax.Array:
    """The critic's value of each slot's state [R, S] of a packed batch: a slot whose target
    is answer token t holds `answer_values`' value at t."""
    return critic(batch["inputs"], positions=batch["positions"],
                  segment_ids=batch["segment_ids"],
                  **_given(sequence=sequence, experts=experts)).astype(jnp.float32)  # [R, S]


__all__ = ["answer_logprobs", "answer_values", "packed_logprobs", "packed_replayed_logprobs",
           "packed_values",
           "padded_logprobs", "padded_values", "ragged_answer_logprobs",
           "routed_ragged_answer_logprobs", "token_logprob_rows"]
