"""GRPO with sequence parallelism: the actor trains on packed rollouts whose rows are split over
2 sequence devices (DeepSpeed-Ulysses), generation runs on the Hybrid Engine switched from that
sequence-parallel training mesh, and every metric of two iterations equals the same run without
sequence parallelism (same 4 data replicas, same seed) within float32 noise. A padded rollout
under sequence parallelism is refused by name."""

import jax
import numpy as np
import optax
import pytest

import zeroxla
from test_grpo import CONFIG, EOS, TOKENIZER, distinct_chars, tiny_actor
from zeroxla.models.sequence_parallel import SequenceParallel
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from zeroxla.rlhf.grpo.losses import make_grpo_loss

# Differ by construction: the packed rows are rounded up to a multiple of the 2 sequence devices;
# the rollout engine's steps and KV pages per data group (the 8-device mesh serves rollouts with
# twice the groups); wall-clock timings.
LAYOUT_KEYS = ("packing/fill", "generation/steps", "generation/kv_pages_mean",
               "generation/kv_pages_peak", "generation/tokens_per_s")


def _compared(key):
    return key not in LAYOUT_KEYS and not key.endswith("_s")


def _records(mesh):
    trainer = GRPOTrainer(CONFIG, tiny_actor(), mesh=mesh, tokenizer=TOKENIZER,
                          prompts=task.split_problems(32, 0)[0], reward_funcs=[distinct_chars],
                          eos_id=EOS, seed=0, optimizer=optax.sgd(0.2))
    return [trainer.iteration(it)[0] for it in range(2)]


# Daily, the pieces under it: packed GRPO losses and the (PPO) losses under sequence parallelism
# in test_packed_rollout.py, the engine on a sequence-parallel state in
# test_sequence_parallel_generation.py.
@pytest.mark.slow
def test_grpo_with_sequence_parallel_two_matches_the_run_without():
    without = _records(zeroxla.make_mesh(1, 4, devices=jax.devices()[:4]))
    with_sp = _records(zeroxla.make_mesh(1, 4, sequence=2))
    for want, got in zip(without, with_sp):
        numbers = [k for k, v in want.items() if isinstance(v, float) and _compared(k)]
        assert {"loss", "kl", "reward", "clip_fraction"} <= set(numbers)
        for key in numbers:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    # The second iteration's rollout came from the updated actor: the update reached it.
    assert with_sp[1]["kl"] != with_sp[0]["kl"]


def test_a_padded_rollout_under_sequence_parallelism_is_refused():
    loss = make_grpo_loss(loss_type="grpo", epsilon=0.2, epsilon_high=0.2)
    batch = {"tokens": np.zeros((2, 8), np.int32), "action_mask": np.ones((2, 4), np.float32),
             "old_logprobs": np.zeros((2, 4), np.float32), "advantages": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match="GRPOConfig.packing=True"):
        loss(tiny_actor(), batch, sequence=SequenceParallel("sequence", 2))
