"""The GRPO family's policy loss (TRL's `GRPOTrainer._compute_loss`) as pure functions over the
answer's per-token arrays [B, G], and the `loss_fn(model, batch)` that trains the actor under
`make_step`.

Per token: the clipped surrogate with separate lower and upper clips (DAPO's clip-higher),
`-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)` with `r = exp(logprobs - old_logprobs)`
and A the answer's group-relative advantage, plus `beta` times the k3 estimator of
KL(policy || reference), `exp(ref - logp) - (ref - logp) - 1` (Schulman's k3: unbiased,
non-negative). With rollout correction (`rollout_correction.RolloutCorrection`), each token's
policy term is multiplied by its weight `is_weights` (verl's order: the KL term unweighted), or
with `kl_weighted` its whole term (TRL's order: after the KL term is added; the
`--rollout-correction tis` alias); rejected tokens are out of the aggregation ("loss_mask"). The terms
of the real answer tokens are aggregated by `loss_type`:

  grpo     mean over each answer's tokens, then mean over answers (Shao et al. 2024)
  dr_grpo  sum over every token / (B * max_completion_length) (Dr.GRPO: no length bias)
  dapo     sum over every token / number of real tokens in the batch (token-level)

`grpo_loss_parts` returns the aggregation as `(sum, count)`, the pair `make_step` divides over
the global batch, so each loss is exact however the batch is sharded.

Prompts of different lengths are right-padded (`prompts`): row b's answer starts at its
own prompt length, and `answer_values.ragged_answer_logprobs` reads each row's answer from there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroxla.engine import router_aux
from zeroxla.rlhf.answer_values import (ragged_answer_logprobs,
                                        routed_ragged_answer_logprobs)


def grpo_loss_terms(logprobs, old_logprobs, advantages, *, epsilon: float, epsilon_high: float,
                    beta: float = 0.0, ref_logprobs=None, is_weights=None,
                    kl_weighted: bool = True):
    """Per-token loss [B, G] (see the module docstring); `advantages` is [B] (one per answer)
    or [B, G] (per token: a packed batch's); `ref_logprobs` [B, G] is needed when `beta` > 0;
    `is_weights` [B, G] multiply the policy term, and with `kl_weighted` the KL term too."""
    ratio = jnp.exp(logprobs - old_logprobs)                              # [B, G]
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    a = advantages if advantages.ndim == ratio.ndim else advantages[:, None]      # [B, 1|G]
    terms = -jnp.minimum(ratio * a, clipped * a)
    if is_weights is not None and not kl_weighted:
        terms = terms * is_weights
    if beta:
        if ref_logprobs is None:
            raise ValueError(f"beta={beta} needs ref_logprobs; accepted: beta=0 or the "
                             "reference's log-probs [B, G]")
        delta = ref_logprobs - logprobs
        terms = terms + beta * (jnp.exp(delta) - delta - 1.0)
    if is_weights is not None and kl_weighted:
        terms = terms * is_weights
    return terms


def grpo_loss_parts(terms, action_mask, loss_type: str):
    """`(sum, count)` of the real tokens' `terms` [B, G] under `loss_type`."""
    mask = action_mask.astype(terms.dtype)
    masked = terms * mask                                                 # [B, G]
    if loss_type == "grpo":
        per_answer = jnp.sum(masked, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)  # [B]
        return jnp.sum(per_answer), jnp.asarray(mask.shape[0], terms.dtype)
    if loss_type == "dr_grpo":
        return jnp.sum(masked), jnp.asarray(mask.size, terms.dtype)
    if loss_type == "dapo":
        return jnp.sum(masked), jnp.sum(mask)
    raise ValueError(f"loss_type={loss_type!r} is invalid; accepted: grpo | dr_grpo | dapo")


def grpo_loss(logprobs, old_logprobs, advantages, action_mask, *, loss_type: str, epsilon: float,
              epsilon_high: float, beta: float = 0.0, ref_logprobs=None, is_weights=None,
              kl_weighted: bool = True):
    """The scalar loss of one batch: `sum / count` of `grpo_loss_parts` (the terms weighted
    by `is_weights` [B, G] when given, as `grpo_loss_terms`)."""
    terms = grpo_loss_terms(logprobs, old_logprobs, advantages, epsilon=epsilon,
                            epsilon_high=epsilon_high, beta=beta, ref_logprobs=ref_logprobs,
                            is_weights=is_weights, kl_weighted=kl_weighted)
    total, count = grpo_loss_parts(terms, action_mask, loss_type)
    return total / count


def clip_fractions(logprobs, old_logprobs, advantages, action_mask, *, epsilon: float,
                   epsilon_high: float) -> dict[str, jax.Array]:
    """The share of real tokens whose gradient the clip removes: the ratio below
    `1 - epsilon` with A < 0 (`clip_low`), above `1 + epsilon_high` with A > 0 (`clip_high`),
    and their sum (`clip_fraction`), as TRL logs them."""
    ratio = jnp.exp(logprobs - old_logprobs)
    a = advantages[:, None]
    mask = action_mask.astype(ratio.dtype)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    low = jnp.sum(((ratio < 1.0 - epsilon) & (a < 0)) * mask) / count
    high = jnp.sum(((ratio > 1.0 + epsilon_high) & (a > 0)) * mask) / count
    return {"clip_low": low, "clip_high": high, "clip_fraction": low + high}


def packed_loss_parts(model, batch, *, epsilon: float, epsilon_high: float, beta: float,
                      vocab_limit: int | None, sequence=None, experts=None,
                      kl_weighted: bool = True):
    """`(sum, count)` of a packed rollout (`zeroxla.rlhf.packed_rollout.pack_rollout`: every
    array [R, S], the per-answer values already per token): the terms of the answer slots
    times `loss_weight`, over the sum of `loss_count`. Slots that are not an answer token
    compute their terms from neutral values (ratio 1, no KL), so no overflow there can reach
    the gradient through the mask. Every term is per token, so under sequence parallelism
    (`sequence`: the arrays are this device's [R, S/P] slice) the step's sums over the
    devices are the whole batch's; `experts`: an MoE actor's `ExpertParallel`. With
    "replay" int32 [R, S, L, k] (routing replay, `packed_rollout`) every recorded token goes to
    its recorded experts, weighed by the live router (`MoeLlama.replayed_token_logprobs`); the
    auxiliary loss's statistics stay the live router's."""
    mask = batch["action_mask"]
    answer = mask > 0
    options = {} if experts is None else {"experts": experts}
    if "replay" in batch:           # routing replay: the recorded selection, the live weights
        logprobs, stats, _ = model.replayed_token_logprobs(
            batch["inputs"], batch["targets"], batch["replay"], positions=batch["positions"],
            segment_ids=batch["segment_ids"], vocab_limit=vocab_limit, sequence=sequence,
            **options)                                                      # [R, S]
    else:
        logprobs, stats = router_aux.routed_token_logprobs(
            model, batch["inputs"], batch["targets"], positions=batch["positions"],
            segment_ids=batch["segment_ids"], vocab_limit=vocab_limit, sequence=sequence,
            **options)                                                      # [R, S]
    old = batch["old_logprobs"]
    ref = batch.get("ref_logprobs")
    terms = grpo_loss_terms(jnp.where(answer, logprobs, old), old, batch["advantages"],
                            epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                            ref_logprobs=None if ref is None else jnp.where(answer, ref, old),
                            is_weights=batch.get("is_weights"), kl_weighted=kl_weighted)
    return with_stats((jnp.sum(jnp.where(answer, terms * mask * batch["loss_weight"], 0.0)),
                       jnp.sum(batch["loss_count"])), stats)


def with_stats(parts, stats):
    """`(sum, count)`, with an MoE actor's router statistics as a third value (the step adds
    its auxiliary loss and logs the per-expert load: `zeroxla.engine.router_aux`)."""
    return parts if stats is None else (*parts, stats)


def make_grpo_loss(*, loss_type: str, epsilon: float, epsilon_high: float, beta: float = 0.0,
                   vocab_limit: int | None = None, kl_weighted: bool = True):
    """`loss_fn(actor, batch) -> (sum, count)` with batch {"tokens": int32[B, P+G],
    "old_logprobs": [B, G], "advantages": [B], "action_mask": [B, G]}, "prompt_lengths"
    int32[B] for prompts shorter than P (right-padded; absent: every prompt is P tokens),
    when `beta` > 0 "ref_logprobs": [B, G], and with importance sampling "is_weights": [B, G]
    (`kl_weighted`: the KL term weighted too, as `grpo_loss_terms`), with rejection
    "loss_mask": [B, G], the tokens the loss aggregates over (default "action_mask"). The policy is the softmax over the ids below `vocab_limit`
    (`ragged_answer_logprobs`). A packed rollout (its "segment_ids": `packed_rollout`) is
    aggregated by its own per-token weights (`packed_loss_parts`), the same loss; only it runs
    under sequence parallelism (the step passes `sequence`; a padded rollout's per-answer
    arrays cannot be split along the sequence, and is refused naming `GRPOConfig.packing`)."""
    def grpo_actor_loss(model, batch, *, sequence=None, experts=None):
        if "segment_ids" in batch:
            return packed_loss_parts(model, batch, epsilon=epsilon, epsilon_high=epsilon_high,
                                     beta=beta, vocab_limit=vocab_limit, sequence=sequence,
                                     experts=experts, kl_weighted=kl_weighted)
        if sequence is not None:
            raise ValueError(f"a padded GRPO batch under sequence parallelism (size "
                             f"{sequence.size}): its per-answer arrays [B, G] and [B] do not "
                             "split along the sequence; accepted: GRPOConfig.packing=True (the "
                             "default: every array per token), or a mesh without a sequence "
                             "axis")
        mask, tokens = batch["action_mask"], batch["tokens"]
        lengths = batch.get("prompt_lengths")
        if lengths is None:
            lengths = jnp.full(tokens.shape[:1], tokens.shape[1] - mask.shape[1], jnp.int32)
        logprobs, stats = routed_ragged_answer_logprobs(model, tokens, lengths, mask.shape[1],
                                                         vocab_limit, experts)
        terms = grpo_loss_terms(logprobs, batch["old_logprobs"], batch["advantages"],
                                epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
                                ref_logprobs=batch.get("ref_logprobs"),
                                is_weights=batch.get("is_weights"), kl_weighted=kl_weighted)
        return with_stats(grpo_loss_parts(terms, batch.get("loss_mask", mask), loss_type),
                          stats)
    return grpo_actor_loss


__all__ = ["clip_fractions", "grpo_loss", "grpo_loss_parts", "grpo_loss_terms", "make_grpo_loss",
           "packed_loss_parts", "ragged_answer_logprobs"]
