"""GRPO on a tiny MoE actor (Qwen3-MoE's family, 8 experts, top-2, the auxiliary loss weighed)
on the bundled arithmetic task: the iteration completes, its record holds the train/rollout
log-prob gap and the per-expert load (each expert's share of the assignments, summing to 1),
padded and packed rollouts alike. (That a loss_fn returning router statistics trains as one
device does: tests/zeroxla/engine/test_moe_training.py.)"""

import jax
import numpy as np
import pytest

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from job_runs import distinct_chars

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
EOS = int(TOKENIZER.encode(task.END)[0])


def actor():
    config = models.Qwen3MoeConfig(vocab_size=TOKENIZER.vocab_size, max_seq_len=32, d_model=32,
                                   num_heads=4, num_kv_heads=2, explicit_head_dim=8,
                                   num_layers=2, mlp_dim=16, num_experts=8,
                                   experts_per_token=2, expert_mlp_dim=16, expert_tile=4,
                                   router_aux_loss_coef=0.01, output_router_logits=True,
                                   init_std=0.2)
    from flax import nnx
    return models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(3))


MESHES = {"dp": dict(nodes=2, local=4), "ep2": dict(nodes=2, local=2, expert=2)}


@pytest.mark.parametrize("packing,mesh", [
    pytest.param(True, "dp", marks=pytest.mark.slow),
    pytest.param(False, "dp", marks=pytest.mark.slow),
    # daily, GRPO on an MoE actor at EP 2 runs in test_grpo_routing_replay.py
    pytest.param(True, "ep2", marks=pytest.mark.slow)])
def test_grpo_on_an_moe_actor_logs_the_gap_and_the_expert_load(packing, mesh):
    """ep2: the actor trained with its experts split over an expert axis of 2 (the rollout's
    engine resharding through the logical values): the gap between the training forward's
    log-probs and the rollout's stays at float32 round-off."""
    config = GRPOConfig(num_generations=4, prompts_per_iteration=4, prompt_length=8,
                        max_completion_length=6, learning_rate=1e-2, packing=packing)
    trainer = GRPOTrainer(config, actor(), mesh=zeroxla.make_mesh(**MESHES[mesh]),
                          tokenizer=TOKENIZER,
                          prompts=task.split_problems(32, 0)[0], reward_funcs=[distinct_chars],
                          inference_tp_size=1, eos_id=EOS, seed=0)
    assert trainer.engine.batching == "continuous"
    record, _ = trainer.iteration(0)
    assert np.isfinite(record["loss"])
    assert record["gap/max"] <= 1e-5, record["gap/max"]
    load = np.asarray(record["router/load"])
    assert load.shape == (8,) and abs(load.sum() - 1) < 1e-5
    assert np.isfinite(record["router/aux_loss"]) and record["router/aux_loss"] > 0


@pytest.mark.slow
def test_ppo_on_an_moe_actor_under_expert_parallelism():
    """PPO's actor an MoE model with its experts split over an expert axis of 2 (the critic
    starts from the dense reward model, as DeepSpeed-Chat's does: the expert axis is a data
    axis to it), auxiliary loss off (PPO's loss returns no router statistics: with it weighed,
    the trainer is refused by name): one iteration's rollout and update complete with finite
    losses."""
    from zeroxla import rlhf
    from zeroxla.app import data

    corpus = data.load_corpus()
    config = actor().config.replace(vocab_size=corpus.tokenizer.vocab_size,
                                    output_router_logits=False)
    from flax import nnx
    policy = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(3))
    ppo = rlhf.PPOConfig(prompts_per_iteration=8, prompt_length=8, answer_length=6,
                         ppo_epochs=1)
    trainer = rlhf.PPOTrainer(ppo, policy, mesh=zeroxla.make_mesh(2, 2, expert=2),
                              tokenizer=corpus.tokenizer, prompt_tokens=corpus.val,
                              reward_model=rlhf.RewardModel(models.build("gpt-tiny", seed=7)),
                              seed=0)
    assert trainer.actor_step.layout.plan["blocks/layers/moe/w_up"].expert_split
    rollout, _, _ = trainer.generate_experience(0)
    record = trainer.train_rlhf(rollout)
    assert all(np.isfinite(v) for v in jax.tree.leaves(record) if np.ndim(v) == 0)


def test_a_token_budget_on_an_actor_that_weighs_its_aux_loss_is_refused_before_any_rollout():
    """`ppo_max_token_len_per_gpu` makes each replica's packed rows micro-batches of gradient
    accumulation, where the GRPO loss's share of the auxiliary loss is not defined
    (`engine.router_aux.check_accumulation`): refused by name when the trainer is built, not
    after the first rollout under the step's own words (gradient_accumulation_steps)."""
    config = GRPOConfig(num_generations=4, prompts_per_iteration=4, prompt_length=8,
                        max_completion_length=6, ppo_max_token_len_per_gpu=32)
    with pytest.raises(ValueError, match=r"GRPOConfig.ppo_max_token_len_per_gpu=32 .*"
                                         r"router_aux_loss_coef=0.01.*accepted: .*"
                                         r"ppo_max_token_len_per_gpu=None.*"
                                         r"output_router_logits=False") as refused:
        GRPOTrainer(config, actor(), mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                    prompts=task.split_problems(32, 0)[0], reward_funcs=[distinct_chars],
                    inference_tp_size=1, eos_id=EOS, seed=0)
    assert "gradient_accumulation_steps" not in str(refused.value)
