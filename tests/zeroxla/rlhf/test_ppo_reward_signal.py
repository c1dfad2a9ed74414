"""The reward model's scores reach PPO's update: the same rollout (same prompts, same answers)
scored with the reward model's scores permuted across its samples must train the actor and the
critic to different weights, while scoring it again as it was reproduces the update bit for bit.
A trainer that dropped or averaged away its scores (a constant, the batch mean, the KL penalty
alone) would pass every other PPO test; it fails this one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models, rlhf
from zeroxla.app import data

pytestmark = pytest.mark.slow
# Clip wide enough that no score is clipped: clipped scores could all be equal.
CONFIG = rlhf.PPOConfig(kl_ctl=0.1, clip_reward_value=50.0, ppo_epochs=1, actor_lr=3e-3,
                        critic_lr=3e-3, prompts_per_iteration=16, prompt_length=8,
                        answer_length=8)


def reward_model():
    model = rlhf.RewardModel(models.build("gpt-tiny", seed=7))
    head = np.random.default_rng(7).standard_normal(model.v_head[...].shape)
    model.v_head[...] = jnp.asarray(head, jnp.float32)
    return model


def params(state):
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in
            nnx.to_flat_state(nnx.state(zeroxla.gathered_model(state), nnx.Param))}


def test_permuted_reward_model_scores_change_the_update():
    corpus = data.load_corpus()
    trainer = rlhf.PPOTrainer(CONFIG, models.build("gpt-tiny", seed=0),
                              mesh=zeroxla.make_mesh(nodes=2, local=4),
                              tokenizer=corpus.tokenizer, prompt_tokens=corpus.val,
                              reward_model=reward_model(), seed=0)
    start = (jax.tree.map(jnp.copy, trainer.actor_state),
             jax.tree.map(jnp.copy, trainer.critic_state))
    initial, critic_initial = params(start[0]), params(start[1])
    score = trainer.score
    perm = np.roll(np.arange(CONFIG.prompts_per_iteration), 1)

    def update(scorer):
        """One iteration from the starting weights with `scorer`: (rollout, actor, critic)."""
        trainer.actor_state, trainer.critic_state = jax.tree.map(jnp.copy, start)
        trainer.score = scorer
        rollout, _, _ = trainer.generate_experience(0)
        trainer.train_rlhf(rollout)
        return rollout, params(trainer.actor_state), params(trainer.critic_state)

    plain, actor, critic = update(score)
    again, actor_again, critic_again = update(score)
    permuted, actor_permuted, critic_permuted = update(
        lambda tokens, mask, texts: np.asarray(score(tokens, mask, texts))[perm])

    np.testing.assert_array_equal(permuted.tokens, plain.tokens)     # the same answers
    np.testing.assert_array_equal(permuted.scores, np.asarray(plain.scores)[perm])
    assert np.ptp(plain.scores) > 0.1                                 # scores that differ
    for path in actor:
        np.testing.assert_array_equal(actor_again[path], actor[path], err_msg=path)
    for path in critic:
        np.testing.assert_array_equal(critic_again[path], critic[path], err_msg=path)

    def moved(a, b):
        return np.sqrt(sum(np.sum((a[p].astype(np.float64) - b[p]) ** 2) for p in a))

    # The permuted scores move actor and critic elsewhere: by more than a tenth of their step.
    # (With every score replaced by the batch mean, the actor lands 2e-5 of its step away.)
    for name, after, after_permuted, before in (("actor", actor, actor_permuted, initial),
                                                ("critic", critic, critic_permuted,
                                                 critic_initial)):
        step = moved(after, before)
        print(f"{name}: step {step:.4g}, permuted scores land {moved(after_permuted, after):.4g} "
              "away")
        assert step > 0 and moved(after_permuted, after) > 0.1 * step, name
