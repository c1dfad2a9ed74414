"""PPO with verl's rollout correction on the tiny setup of test_ppo.py (gpt-tiny, 2x4 mesh, a
random reward model): one actor update with token IS (`--rollout-is token`) and token k3
rejection (`--rollout-rs token k3`) on injected train/rollout gaps, its loss against a float64
numpy loss written here from verl's definition (the clipped policy term times the weight, the
token mean over the kept tokens); the padded loss_fn the same way; and the default settings
give the uncorrected record: DeepSpeed-Chat's loss, no `rollout_corr/*` key (the train/rollout
gap, `gap/*`, is logged whatever the correction)."""

import dataclasses

import jax
import numpy as np
import pytest

import zeroxla
from test_ppo import CONFIG, np_log_softmax, reward_model
from zeroxla import models, rlhf
from zeroxla.app import data
from zeroxla.rlhf.rollout_correction import RolloutCorrection

SMALL = CONFIG.replace(ppo_epochs=1, prompts_per_iteration=8)
CORR = RolloutCorrection(is_level="token", is_threshold=1.2, rs=("token", "k3"),
                         rs_threshold=0.05)
UNCORRECTED_KEYS = {"iteration", "reward", "kl", "actor_loss", "critic_loss", "generation_s",
                    "experience_s", "training_s", "gap/max", "gap/mean_abs", "gap/frac_over_1e-3"}


def trainer(config):
    corpus = data.load_corpus()
    return rlhf.PPOTrainer(config, models.build("gpt-tiny", seed=0),
                           mesh=zeroxla.make_mesh(nodes=2, local=4), tokenizer=corpus.tokenizer,
                           prompt_tokens=corpus.val, reward_model=reward_model(), seed=0)


def current_logprobs64(state, rollout):
    """float64 log-probs [B, G] of the answers under the gathered actor (one device)."""
    p = rollout.prompt_length
    logits = np.asarray(zeroxla.gathered_model(state)(jax.numpy.asarray(rollout.tokens[:, :-1])))
    return np.take_along_axis(np_log_softmax(logits[:, p - 1:]), rollout.tokens[:, p:, None],
                              -1)[..., 0]


def verl_loss64(logp, rollout, cliprange):
    """verl: w = min(exp(old - rollout), 1.2), kept = k3 <= 0.05 on real tokens, loss =
    sum(max(-A r, -A clip(r)) * w * kept) / sum(kept) with r = exp(logp - old); float64."""
    mask = rollout.action_mask.astype(np.float64)
    old = rollout.logprobs.astype(np.float64)
    log_ratio = (old - rollout.rollout_logprobs.astype(np.float64)) * mask
    w = np.minimum(np.exp(log_ratio), 1.2)
    kept = mask * (np.exp(log_ratio) - 1 - log_ratio <= 0.05)
    r = np.exp((logp - old) * mask)
    adv = rollout.advantages.astype(np.float64)
    pg = np.maximum(-adv * r, -adv * np.clip(r, 1 - cliprange, 1 + cliprange))
    return np.sum(pg * w * kept) / kept.sum(), kept, w, r


def injected(rollout, rng):
    """`rollout` with gaps: the old log-probs moved by up to +-0.3 (the clip acts) and the
    engine's by N(0, 0.3) (weights truncated, tokens rejected), on the real tokens only."""
    mask = rollout.action_mask
    old = rollout.logprobs + rng.uniform(-0.3, 0.3, mask.shape).astype(np.float32) * mask
    drawn = rollout.rollout_logprobs + rng.normal(0, 0.3, mask.shape).astype(np.float32) * mask
    return dataclasses.replace(rollout, logprobs=old, rollout_logprobs=drawn)


@pytest.mark.slow
def test_ppo_update_with_token_is_and_k3_rejection():
    ppo = trainer(SMALL.replace(rollout_corr=CORR))
    rollout, _, _ = ppo.generate_experience(0)
    real = rollout.action_mask > 0
    # the engine's drawn log-probs are the actor's at rollout time, up to rounding
    np.testing.assert_allclose(rollout.rollout_logprobs[real], rollout.logprobs[real], atol=1e-4)
    assert np.all(rollout.rollout_logprobs[~real] == 0)
    rollout = injected(rollout, np.random.default_rng(0))
    want, kept, w, r = verl_loss64(current_logprobs64(ppo.actor_state, rollout), rollout,
                                   SMALL.cliprange)
    assert 0 < kept.sum() < real.sum()                               # some tokens rejected
    assert np.any(w[real] == 1.2) and np.any(np.abs(r[real] - 1) > SMALL.cliprange)
    _, metrics = ppo.actor_batch(rollout)
    actor_loss, _ = ppo.train_rlhf(rollout)
    assert actor_loss == pytest.approx(want, rel=1e-5)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        1 - kept.sum() / real.sum(), rel=1e-6)
    ratio = np.exp(rollout.logprobs.astype(np.float64) - rollout.rollout_logprobs)[real]
    assert metrics["rollout_corr/rollout_is_clipped_fraction"] == pytest.approx(
        np.mean(ratio > 1.2), rel=1e-6)

    # the padded loss_fn: the same terms, summed and counted over the kept tokens
    batch, _ = ppo.actor_batch(rollout)
    total, count = rlhf.make_actor_loss(SMALL.cliprange, ppo.vocab_limit)(
        zeroxla.gathered_model(ppo.actor_state), batch)
    logp = current_logprobs64(ppo.actor_state, rollout)
    want, kept, _, _ = verl_loss64(logp, rollout, SMALL.cliprange)
    assert float(count) == kept.sum()
    assert float(total) / float(count) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_default_settings_keep_the_uncorrected_record():
    ppo = trainer(SMALL)
    assert not ppo.config.rollout_corr.active
    record, rollout = ppo.iteration(0)
    assert set(record) - {k for k in record if k.startswith("generation/")} == UNCORRECTED_KEYS
    # DeepSpeed-Chat's loss at the rollout's weights (ratio 1): -mean(A) over real tokens
    mask = rollout.action_mask.astype(np.float64)
    want = -np.sum(rollout.advantages.astype(np.float64) * mask) / mask.sum()
    assert record["actor_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("corr", [RolloutCorrection.tis(2.0), "token"])
def test_ppo_config_refuses_a_weighted_kl_or_no_correction(corr):
    with pytest.raises(ValueError, match=r"PPOConfig\.rollout_corr=.*accepted: a "
                                         r"RolloutCorrection with kl_weighted=False"):
        rlhf.PPOConfig(rollout_corr=corr)
