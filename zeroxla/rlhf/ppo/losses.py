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

from zeroxla.rlhf.answer_values import (answer_logprobs, answer_values, packed_logprobs,
                                        packed_replayed_logprobs, packed_values)


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


def _padded_under_sequence(sequence: Any) -> None:
    """ValueError for a padded PPO batch under sequence parallelism."""
    if sequence is not None:
        raise ValueError(f"a padded PPO batch under sequence parallelism (size {sequence.size}):"
                         " its answer columns [B, G] do not split along the sequence; accepted: "
                         "PPOConfig.packing=True (the default: every array per token), or a "
                         "mesh without a sequence axis")


def _packed_logprobs(model, batch, vocab_limit, sequence, experts) -> jax.Array:
    """The packed batch's log-probs [R, S]; with "replay" int32 [R, S, L, k] (routing replay,
    `packed_rollout`) every recorded token sent to its recorded experts, weighed by the live
    router (`packed_replayed_logprobs`)."""
    if "replay" in batch:
        return packed_replayed_logprobs(model, batch, vocab_limit, sequence, experts)[0]
    return packed_logprobs(model, batch, vocab_limit, sequence, experts)


# ---- make_step loss_fns -------------------------------------------------------------------------
def make_actor_loss(cliprange: float, vocab_limit: int | None = None):
    """`loss_fn(actor, batch) -> (sum, count)` with batch {"tokens": int32[B, P+G],
    "old_logprobs", "advantages", "action_mask": [B, G]}; the policy over the ids below
    `vocab_limit` (`answer_logprobs`). With rollout correction (`rollout_correction.
    corrected_batch`) "is_weights" [B, G] multiply each token's term (verl's
    `pg_losses * rollout_is_weights`) and "loss_mask" [B, G], the kept tokens, is what the
    loss sums and counts over (default "action_mask"). A packed batch (`packed_rollout`: the
    kept tokens are its "loss_weight", their number its "loss_count") runs under sequence
    parallelism too (every term per token; the step passes `sequence`), and under routing
    replay (`PPOConfig.routing_replay="on"`) with its "replay" record of each slot's experts."""
    def weighted(terms, batch):
        return terms * batch["is_weights"] if "is_weights" in batch else terms

    def actor_loss(model, batch, *, sequence=None, experts=None):
        mask = batch["action_mask"]
        if "segment_ids" in batch:         # packed (`packed_rollout`): the same token mean
            logprobs = jnp.where(mask > 0, _packed_logprobs(model, batch, vocab_limit,
                                                            sequence, experts),
                                 batch["old_logprobs"])                   # [R, S]
            terms = weighted(actor_loss_terms(logprobs, batch["old_logprobs"],
                                              batch["advantages"], mask, cliprange=cliprange),
                             batch)
            return (jnp.sum(terms * mask * batch["loss_weight"]),
                    jnp.sum(batch["loss_count"]))
        _padded_under_sequence(sequence)
        logprobs = answer_logprobs(model, batch["tokens"], mask.shape[1], vocab_limit,
                                   experts=experts)
        terms = weighted(actor_loss_terms(logprobs, batch["old_logprobs"], batch["advantages"],
                                          mask, cliprange=cliprange), batch)
        kept = batch.get("loss_mask", mask)                               # [B, G]
        return jnp.sum(terms * kept), jnp.sum(kept)
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
