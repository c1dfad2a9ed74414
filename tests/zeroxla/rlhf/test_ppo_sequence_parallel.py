"""PPO with sequence parallelism: actor and critic train on packed rollouts whose rows are split
over 2 sequence devices, generation runs on the Hybrid Engine switched from that mesh, and the
first iteration's record (the rollout's reward and KL, both models' losses) equals the same run
without sequence parallelism (the same 4 data replicas, the same seed) within float32 noise.
Both runs start from the same weights and draw the same rollout; their losses are the
sequence-parallel step's against the plain step's, on the same rollout."""

import jax
import numpy as np
import pytest

import zeroxla
from zeroxla import models, rlhf
from zeroxla.app import data

CONFIG = rlhf.PPOConfig(ppo_epochs=1, prompts_per_iteration=8, prompt_length=8, answer_length=8)


def _record(mesh):
    corpus = data.load_corpus()
    reward = rlhf.RewardModel(models.build("gpt-tiny", seed=7))
    reward.v_head[...] = jax.numpy.asarray(
        np.random.default_rng(7).standard_normal(reward.v_head[...].shape), jax.numpy.float32)
    run = rlhf.run_ppo(CONFIG, 1, models.build("llama-tiny", seed=0), mesh=mesh,
                       tokenizer=corpus.tokenizer, prompt_tokens=corpus.val,
                       reward_model=reward, seed=0)
    return run.records[0]


@pytest.mark.slow      # the losses under it: test_packed_rollout.py / test_packed_pairs.py
def test_ppo_with_sequence_parallel_two_matches_the_run_without():
    without = _record(zeroxla.make_mesh(1, 4, devices=jax.devices()[:4]))
    with_sp = _record(zeroxla.make_mesh(1, 4, sequence=2))
    for key in ("reward", "kl", "actor_loss", "critic_loss"):
        assert with_sp[key] == pytest.approx(without[key], rel=1e-5, abs=1e-6), key
    assert without["actor_loss"] != 0 and without["critic_loss"] > 0
