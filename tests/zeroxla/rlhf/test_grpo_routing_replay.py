"""GRPO with routing replay (`GRPOConfig.routing_replay`) on a tiny Qwen3-MoE actor trained at
expert parallelism 2, its rollout under continuous batching: the rollout's record covers every
token the answers' log-probs read, and the logged `routing/mismatch` is the numpy count of
recorded (token, layer) pairs where the unsharded starting actor's full forward routes
otherwise (0 at tp 2); a dense actor and an unpacked rollout are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeroxla
from zeroxla import models
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from job_runs import distinct_chars
from test_grpo_moe import EOS, TOKENIZER, actor

CONFIG = GRPOConfig(num_generations=2, prompts_per_iteration=4, prompt_length=8,
                    max_completion_length=5, learning_rate=1e-2)


def trainer(config, policy=None, tp=1):
    return GRPOTrainer(config, actor() if policy is None else policy,
                       mesh=zeroxla.make_mesh(2, 2, expert=2), tokenizer=TOKENIZER,
                       prompts=task.split_problems(16, 0)[0], reward_funcs=[distinct_chars],
                       inference_tp_size=tp, eos_id=EOS, seed=0)


def numpy_mismatch(model, tokens, record, fed_ends):
    """(pairs differing, pairs compared): a rollout's routing `record` [B, T, L, k] against
    `model`'s own full forward over each row of `tokens` [B, T], on the tokens fed (those before
    `fed_ends` [B]: the prompt and the answer but its last); -1 exactly off them."""
    experts, _ = jax.jit(model.router_choices)(jnp.asarray(tokens))            # [L, B, T, k]
    live = np.moveaxis(np.asarray(experts), 0, 2)                              # [B, T, L, k]
    fed = np.arange(record.shape[1])[None, :] < np.asarray(fed_ends)[:, None]  # [B, T]
    assert np.all(record[fed] >= 0) and np.all(record[~fed] == -1)
    differ = np.any(np.sort(record, -1) != np.sort(live, -1), -1) & fed[..., None]
    return int(differ.sum()), int(fed.sum()) * record.shape[2]


@pytest.mark.parametrize("mode", ["on", pytest.param("measure", marks=pytest.mark.slow)])
def test_grpo_logs_the_routing_mismatch_of_its_rollout(mode):
    """One iteration: the engine records the routing under the job's continuous batching, the
    record covers every fed token of every row (so under "on" each of them trains on its
    rollout's experts), and `routing/mismatch` (with its fraction) is the numpy count against
    the starting actor (float32, tp 1: 0 measured)."""
    run = trainer(CONFIG.replace(routing_replay=mode))
    assert run.engine.batching == "continuous"
    record, rollout = run.iteration(0)
    differ, compared = numpy_mismatch(actor(), rollout.tokens, rollout.routing,
                                      rollout.answer_starts() + rollout.action_mask.sum(1) - 1)
    assert record["routing/mismatch"] == differ
    assert record["routing/mismatch_fraction"] == pytest.approx(differ / compared)
    assert np.isfinite(record["loss"]) and record["router/aux_loss"] > 0


@pytest.mark.slow
def test_grpo_replays_a_continuous_rollout_at_tp_2_with_no_mismatch():
    """`--routing-replay on` at inference tp 2 under continuous batching: the logged
    `routing/mismatch` is the numpy count against the starting actor, and it is 0 (the float32
    rollout routes every fed token as the training forward does)."""
    run = trainer(CONFIG.replace(routing_replay="on"), tp=2)
    assert run.engine.batching == "continuous"
    record, rollout = run.iteration(0)
    differ, compared = numpy_mismatch(actor(), rollout.tokens, rollout.routing,
                                      rollout.answer_starts() + rollout.action_mask.sum(1) - 1)
    assert compared > 0 and record["routing/mismatch"] == differ == 0
    assert np.isfinite(record["loss"])


def test_routing_replay_is_refused_by_name():
    """Without packing (the replayed forward is the packed one), and for a dense actor."""
    with pytest.raises(ValueError, match="GRPOConfig.routing_replay='on'"):
        CONFIG.replace(routing_replay="on", packing=False)
    with pytest.raises(ValueError, match="GRPOConfig.routing_replay='sometimes'"):
        CONFIG.replace(routing_replay="sometimes")
    dense = models.build("gpt-tiny", seed=0)
    with pytest.raises(ValueError, match="return_routing=True with a GPT"):
        trainer(CONFIG.replace(routing_replay="measure"), dense)
