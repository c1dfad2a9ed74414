"""The two PPO objectives of DeepSpeed-Chat (`actor_loss_fn`, `critic_loss_fn` in
`dschat/rlhf/ppo_trainer.py`), and the `loss_fn(model, batch)`s that train actor and critic
under `make_step`.

The pure functions take per-token arrays over the answer, [B, G], and return DeepSpeed-Chat's
masked mean. The `loss_fn`s return `(sum, count)` instead, so the ZeRO step averages exactly over
every real answer token of the global batch, not per device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zeroxla.engine.loss import model_token_logprobs


def actor_loss_terms(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                     action_mask: jax.Array, *, cliprange: float) -> jax.Array:
    """PPO's clipped surrogate per token [B, G] (Schulman et al. 2017, eq. 7, negated):
    `max(-A r, -A clip(r, 1 - eps, 1 + eps))` with `r = exp(logprobs - old_logprobs)`."""
    ratio = jnp.exp((logprobs - old_logprobs) * action_mask)             # [B, G]
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return jnp.maximum(pg_loss1, pg_loss2)


def critic_loss_terms(values: jax.Array, old_values: jax.Array, returns: jax.Array, *,
                      cliprange_value: float) -> jax.Array:
    """The clipped value loss per token [B, G]: `0.5 max((V - R)^2, (V_clip - R)^2)` with
    `V_clip = clip(V, V_old - eps, V_old + eps)`."""
    clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    return 0.5 * jnp.maximum(jnp.square(values - returns), jnp.square(clipped - returns))


def _masked_mean(terms: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(terms * mask) / jnp.sum(mask)


def actor_loss_fn(logprobs, old_logprobs, advantages, action_mask, *, cliprange):
    """DeepSpeed-Chat's `actor_loss_fn`: the clipped policy loss, mean over real tokens."""
    return _masked_mean(actor_loss_terms(logprobs, old_logprobs, advantages, action_mask,
                                         cliprange=cliprange), action_mask)


def critic_loss_fn(values, old_values, returns, action_mask, *, cliprange_value):
    """DeepSpeed-Chat's `critic_loss_fn`: the clipped value loss, mean over real tokens."""
    return _masked_mean(critic_loss_terms(values, old_values, returns,
                                          cliprange_value=cliprange_value), action_mask)


# ---- model outputs over the answer ------------------------------------------------------------
def answer_logprobs(model: nnx.Module, tokens: jax.Array, answer_length: int,
                    vocab_limit: int | None = None, *, experts: Any = None) -> jax.Array:
    """log pi(answer token t | everything before it) [B, G] for `tokens` int32[B, P + G]: the
    logits at positions P-1 .. P+G-2 against the tokens at P .. P+G-1. With `vocab_limit` (a
    model vocabulary padded past its tokenizer's), pi is the softmax over the ids below it,
    the distribution the rollouts draw from (`zeroxla.inference.Sampling.vocab_limit`). The
    logits never exist whole where the model is chunked (`model_token_logprobs`). `experts`:
    an MoE model's `ExpertParallel` inside the step."""
    logprobs = model_token_logprobs(model, tokens[:, :-1], tokens[:, 1:],
                                    vocab_limit=vocab_limit, experts=experts)  # [B, P+G-1]
    return logprobs[:, -answer_length:]                                   # [B, G]


def answer_values(critic: nnx.Module, tokens: jax.Array, answer_length: int, *,
                  experts: Any = None) -> jax.Array:
    """The critic's value of the state before each answer token [B, G] (positions P-1 ..
    P+G-2, DeepSpeed-Chat's `values[:, :-1][:, start:]`); `experts` passed when given."""
    options = {} if experts is None else {"experts": experts}
    return critic(tokens[:, :-1], **options)[:, -answer_length:].astype(jnp.float32)


def packed_logprobs(model: nnx.Module, batch: dict[str, jax.Array],
                    vocab_limit: int | None = None, sequence: Any = None,
                    experts: Any = None) -> jax.Array:
    """The log-prob of each slot's target [R, S] on a packed rollout
    (`zeroxla.rlhf.packed_rollout`): a slot whose target is answer token t holds
    `answer_logprobs`' value at t. `sequence`: the arrays are this device's [R, S/P] slice;
    `experts`: an MoE model's `ExpertParallel`."""
    return model_token_logprobs(model, batch["inputs"], batch["targets"],
                                positions=batch["positions"], segment_ids=batch["segment_ids"],
                                vocab_limit=vocab_limit, sequence=sequence,
                                experts=experts)                          # [R, S]


def packed_values(critic: nnx.Module, batch: dict[str, jax.Array],
                  sequence: Any = None, experts: Any = None) -> jax.Array:
    """The critic's value of each slot's state [R, S] on a packed rollout: a slot whose target
    is answer token t holds `answer_values`' value at t."""
    options = {name: value for name, value in (("sequence", sequence), ("experts", experts))
               if value is not None}
    return critic(batch["inputs"], positions=batch["positions"],
                  segment_ids=batch["segment_ids"], **options).astype(jnp.float32)   # [R, S]


def _padded_under_sequence(sequence: Any) -> None:
    """ValueError for a padded PPO batch under sequence parallelism."""
    if sequence is not None:
        raise ValueError(f"a padded PPO batch under sequence parallelism (size {sequence.size}):"
                         " its answer columns [B, G] do not split along the sequence; accepted: "
                         "PPOConfig.packing=True (the default: every array per token), or a "
                         "mesh without a sequence axis")


# ---- make_step loss_fns -------------------------------------------------------------------------
def make_actor_loss(cliprange: float, vocab_limit: int | None = None):
    """`loss_fn(actor, batch) -> (sum, count)` with batch {"tokens": int32[B, P+G],
    "old_logprobs", "advantages", "action_mask": [B, G]}; the policy over the ids below
    `vocab_limit` (`answer_logprobs`). A packed batch (`packed_rollout`) runs under sequence
    parallelism too (every term per token; the step passes `sequence`)."""
    def actor_loss(model, batch, *, sequence=None, experts=None):
        mask = batch["action_mask"]
        if "segment_ids" in batch:         # packed (`packed_rollout`): the same token mean
            logprobs = jnp.where(mask > 0, packed_logprobs(model, batch, vocab_limit, sequence,
                                                           experts),
                                 batch["old_logprobs"])                   # [R, S]
            terms = actor_loss_terms(logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                     cliprange=cliprange)
            return jnp.sum(terms * mask), jnp.sum(batch["loss_count"])
        _padded_under_sequence(sequence)
        logprobs = answer_logprobs(model, batch["tokens"], mask.shape[1], vocab_limit,
                                   experts=experts)
        terms = actor_loss_terms(logprobs, batch["old_logprobs"], batch["advantages"], mask,
                                 cliprange=cliprange)
        return jnp.sum(terms * mask), jnp.sum(mask)
    return actor_loss


def make_critic_loss(cliprange_value: float):
    """`loss_fn(critic, batch) -> (sum, count)` with batch {"tokens": int32[B, P+G],
    "old_values", "returns", "action_mask": [B, G]}; packed, under sequence parallelism too."""
    def critic_loss(model, batch, *, sequence=None, experts=None):
        mask = batch["action_mask"]
        if "segment_ids" in batch:         # packed: each answer slot holds its state's value
            values = packed_values(model, batch, sequence, experts)       # [R, S]
            terms = critic_loss_terms(values, batch["old_values"], batch["returns"],
                                      cliprange_value=cliprange_value)
            return jnp.sum(jnp.where(mask > 0, terms, 0.0)), jnp.sum(batch["loss_count"])
        _padded_under_sequence(sequence)
        values = answer_values(model, batch["tokens"], mask.shape[1], experts=experts)
        terms = critic_loss_terms(values, batch["old_values"], batch["returns"],
                                  cliprange_value=cliprange_value)
        return jnp.sum(terms * mask), jnp.sum(mask)
    return critic_loss
