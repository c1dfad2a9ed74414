"""One GRPO update with verl's token IS (`--rollout-is token`) and token k3 rejection
(`--rollout-rs token k3`) on the tiny setup of test_grpo_update_reference.py (gpt-tiny, one
block, 2x4 mesh, injected log-prob gaps): the step's loss against a float64 DAPO loss written
here (weights on the policy term, the KL term unweighted, rejected tokens out of the count),
and the record holds verl's metrics. The KL term against the rollout's log-probs instead of the
reference's, or the IS arguments swapped, moves the loss far past the tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from test_grpo_losses import np_advantages
from test_grpo_update_reference import (CONFIG, LR, PROMPTS, TOKENIZER, answer_logprobs64,
                                        fixed_rollout, no_reward, tiny_actor)
from zeroxla.rlhf.grpo.trainer import GRPOTrainer, iteration_record
from zeroxla.rlhf.rollout_correction import RolloutCorrection

CORR = RolloutCorrection(is_level="token", is_threshold=2.0, rs=("token", "k3"),
                         rs_threshold=0.3)


def verl_loss64(model, rollout, config):
    """float64: token-mean of (pg * w + beta * k3(ref, logp)) over the kept tokens."""
    old = rollout.logprobs.astype(np.float64)
    mask = rollout.action_mask.astype(np.float64)
    lr = (old - rollout.rollout_logprobs) * mask
    w = np.minimum(np.exp(lr), 2.0)
    kept = mask * (np.exp(lr) - 1 - lr <= 0.3)
    adv = np_advantages(rollout.rewards, config.num_generations, config.scale_rewards,
                        config.advantage)
    graphdef, state = nnx.split(model)
    starts = rollout.answer_starts()
    with jax.enable_x64(True):                                    # one program, not op by op
        logp = np.asarray(jax.jit(lambda s, tokens: answer_logprobs64(
            nnx.merge(graphdef, s), tokens, starts, mask.shape[1]))(state, rollout.tokens),
            np.float64)
    r = np.exp(logp - old)
    a = adv[:, None]
    pg = -np.minimum(r * a, np.clip(r, 1 - config.epsilon, 1 + config.clip_high) * a)
    d = rollout.ref_logprobs - logp
    return np.sum((pg * w + config.beta * (np.exp(d) - d - 1)) * kept) / kept.sum(), kept


@pytest.mark.slow   # daily: test_rollout_corr_modes.py's weights and loss against verl's
def test_grpo_update_with_token_is_and_k3_rejection():
    config = CONFIG.replace(rollout_correction=None, rollout_corr=CORR)
    trainer = GRPOTrainer(config, tiny_actor(), mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                          prompts=PROMPTS, reward_funcs=[no_reward], inference_tp_size=1,
                          optimizer=optax.sgd(LR))
    rollout = fixed_rollout(trainer, np.random.default_rng(0))
    want, kept = verl_loss64(zeroxla.gathered_model(trainer.actor_state), rollout, config)
    assert 0 < kept.sum() < rollout.action_mask.sum()           # some tokens rejected
    record = iteration_record(0, rollout, trainer.train_grpo(rollout), {})
    assert record["loss"] == pytest.approx(want, rel=1e-5)
    real = rollout.action_mask > 0
    assert record["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        1 - kept.sum() / real.sum(), rel=1e-6)
    ratio = np.exp(rollout.logprobs.astype(np.float64) - rollout.rollout_logprobs)[real]
    assert record["rollout_corr/rollout_is_max"] == pytest.approx(ratio.max(), rel=1e-5)
    assert record["rollout_corr/rollout_is_clipped_fraction"] == pytest.approx(
        np.mean(ratio > 2.0), rel=1e-6)
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean",
                "rollout_corr/rollout_rs_token_k3_mean", "gap/max"):
        assert np.isfinite(record[key])
