"""The train/rollout log-prob gap and its correction: truncated importance sampling (TIS) and
verl's rollout-correction set (`RolloutCorrection`, `rollout_correction`).

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

`RolloutCorrection` is verl's `algorithm.rollout_correction` (verl/trainer/ppo/
rollout_corr_helper.py: `compute_rollout_correction_and_rejection_mask`, with the
"geometric" level and the two-sided band of its first version, verl/trainer/ppo/
mismatch_helper.py `compute_rollout_importance_weights`, rollout_is_mode "clip"), over the
log-ratio `old - rollout` (log pi_train / pi_rollout), clamped to +-20 before `exp`:

  importance sampling (is_level)  token: exp(log-ratio); sequence: exp(its sum over the
      answer); geometric: exp(its mean). Only `is_threshold` U: min(w, U) (TIS); with
      `is_threshold_lower` L too: w where L <= w <= U, else 0 (IcePop's band; L = 0 is
      AReaL's `behav_imp_weight_cap` filter, `RolloutCorrection.decoupled`). Constants
      of the rollout: no gradient flows through them. Each token's policy term is multiplied
      by its weight (verl's `pg_losses * rollout_is_weights`; the KL term is not, unless
      `kl_weighted`: TRL's order, the term with its KL, the `--rollout-correction tis` alias).
  rejection sampling (rs = (level, statistic))  per token k1 = -log-ratio, k2 = log-ratio^2 / 2,
      k3 = exp(log-ratio) - 1 - log-ratio; level token: each token's; seq_sum / seq_mean /
      seq_max: the answer's sum / mean / max (seq_max of k1 is not one of verl's). A token
      is kept when the statistic is <= `rs_threshold` (k2, k3) or within
      [log(`rs_threshold_lower`), log(`rs_threshold`)] (k1; lower default 1/upper); a
      rejected token leaves the loss's mask, so also its count.
  bypass  the rollout's log-probs are pi_old (the ratio's denominator); the ratio itself is
      the importance weight, so no weight is applied (verl's bypass "ppo_clip"), and the
      rejection mask is computed from the training forward's log-probs at rollout time
      (verl's current policy, equal to it at the first step of a rollout).

Arrays are per answer token, [B, T], with `action_mask` 1 on real tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

GAP_THRESHOLD = 1e-3        # a token's |train - rollout| above this counts in `frac_over_1e-3`
SAFETY_BOUND = 20.0         # verl's: log-ratios are clamped to [-20, 20] before exp
IS_LEVELS = ("token", "sequence", "geometric")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_STATISTICS = ("k1", "k2", "k3")


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


class RolloutCorrectionError(ValueError):
    """A bad RolloutCorrection value: its `field`, `value` and what is `accepted` (a job names
    the option instead)."""

    def __init__(self, field: str, value: Any, accepted: str):
        super().__init__(f"RolloutCorrection.{field}={value!r} is invalid; accepted: {accepted}")
        self.field, self.value, self.accepted = field, value, accepted


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """verl's rollout correction (the module docstring); the default corrects nothing."""

    is_level: str | None = None
    is_threshold: float = 2.0
    is_threshold_lower: float | None = None
    rs: tuple[str, str] | None = None            # (level, statistic), e.g. ("token", "k3")
    rs_threshold: float | None = None
    rs_threshold_lower: float | None = None
    bypass: bool = False
    kl_weighted: bool = False

    def __post_init__(self) -> None:
        checks = (
            ("is_level", self.is_level is None or self.is_level in IS_LEVELS,
             "None | " + " | ".join(IS_LEVELS)),
            ("is_threshold", _positive(self.is_threshold), "a number > 0 (the upper bound)"),
            ("is_threshold_lower", self.is_threshold_lower is None or (
                _positive(self.is_threshold_lower) or _zero(self.is_threshold_lower)) and (
                _positive(self.is_threshold) and self.is_threshold_lower < self.is_threshold),
             f"None or a number in [0, is_threshold={self.is_threshold!r}) (0: AReaL's "
             "filter, weights above is_threshold are 0)"),
            ("rs", self.rs is None or (
                isinstance(self.rs, tuple) and len(self.rs) == 2 and self.rs[0] in RS_LEVELS
                and self.rs[1] in RS_STATISTICS and self.rs != ("seq_max", "k1")),
             f"None or (level, statistic): level {' | '.join(RS_LEVELS)}, statistic "
             f"{' | '.join(RS_STATISTICS)} (not seq_max with k1, as verl)"),
            ("rs_threshold", (self.rs_threshold is None) == (self.rs is None) and (
                self.rs_threshold is None or _positive(self.rs_threshold)),
             "a number > 0 with rs (the statistic's upper bound), None without"),
            ("rs_threshold_lower", self.rs_threshold_lower is None or (
                _positive(self.rs_threshold_lower) and self.rs is not None
                and self.rs[1] == "k1"),
             "None or a number > 0 with a k1 statistic (default 1 / rs_threshold)"),
            ("bypass", isinstance(self.bypass, bool), "True or False"),
            ("kl_weighted", isinstance(self.kl_weighted, bool), "True or False"))
        for field, ok, accepted in checks:
            if not ok:
                raise RolloutCorrectionError(field, getattr(self, field), accepted)

    @property
    def active(self) -> bool:
        """Whether anything is corrected, rejected or substituted."""
        return self.is_level is not None or self.rs is not None or self.bypass

    @classmethod
    def tis(cls, cap: float) -> "RolloutCorrection":
        """`--rollout-correction tis --tis-cap C`: token IS at C, the KL term weighted too
        (TRL's order)."""
        return cls(is_level="token", is_threshold=cap, kl_weighted=True)

    @classmethod
    def decoupled(cls, cap: float | None) -> "RolloutCorrection":
        """AReaL's decoupled PPO (`--rollout-correction decoupled`): the ratio's pi_old is the
        proximal policy (the training forward now) and each token's policy term is weighted
        by pi_prox / pi_behav (the engine's log-prob of the version that drew it), a weight
        above `cap` set to 0 (AReaL's `behav_imp_weight_cap` filter; the token stays in the
        count), None: uncapped. The KL term is not weighted (AReaL has none in the loss)."""
        return cls(is_level="token", is_threshold=math.inf if cap is None else cap,
                   is_threshold_lower=0.0)


def _masked_mean(values, mask, axis=None):
    """verl's `masked_mean`: sum(values * mask) / (sum(mask) + 1e-8)."""
    return jnp.sum(values * mask, axis=axis) / (jnp.sum(mask, axis=axis) + 1e-8)


def _masked_max(values, mask, axis=None):
    return jnp.max(jnp.where(mask > 0, values, -jnp.inf), axis=axis)


def importance_weights(config: RolloutCorrection, log_ratio, mask
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weights [B, T] (0 off `mask`) of `config.is_level` and their metrics, verl's
    `rollout_is_*` names: mean and max before truncation, the shares above the upper and
    below the lower bound (1 / upper without a band: of the tokens, or with sequence and
    geometric of the answers, as verl), and the share of tokens truncated or zeroed."""
    upper = config.is_threshold
    lower = 1.0 / upper if config.is_threshold_lower is None else config.is_threshold_lower
    if config.is_level == "token":
        level, units = log_ratio, mask                                       # [B, T]
    elif config.is_level == "sequence":
        level = jnp.sum(log_ratio * mask, axis=-1, keepdims=True)            # [B, 1]
    else:
        level = _masked_mean(log_ratio, mask, axis=-1)[:, None]              # [B, 1]
    if config.is_level != "token":
        units = jnp.any(mask > 0, axis=-1, keepdims=True).astype(mask.dtype)   # [B, 1]
    unit_weight = jnp.exp(jnp.clip(level, -SAFETY_BOUND, SAFETY_BOUND))     # [B, T|1]
    raw = unit_weight * mask                                                 # [B, T]
    if config.is_threshold_lower is None:
        weights, changed = jnp.minimum(raw, upper), raw > upper
    else:
        inside = (raw >= lower) & (raw <= upper)
        weights, changed = raw * inside, ~inside
    metrics = {"rollout_is_mean": _masked_mean(raw, mask),
               "rollout_is_max": _masked_max(raw, mask),
               "rollout_is_ratio_fraction_high": _masked_mean(unit_weight > upper, units),
               "rollout_is_ratio_fraction_low": _masked_mean(unit_weight < lower, units),
               "rollout_is_clipped_fraction": _masked_mean(changed, mask)}
    return weights, metrics


def rejection_mask(config: RolloutCorrection, log_ratio, mask
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The kept-token mask [B, T] of `config.rs` and its metrics, verl's
    `rollout_rs_{level}_{statistic}_*` names (the statistic's mean over real tokens, its
    max and min over tokens or answers, the token share masked) and `rollout_rs_masked_fraction`,
    `rollout_rs_seq_masked_fraction` (answers with a rejected token)."""
    level, statistic = config.rs
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": jnp.exp(safe) - 1.0 - safe}[statistic]
    if level == "token":
        stat, units = per_token, mask                                        # [B, T]
    else:
        seq = {"seq_sum": lambda: jnp.sum(per_token * mask, axis=-1),
               "seq_mean": lambda: _masked_mean(per_token, mask, axis=-1),
               "seq_max": lambda: jnp.where(jnp.any(mask > 0, axis=-1),
                                            _masked_max(per_token, mask, axis=-1), 0.0)}[level]()
        stat = seq[:, None]                                                  # [B, 1]
        units = jnp.any(mask > 0, axis=-1, keepdims=True).astype(mask.dtype)
    if statistic == "k1":
        low = config.rs_threshold_lower or 1.0 / config.rs_threshold
        keep = (stat >= math.log(low)) & (stat <= math.log(config.rs_threshold))
    else:
        keep = stat <= config.rs_threshold
    kept = mask * jnp.broadcast_to(keep, mask.shape)                         # [B, T]
    name = f"rollout_rs_{level}_{statistic}"
    rejected_rows = jnp.any((mask > 0) & (kept == 0), axis=-1)
    metrics = {f"{name}_mean": _masked_mean(jnp.broadcast_to(stat, mask.shape), mask),
               f"{name}_max": _masked_max(jnp.broadcast_to(stat, units.shape), units),
               f"{name}_min": -_masked_max(-jnp.broadcast_to(stat, units.shape), units),
               "rollout_rs_masked_fraction": _masked_mean(1.0 - kept, mask),
               "rollout_rs_seq_masked_fraction": jnp.mean(rejected_rows)}
    return kept, metrics


def rollout_correction(config: RolloutCorrection, old_logprobs, rollout_logprobs, action_mask
                       ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(weights [B, T], kept mask [B, T], metrics) of `config` for the training forward's
    `old_logprobs` and the engine's `rollout_logprobs` [B, T], float32. Weights are 1 on
    real tokens without IS; the metrics, under `rollout_corr/`, always hold verl's
    off-policy `kl` (mean of k1: rollout - old) and `k3_kl` over the real tokens."""
    mask = jnp.asarray(action_mask, jnp.float32)
    log_ratio = (jnp.asarray(old_logprobs, jnp.float32)
                 - jnp.asarray(rollout_logprobs, jnp.float32)) * mask          # [B, T]
    metrics = {"kl": _masked_mean(-log_ratio, mask),
               "k3_kl": _masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask)}
    weights, kept = mask, mask
    if config.is_level is not None:
        weights, is_metrics = importance_weights(config, log_ratio, mask)
        metrics.update(is_metrics)
    if config.rs is not None:
        kept, rs_metrics = rejection_mask(config, log_ratio, mask)
        metrics.update(rs_metrics)
    return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def corrected_batch(config: RolloutCorrection, batch: dict[str, Any], rollout_logprobs
                    ) -> tuple[dict[str, Any], dict[str, float]]:
    """`batch` (its "old_logprobs" the training forward's, "action_mask" [B, T]) with
    `config` applied, and the metrics: "loss_mask" the kept tokens (the loss aggregates over
    them; "action_mask" stays the answers' tokens, which packing places), "is_weights" the
    weights (IS without bypass), "old_logprobs" the rollout's (bypass). Every other key,
    "ref_logprobs" among them, is unchanged."""
    weights, kept, metrics = rollout_correction(config, batch["old_logprobs"], rollout_logprobs,
                                                batch["action_mask"])
    out = {**batch, "loss_mask": np.asarray(kept, np.float32)}
    if config.bypass:
        out["old_logprobs"] = np.asarray(rollout_logprobs, np.float32)
    elif config.is_level is not None:
        out["is_weights"] = np.asarray(weights, np.float32)
    return out, {k: float(v) for k, v in metrics.items()}


__all__ = ["GAP_THRESHOLD", "IS_LEVELS", "RS_LEVELS", "RS_STATISTICS", "RolloutCorrection",
           "RolloutCorrectionError", "corrected_batch", "importance_weights", "logprob_gap",
           "rejection_mask", "rollout_correction", "tis_clipped_fraction", "tis_weights"]
