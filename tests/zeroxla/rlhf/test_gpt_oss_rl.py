"""GRPO and PPO with a gpt-oss actor (a tiny `GptOss`: two (sliding, full) pairs of MoE layers,
attention sinks, a window of 4 shorter than the rows) trained at expert parallelism 2, routing
replay on: the rollout's record holds every MoE layer ([.., 2L, k], two per pair) at every fed
token, the logged `routing/mismatch` is the numpy count of recorded (token, layer) pairs where
the unsharded starting actor's full forward routes otherwise (`numpy_mismatch`; that forward's
choice is transformers' router's, tests/models/test_gpt_oss.py), 0 in float32 at tp 1 and 2,
and GRPO's training forward gives the rollout's log-probs within float32 round-off."""

import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.rlhf import GRPOConfig, PPOConfig, PPOTrainer
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from job_runs import distinct_chars
from test_grpo_moe import EOS, TOKENIZER
from test_grpo_routing_replay import numpy_mismatch
from test_ppo_routing_replay import prompts


def gpt_oss_actor(aux=True):
    """A tiny gpt-oss actor; `aux`: the auxiliary loss weighed (PPO's loss returns no router
    statistics: off there)."""
    config = models.GptOssConfig(vocab_size=TOKENIZER.vocab_size, max_seq_len=32, d_model=32,
                                 num_heads=4, num_kv_heads=2, explicit_head_dim=8, num_layers=2,
                                 mlp_dim=16, num_experts=8, experts_per_token=2,
                                 expert_mlp_dim=16, expert_tile=4, sliding_window=4,
                                 router_aux_loss_coef=0.01, output_router_logits=aux,
                                 init_std=0.2)
    return models.GptOss(config, rngs=nnx.Rngs(3))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_replays_a_gpt_oss_rollout_with_no_mismatch(tp):
    """One GRPO iteration, `routing_replay="on"`, continuous batching: the record is
    [B, T, 2L, k] and covers the fed tokens; `routing/mismatch` is the numpy count, 0; the
    training forward's log-probs are the rollout's within 1e-5; the loss and the auxiliary
    loss are finite."""
    config = GRPOConfig(num_generations=2, prompts_per_iteration=4, prompt_length=8,
                        max_completion_length=5, learning_rate=1e-2, routing_replay="on")
    run = GRPOTrainer(config, gpt_oss_actor(), mesh=zeroxla.make_mesh(2, 2, expert=2),
                      tokenizer=TOKENIZER, prompts=task.split_problems(16, 0)[0],
                      reward_funcs=[distinct_chars], inference_tp_size=tp, eos_id=EOS, seed=0)
    assert run.engine.batching == "continuous"
    record, rollout = run.iteration(0)
    assert rollout.routing.shape[2:] == (4, 2)
    differ, compared = numpy_mismatch(gpt_oss_actor(), rollout.tokens, rollout.routing,
                                      rollout.answer_starts() + rollout.action_mask.sum(1) - 1)
    assert compared > 0 and record["routing/mismatch"] == differ == 0
    assert record["gap/max"] <= 1e-5, record["gap/max"]
    assert np.isfinite(record["loss"]) and record["router/aux_loss"] > 0


@pytest.mark.slow
def test_ppo_replays_a_gpt_oss_rollout_with_no_mismatch():
    """One PPO iteration, `routing_replay="on"`: the same record and count (0), finite actor
    and critic losses, the actor's batch carrying the record ("replay")."""
    config = PPOConfig(prompts_per_iteration=8, prompt_length=8, answer_length=5, ppo_epochs=1,
                       actor_lr=1e-2, critic_lr=1e-2, routing_replay="on")
    run = PPOTrainer(config, gpt_oss_actor(aux=False), mesh=zeroxla.make_mesh(2, 2, expert=2),
                     tokenizer=TOKENIZER, prompt_tokens=prompts(),
                     reward_fn=lambda text: len(set(text)) / 6, inference_tp_size=1,
                     eos_id=EOS, seed=0)
    record, rollout = run.iteration(0)
    assert rollout.routing.shape[2:] == (4, 2)
    differ, compared = numpy_mismatch(gpt_oss_actor(aux=False), rollout.tokens, rollout.routing,
                                      rollout.prompt_length + rollout.action_mask.sum(1) - 1)
    assert compared > 0 and record["routing/mismatch"] == differ == 0
    assert np.isfinite(record["actor_loss"]) and np.isfinite(record["critic_loss"])
    assert "replay" in run.batches(rollout)[0][0]
