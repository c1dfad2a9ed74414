"""GRPO on a tiny MoE actor (Qwen3-MoE's family, 8 experts, top-2, the auxiliary loss weighed)
on the bundled arithmetic task: the iteration completes, its record holds the train/rollout
log-prob gap and the per-expert load (each expert's share of the assignments, summing to 1),
padded and packed rollouts alike. (That a loss_fn returning router statistics trains as one
device does: tests/zeroxla/engine/test_moe_training.py.)"""

import numpy as np
import pytest

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import GRPOConfig, arithmetic_task as task
from zeroxla.rlhf.grpo import GRPOTrainer

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
EOS = int(TOKENIZER.encode(task.END)[0])


def distinct_chars(prompts, completions, **_):
    return [len(set(c)) / 6 for c in completions]


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
    (True, "dp"), pytest.param(False, "dp", marks=pytest.mark.slow), (True, "ep2")])
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
