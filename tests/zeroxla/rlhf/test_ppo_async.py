"""Asynchronous PPO (zeroxla/rlhf/async_rollouts.py, shared with GRPO; PPOTrainer's rollout
side) on the 2 x 4 mesh split 4 + 4: actor and critic train on devices 0-3, the rollout group
generates on 4-7.

- max_staleness=0 reproduces the colocated synchronous run on devices 0-3 with the same seed,
  record for record, exactly (every key but the timings), and every sync moves one copy of the
  actor's float32 trainable weights (gpt-tiny's leaves each have a dim 4 divides), the floor;
  a lag without a rollout group and a group of other than half the devices are refused by name;
- k = 1: every rollout's version is max(0, i - 1), within 1 of the update it feeds; the engine's
  log-probs of a stale rollout are the float64 log-probs of the plain actor at the version
  recorded and its "old" log-probs those of the actor at the update (pi_prox); the update (one
  SGD step) equals a float64 reference of DeepSpeed-Chat's clipped actor loss with AReaL's
  decoupled weights pi_prox / pi_behav (0 above the cap), written here; rollout i + 1 is
  dispatched before update i is read."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import PPOConfig, PPOTrainer
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.rollout_correction import RolloutCorrection
from test_grpo_async import nnx_float64
from test_grpo_update_reference import answer_logprobs64, assert_update, update_error

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
STREAM = np.asarray(TOKENIZER.encode(" ".join(
    row["prompt"] for row in task.split_problems(16, 0)[0])), np.int32)
CONFIG = PPOConfig(prompts_per_iteration=4, prompt_length=6, answer_length=4, ppo_epochs=1,
                   kl_ctl=0.05)
TIMES = ("generation_s", "experience_s", "training_s", "generation/tokens_per_s")


def spread(text):
    """A score that tells answers apart (advantages far from 0): character codes mod 7."""
    return float(sum(map(ord, text)) % 7) / 7


def trainer(config, mesh, **kw):
    actor = models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=16,
                         num_layers=1, seed=3)
    return PPOTrainer(config, actor, mesh=mesh, tokenizer=TOKENIZER, prompt_tokens=STREAM,
                      reward_fn=spread, seed=0, **kw)


def floor_bytes(state):
    """One copy of the actor's float32 weights, counted from the gathered model alone."""
    return sum(math.prod(np.shape(x)) * 4
               for x in jax.tree.leaves(zeroxla.gathered_model(state)))


def run(ppo, iterations):
    """(records, rollouts) of `iterations` iterations of the trainer `ppo`."""
    return tuple(zip(*(ppo.iteration(i) for i in range(iterations))))


@pytest.mark.slow   # daily: test_grpo_async.py's k = 0 run of the shared async_rollouts
def test_staleness_zero_reproduces_the_colocated_run_and_syncs_at_the_floor():
    iterations = 2
    colocated = run(trainer(CONFIG, zeroxla.make_mesh(1, 4, devices=jax.devices()[:4])),
                    iterations)
    split = trainer(CONFIG.replace(rollout_devices=4), zeroxla.make_mesh(2, 4))
    records, rollouts = run(split, iterations)
    assert {d.id for d in split.engine.mesh.devices.flat} == {4, 5, 6, 7}
    for step in (split.actor_step, split.critic_step):
        assert {d.id for d in step.layout.mesh.devices.flat} == {0, 1, 2, 3}
    for want, rollout, got, again in zip(*colocated, records, rollouts):
        for key in set(want) - set(TIMES):
            assert got[key] == want[key], key
        for name in ("tokens", "logprobs", "values", "advantages", "rollout_logprobs"):
            np.testing.assert_array_equal(getattr(again, name), getattr(rollout, name))
        assert (got["policy_version"], got["staleness"]) == (got["iteration"], 0)
    floor = floor_bytes(split.actor_state)
    assert [r["sync/bytes"] for r in records] == [floor] * iterations
    assert records[0]["sync/floor_bytes"] == floor
    assert split.rollouts.group.syncs == iterations
    assert split.rollouts.events == [(e, kind, i) for i in range(iterations) for kind, e in (
        ("rollout", "dispatch"), ("rollout", "read"), ("update", "dispatch"),
        ("update", "read"))]
    # refused by name
    with pytest.raises(ValueError, match=r"PPOConfig\.max_staleness=1 is invalid.*"
                                         r"rollout_devices > 0"):
        CONFIG.replace(max_staleness=1)
    with pytest.raises(ValueError, match=r"PPOConfig\.rollout_devices=-1 is invalid"):
        CONFIG.replace(rollout_devices=-1)
    with pytest.raises(ValueError, match=r"PPOConfig\.rollout_devices=2 on 8 devices; "
                                         r"accepted: 0 .*or 4"):
        trainer(CONFIG.replace(rollout_devices=2), zeroxla.make_mesh(2, 4))


def decoupled_reference(model, rollout, cliprange, cap, lr):
    """(float64 loss, float64 parameters after one SGD step) from the plain `model` on
    `rollout`: DeepSpeed-Chat's clipped policy term max(-A r, -A clip(r, 1 - c, 1 + c)),
    r = exp(logp - old), each token's term times AReaL's w = exp(old - behav) (0 above `cap`,
    the token still counted), the mean over real tokens; old: the rollout's "old" log-probs
    (pi_prox), behav: the engine's (pi_behav)."""
    graphdef, params = nnx.split(model)
    mask = rollout.action_mask.astype(np.float64)
    old = rollout.logprobs.astype(np.float64)
    behaviour = np.exp(old - rollout.rollout_logprobs.astype(np.float64))
    weights = np.where(behaviour <= cap, behaviour, 0.0) * mask
    starts = np.full(len(mask), rollout.prompt_length)
    with jax.enable_x64(True):
        state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), params)
        adv = jnp.asarray(rollout.advantages, jnp.float64)

        @jax.jit
        def step(s):
            def loss(s):
                logp = answer_logprobs64(nnx.merge(graphdef, s), rollout.tokens, starts,
                                         mask.shape[1])
                r = jnp.exp((logp - old) * mask)
                pg = jnp.maximum(-adv * r, -adv * jnp.clip(r, 1 - cliprange, 1 + cliprange))
                return jnp.sum(pg * weights * mask) / jnp.sum(mask)
            value, grad = jax.value_and_grad(loss)(s)
            return value, jax.tree.map(lambda p, g: p - lr * g, s, grad)

        value, state = step(state)
        return float(value), jax.tree.map(np.asarray, state), weights


def logprobs64(model, rollout):
    with jax.enable_x64(True):
        return np.asarray(answer_logprobs64(
            nnx_float64(model), rollout.tokens, np.full(len(rollout.tokens),
                                                        rollout.prompt_length),
            rollout.answer_length))


@pytest.mark.slow
def test_one_step_off_policy_versions_and_the_decoupled_update():
    lr, cap, iterations = 0.5, 2.0, 3
    config = CONFIG.replace(rollout_devices=4, max_staleness=1, prompts_per_iteration=8,
                            answer_length=6, rollout_corr=RolloutCorrection.decoupled(cap))
    split = trainer(config, zeroxla.make_mesh(2, 4), actor_optimizer=optax.sgd(lr))
    records, models_at = [], []                     # the plain actor at version v
    for i in range(iterations):
        models_at.append(zeroxla.gathered_model(split.actor_state))
        record, rollout = split.iteration(i)
        records.append(record)
        assert record["policy_version"] == max(0, i - 1)
        assert record["staleness"] == i - record["policy_version"] <= 1
        assert record["sync/bytes"] == record["sync/floor_bytes"] == floor_bytes(
            split.actor_state)
        real = rollout.action_mask > 0
        behav = logprobs64(models_at[record["policy_version"]], rollout)
        np.testing.assert_allclose(rollout.rollout_logprobs[real], behav[real], atol=5e-6)
        np.testing.assert_allclose(rollout.logprobs[real], logprobs64(models_at[i],
                                                                     rollout)[real], atol=5e-6)
        if i == 1:                     # the first update from a rollout one version old
            loss, expected, weights = decoupled_reference(models_at[i], rollout,
                                                          config.cliprange, cap, lr)
            assert np.ptp(weights[real]) > 0.5         # pi_prox and pi_behav differ
            assert 0 < np.sum(weights[real] == 0) < real.sum()      # the cap filters some
            assert record["actor_loss"] == pytest.approx(loss, rel=1e-5)
            after = zeroxla.gathered_model(split.actor_state)
            assert_update(models_at[i], after, expected)
            assert update_error(models_at[i], after, expected) <= 2e-6
    events = split.rollouts.events
    for i in range(iterations):
        read = events.index(("read", "update", i))
        assert events.index(("dispatch", "update", i)) < read
        assert events.index(("dispatch", "rollout", i + 1)) < read
