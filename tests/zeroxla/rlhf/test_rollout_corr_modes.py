"""verl's rollout-correction set (zeroxla/rlhf/rollout_correction.py) against float64 numpy
written here from verl's definitions (verl/trainer/ppo/rollout_corr_helper.py and, for the
geometric level and the two-sided band, the first version's mismatch_helper.py), on injected
train/rollout log-prob gaps: the weights, the kept-token mask, the metrics, and the GRPO (DAPO)
loss with the weights on the policy term and the rejected tokens out of the count, within 1e-6.
The wiring checks: swapping the IS arguments (old vs rollout) and computing the KL term against
the rollout's log-probs instead of the reference's change the loss by far more than that."""

import numpy as np
import pytest

from zeroxla.rlhf.grpo.losses import grpo_loss
from zeroxla.rlhf.rollout_correction import (RolloutCorrection, corrected_batch,
                                             rollout_correction)

RNG = np.random.default_rng(7)
B, T = 6, 7
OLD = -RNG.uniform(0.1, 3.0, (B, T))
GAP = RNG.choice([0.0, 3e-3, -0.05, 0.2, -0.4, 0.9, -1.3], (B, T))       # log(old / rollout)
ROLLOUT = OLD - GAP
MASK = (np.arange(T)[None] < np.array([7, 5, 1, 4, 7, 3])[:, None]).astype(np.float64)
LOGP = OLD + RNG.uniform(-0.3, 0.3, (B, T))
REF = LOGP + RNG.normal(0, 0.3, (B, T))
ADV = RNG.standard_normal(B)
EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.2


def np_masked_mean(v, m, axis=None):
    return (v * m).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def np_weights(level, upper, lower):
    """verl: exp of the clamped log-ratio per token / its sum / its mean per answer, times the
    mask; truncated at `upper`, or (a band) zero outside [lower, upper]."""
    lr = (OLD - ROLLOUT) * MASK
    if level == "token":
        unit = lr
    elif level == "sequence":
        unit = lr.sum(-1, keepdims=True)
    else:
        unit = np_masked_mean(lr, MASK, -1)[:, None]
    raw = np.exp(np.clip(unit, -20, 20)) * MASK
    if lower is None:
        return np.minimum(raw, upper), raw
    return raw * ((raw >= lower) & (raw <= upper)), raw


def np_kept(level, stat, upper, lower):
    lr = np.clip((OLD - ROLLOUT) * MASK, -20, 20)
    k = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1 - lr}[stat]
    if level == "token":
        s = k
    elif level == "seq_sum":
        s = (k * MASK).sum(-1, keepdims=True)
    elif level == "seq_mean":
        s = np_masked_mean(k, MASK, -1)[:, None]
    else:
        s = np.where(MASK > 0, k, -np.inf).max(-1, keepdims=True)
    if stat == "k1":
        keep = (s >= np.log(lower or 1 / upper)) & (s <= np.log(upper))
    else:
        keep = s <= upper
    return MASK * np.broadcast_to(keep, MASK.shape), s


def np_dapo(weights, kept, old=OLD, ref=REF):
    """verl's token-mean loss: sum((pg * w + beta * k3(ref, logp)) * kept) / sum(kept)."""
    r = np.exp(LOGP - old)
    a = ADV[:, None]
    pg = -np.minimum(r * a, np.clip(r, 1 - EPS, 1 + EPS_HIGH) * a)
    d = ref - LOGP
    return np.sum((pg * weights + BETA * (np.exp(d) - d - 1)) * kept) / kept.sum()


def loss_of(batch):
    f32 = lambda x: np.asarray(x, np.float32)          # noqa: E731
    """The DAPO loss of a corrected batch, aggregated over its "loss_mask"."""
    return float(grpo_loss(f32(LOGP), f32(batch["old_logprobs"]), f32(ADV),
                           f32(batch.get("loss_mask", batch["action_mask"])), loss_type="dapo",
                           epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA,
                           ref_logprobs=f32(batch["ref_logprobs"]),
                           is_weights=batch.get("is_weights"), kl_weighted=False))


def batch():
    return {"old_logprobs": OLD.astype(np.float32), "ref_logprobs": REF.astype(np.float32),
            "action_mask": MASK.astype(np.float32)}


IS_CASES = [("token", 2.0, None), ("token", 5.0, 0.5), ("sequence", 2.0, None),
            ("sequence", 5.0, 0.5), ("geometric", 1.2, None), ("geometric", 1.3, 0.8)]
RS_CASES = [("token", "k1", 2.0, None), ("token", "k2", 0.05, None), ("token", "k3", 0.4, None),
            ("seq_sum", "k1", 2.5, 0.2), ("seq_sum", "k3", 0.3, None),
            ("seq_mean", "k2", 0.05, None), ("seq_mean", "k1", 1.2, None),
            ("seq_max", "k2", 0.1, None), ("seq_max", "k3", 0.2, None)]


@pytest.mark.parametrize("level,upper,lower", IS_CASES)
def test_importance_weights_and_loss_match_verl(level, upper, lower):
    config = RolloutCorrection(is_level=level, is_threshold=upper, is_threshold_lower=lower)
    want, raw = np_weights(level, upper, lower)
    got, kept, metrics = rollout_correction(config, OLD, ROLLOUT, MASK)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
    assert 0 < np.mean(want[MASK > 0] != raw[MASK > 0]) < 1       # the bound binds, not all
    np.testing.assert_array_equal(np.asarray(kept), MASK)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_mean"],
                               np_masked_mean(raw, MASK), rtol=1e-6)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_max"], raw[MASK > 0].max(),
                               rtol=1e-6)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_clipped_fraction"],
                               np.mean(want[MASK > 0] != raw[MASK > 0]), rtol=1e-6)
    fixed, _ = corrected_batch(config, batch(), ROLLOUT)
    np.testing.assert_allclose(loss_of(fixed), np_dapo(want, MASK), rtol=1e-6, atol=1e-7)
    assert abs(loss_of(corrected_batch(config, batch(), 2 * OLD - ROLLOUT)[0])
               - np_dapo(want, MASK)) > 1e-3             # the IS arguments swapped: caught


@pytest.mark.parametrize("level,stat,upper,lower", RS_CASES)
def test_rejection_mask_and_loss_match_verl(level, stat, upper, lower):
    config = RolloutCorrection(rs=(level, stat), rs_threshold=upper, rs_threshold_lower=lower)
    want, s = np_kept(level, stat, upper, lower)
    assert 0 < want.sum() < MASK.sum()                      # some rejected, some kept
    got_w, got, metrics = rollout_correction(config, OLD, ROLLOUT, MASK)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got_w), MASK)
    name = f"rollout_corr/rollout_rs_{level}_{stat}"
    np.testing.assert_allclose(metrics[name + "_mean"],
                               np_masked_mean(np.broadcast_to(s, MASK.shape), MASK),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_masked_fraction"],
                               1 - want.sum() / MASK.sum(), rtol=1e-6)
    fixed, _ = corrected_batch(config, batch(), ROLLOUT)
    np.testing.assert_allclose(loss_of(fixed), np_dapo(MASK, want), rtol=1e-6, atol=1e-7)


def test_is_and_rs_together_bypass_and_kl_wiring():
    """token IS and token k3 rejection at once (the loss's count is the kept tokens); verl's
    off-policy k1/k3 means; bypass: pi_old is the rollout's, no weight applied; the KL term
    against the rollout's log-probs instead of the reference's is caught."""
    config = RolloutCorrection(is_level="token", is_threshold=2.0, rs=("token", "k3"),
                               rs_threshold=0.1)
    w, _ = np_weights("token", 2.0, None)
    kept, _ = np_kept("token", "k3", 0.1, None)
    fixed, metrics = corrected_batch(config, batch(), ROLLOUT)
    want = np_dapo(w, kept)
    np.testing.assert_allclose(loss_of(fixed), want, rtol=1e-6, atol=1e-7)
    lr = OLD - ROLLOUT
    np.testing.assert_allclose(metrics["rollout_corr/kl"], np_masked_mean(-lr, MASK), rtol=1e-5)
    np.testing.assert_allclose(metrics["rollout_corr/k3_kl"],
                               np_masked_mean(np.exp(lr) - lr - 1, MASK), rtol=1e-5)
    assert abs(np_dapo(w, kept, ref=ROLLOUT) - want) > 1e-4 and abs(
        loss_of({**fixed, "ref_logprobs": ROLLOUT}) - want) > 1e-4    # KL vs rollout: caught
    bypass = RolloutCorrection(is_level="token", rs=("token", "k3"), rs_threshold=0.1,
                               bypass=True)
    fixed, _ = corrected_batch(bypass, batch(), ROLLOUT)
    assert "is_weights" not in fixed
    np.testing.assert_allclose(loss_of(fixed), np_dapo(MASK, kept, old=ROLLOUT), rtol=1e-6,
                               atol=1e-7)


def test_invalid_fields_are_named():
    for kw, field in [({"is_level": "seq"}, "is_level"), ({"is_threshold": 0}, "is_threshold"),
                      ({"is_threshold_lower": 3.0}, "is_threshold_lower"),
                      ({"rs": ("seq_max", "k1"), "rs_threshold": 1.0}, "rs"),
                      ({"rs": ("token", "k3")}, "rs_threshold"),
                      ({"rs": ("token", "k3"), "rs_threshold": 1.0, "rs_threshold_lower": 0.5},
                       "rs_threshold_lower")]:
        with pytest.raises(ValueError, match=f"RolloutCorrection.{field}="):
            RolloutCorrection(**kw)
