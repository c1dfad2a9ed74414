"""The train/rollout log-prob gap and its correction, truncated importance sampling (TIS).

The rollout engine reports the log-probability it drew each answer token with
(`HybridEngine.generate(..., return_logprobs=True)`); the trainer computes the same tokens'
log-probs with its own forward (the "old" policy of the clipped ratio). The two programs differ
(a KV-cached decode of one token at a time, tensor-parallel over `inference_tp_size` devices,
against one full-sequence forward), so their float32 results may differ by rounding: the
samples then come from a policy slightly off the one the loss assumes. `logprob_gap` measures
that per iteration; `tis_weights` is the correction of TRL's GRPOTrainer
(`vllm_importance_sampling_correction` with `vllm_importance_sampling_cap`, after Yao et al.
2025, "Your efficient RL framework secretly brings you off-policy RL training"): every
per-token loss term is multiplied by min(exp(train_old - rollout), cap), a constant of the
rollout (no gradient flows through it).

Arrays are per answer token, [B, T], with `action_mask` 1 on real tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GAP_THRESHOLD = 1e-3        # a token's |train - rollout| above this counts in `frac_over_1e-3`


def logprob_gap(train_logprobs, rollout_logprobs, action_mask) -> dict[str, jax.Array]:
    """Over the real tokens: the largest |train - rollout| (`max`), its mean (`mean_abs`) and
    the share of tokens where it exceeds `GAP_THRESHOLD` (`frac_over_1e-3`); float32
    scalars, 0 for a batch with no real token."""
    mask = jnp.asarray(action_mask, jnp.float32)                            # [B, T]
    gap = jnp.abs(jnp.asarray(train_logprobs, jnp.float32)
                  - jnp.asarray(rollout_logprobs, jnp.float32)) * mask      # [B, T]
    count = jnp.maximum(jnp.sum(mask), 1.0)
    return {"max": jnp.max(gap), "mean_abs": jnp.sum(gap) / count,
            "frac_over_1e-3": jnp.sum((gap > GAP_THRESHOLD) * mask) / count}


def tis_weights(train_logprobs, rollout_logprobs, cap: float) -> jax.Array:
    """Truncated importance weights [B, T]: min(exp(train_old - rollout), cap), float32."""
    if not cap > 0:
        raise ValueError(f"cap={cap!r} is invalid; accepted: a number > 0")
    ratio = jnp.exp(jnp.asarray(train_logprobs, jnp.float32)
                    - jnp.asarray(rollout_logprobs, jnp.float32))
    return jnp.minimum(ratio, jnp.float32(cap))


def tis_clipped_fraction(train_logprobs, rollout_logprobs, action_mask, cap: float
                         ) -> jax.Array:
    """The share of real tokens whose importance ratio exp(train_old - rollout) exceeds `cap`
    (their weight is truncated to it)."""
    mask = jnp.asarray(action_mask, jnp.float32)
    ratio = jnp.exp(jnp.asarray(train_logprobs, jnp.float32)
                    - jnp.asarray(rollout_logprobs, jnp.float32))
    return jnp.sum((ratio > cap) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


__all__ = ["GAP_THRESHOLD", "logprob_gap", "tis_clipped_fraction", "tis_weights"]
