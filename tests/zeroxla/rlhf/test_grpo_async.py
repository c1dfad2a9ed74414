"""Asynchronous GRPO (zeroxla/rlhf/async_rollouts.py, zeroxla/inference/rollout_group.py) on the
2 x 4 mesh split 4 + 4: the training group on devices 0-3, the rollout group on 4-7.

- max_staleness=0 reproduces the colocated synchronous run on devices 0-3 with the same seed,
  record for record, exactly: the same programs on equal devices (the actor step on the same
  four; the engine on four others in the same tensor-parallel shape), fed the same weights;
- every sync moves one copy of the trainable weights across, its bytes the float32 leaves'
  sum exactly (gpt-tiny's leaves each have a dim 4 divides);
- k = 1 and 2: every rollout's version is max(0, i - k), within k of the update it feeds; a
  stale rollout's update equals the float64 reference of test_grpo_update_reference.py
  computed from that rollout's recorded log-probs; rollout i + 1 (up to i + k) is dispatched
  before update i's result is read;
- partial rollouts (k = 1, at most 2 tokens a pass): a rollout drawn ahead is cut at 2 tokens
  per answer, its unfinished answers continued after the sync, so a carried answer's tokens
  are tagged with two versions, each token's engine log-prob is the float64 log-prob of the
  plain model at the version tagged, its text is the two parts' concatenation, and the
  decoupled update (AReaL's objective) equals the float64 reference."""

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
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.run import run_grpo
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from test_grpo_update_reference import (answer_logprobs64, assert_update, reference_update,
                                        update_error)
from job_runs import distinct_chars

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
EOS = int(TOKENIZER.encode(task.END)[0])
CONFIG = GRPOConfig(num_generations=2, prompts_per_iteration=4, prompt_length=8,
                    max_completion_length=4, beta=0.04, learning_rate=1e-2)
PROMPTS = task.split_problems(16, 0)[0]
TIMES = ("generation_s", "scoring_s", "training_s", "generation/tokens_per_s")


def tiny_actor():
    return models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=16,
                        num_layers=1, seed=3)


def spread(prompts, completions, **_):
    """A reward that tells a group's answers apart (every advantage nonzero, the update far
    above the comparison's tolerance): each answer's character codes summed, mod 7."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def trainer(config, mesh, reward=distinct_chars, **kw):
    return GRPOTrainer(config, tiny_actor(), mesh=mesh, tokenizer=TOKENIZER, prompts=PROMPTS,
                       reward_funcs=[reward], eos_id=EOS, seed=0, **kw)


def test_staleness_zero_reproduces_the_colocated_run_and_syncs_at_the_floor():
    iterations = 2
    colocated = run_grpo(CONFIG, iterations, None, mesh=None, tokenizer=None, prompts=(),
                         trainer=trainer(CONFIG, zeroxla.make_mesh(1, 4,
                                                                   devices=jax.devices()[:4])))
    split = trainer(CONFIG.replace(rollout_devices=4), zeroxla.make_mesh(2, 4))
    run = run_grpo(CONFIG, iterations, None, mesh=None, tokenizer=None, prompts=(),
                   trainer=split)
    assert {d.id for d in split.engine.mesh.devices.flat} == {4, 5, 6, 7}
    assert {d.id for d in split.actor_step.layout.mesh.devices.flat} == {0, 1, 2, 3}
    for want, got, rollout, again in zip(colocated.records, run.records, colocated.rollouts,
                                         run.rollouts):
        for key in set(want) - set(TIMES):
            assert got[key] == want[key], key
        np.testing.assert_array_equal(again.tokens, rollout.tokens)
        np.testing.assert_array_equal(again.logprobs, rollout.logprobs)
        assert (got["policy_version"], got["staleness"]) == (got["iteration"], 0)
    np.testing.assert_array_equal(run.rollouts[1].rewards, colocated.rollouts[1].rewards)
    # one copy of the float32 trainable weights per sync, counted from the model alone
    floor = sum(math.prod(np.shape(x)) * 4 for x in jax.tree.leaves(
        zeroxla.gathered_model(split.actor_state)))
    assert [r["sync/bytes"] for r in run.records] == [floor] * iterations
    assert run.records[0]["sync/floor_bytes"] == floor
    assert split.rollouts.group.syncs == iterations
    events = split.rollouts.events          # k = 0: the synchronous order
    assert events == [(e, kind, i) for i in range(iterations) for kind, e in (
        ("rollout", "dispatch"), ("rollout", "read"), ("update", "dispatch"),
        ("update", "read"))]


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"max_staleness=1 is invalid.*rollout_devices > 0"):
        CONFIG.replace(max_staleness=1)
    with pytest.raises(ValueError, match=r"rollout_devices=-1 is invalid"):
        CONFIG.replace(rollout_devices=-1)
    with pytest.raises(ValueError, match=r"rollout_devices=2 on 8 devices; accepted: 0 .*or 4"):
        trainer(CONFIG.replace(rollout_devices=2), zeroxla.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"partial_rollout=2 is invalid.*max_staleness >= 1"):
        CONFIG.replace(rollout_devices=4, partial_rollout=2)
    with pytest.raises(ValueError, match=r"partial_rollout=4 is invalid.*\[1, "
                                         r"max_completion_length=4\)"):
        CONFIG.replace(rollout_devices=4, max_staleness=1, partial_rollout=4)
    with pytest.raises(ValueError, match=r"behav_imp_weight_cap=5.0 is invalid.*decoupled"):
        CONFIG.replace(behav_imp_weight_cap=5.0)
    with pytest.raises(ValueError, match=r"behav_imp_weight_cap=1.0 is invalid; accepted: "
                                         r"None, or a number > 1"):
        CONFIG.replace(rollout_correction="decoupled", behav_imp_weight_cap=1.0)
    with pytest.raises(ValueError, match=r"rollout_devices=4 with LoRA adapters"):
        trainer(CONFIG.replace(rollout_devices=4), zeroxla.make_mesh(2, 4),
                lora=zeroxla.lora.LoRAConfig(dim=2))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_bounded_staleness_versions_updates_and_dispatch_order(k):
    lr, iterations = 0.5, 4
    config = CONFIG.replace(rollout_devices=4, max_staleness=k, rollout_correction="tis",
                            num_generations=4, max_completion_length=6)
    split = trainer(config, zeroxla.make_mesh(2, 4), spread, optimizer=optax.sgd(lr))
    records = []
    for i in range(iterations):
        before = zeroxla.gathered_model(split.actor_state)
        record, rollout = split.iteration(i)
        records.append(record)
        if i in (0, k):          # the first update, and the first of a rollout k versions old
            losses, expected = reference_update(before, rollout, rollout.rewards, config, lr)
            assert record["loss"] == pytest.approx(losses[0], rel=1e-5)
            assert_update(before, zeroxla.gathered_model(split.actor_state), expected)
    for i, record in enumerate(records):
        assert record["policy_version"] == max(0, i - k)
        assert 0 <= record["staleness"] == i - record["policy_version"] <= k
    assert records[-1]["staleness"] == k
    events = split.rollouts.events
    for i in range(iterations):
        read = events.index(("read", "update", i))
        assert events.index(("dispatch", "update", i)) < read
        for later in range(i + 1, i + k + 1):
            assert events.index(("dispatch", "rollout", later)) < read


@pytest.mark.slow
def test_partial_rollouts_tag_tokens_with_versions_and_train_decoupled():
    lr, cut = 0.5, 2
    config = CONFIG.replace(rollout_devices=4, max_staleness=1, partial_rollout=cut,
                            rollout_correction="decoupled", behav_imp_weight_cap=5.0,
                            num_generations=4, max_completion_length=6)
    split = trainer(config, zeroxla.make_mesh(2, 4), spread, optimizer=optax.sgd(lr))
    models_at = []                                   # the plain actor at version v
    for i in range(2):
        models_at.append(zeroxla.gathered_model(split.actor_state))
        record, rollout = split.iteration(i)
    # rollout 1: its first pass (2 tokens) from version 0, the rest from version 1
    real = rollout.action_mask > 0
    lengths = real.sum(1)
    first = np.minimum(lengths, cut)
    want = np.where(np.arange(real.shape[1]) < first[:, None], 0, 1) * real - (1 - real)
    np.testing.assert_array_equal(rollout.versions, want)
    carried = int(np.sum(lengths > cut))
    assert record["partial/carried"] == carried >= 2
    assert (record["policy_version"], record["staleness"]) == (0, 1)
    starts = rollout.answer_starts()
    for v, model in enumerate(models_at):
        with jax.enable_x64(True):
            expected = np.asarray(answer_logprobs64(
                nnx_float64(model), rollout.tokens, starts, real.shape[1]))
        at = rollout.versions == v
        np.testing.assert_allclose(rollout.rollout_logprobs[at], expected[at], atol=5e-6)
    for b in np.flatnonzero(lengths > cut):
        answer = rollout.tokens[b, starts[b]:starts[b] + lengths[b]]
        assert rollout.completions[b] == (TOKENIZER.decode(answer[:cut])
                                          + TOKENIZER.decode(answer[cut:]))
        assert EOS not in answer[:cut]
    # the decoupled update from version 1 (pi_prox), each token's pi_behav its version's
    before = models_at[1]
    losses, expected = reference_update(before, rollout, rollout.rewards, config, lr)
    assert record["loss"] == pytest.approx(losses[0], rel=1e-5)
    after = zeroxla.gathered_model(split.actor_state)
    assert_update(before, after, expected)
    assert update_error(before, after, expected) <= 2e-6      # 8.5e-7 measured (CPU)


def nnx_float64(model):
    """A float64 copy of the plain `model` (call under `jax.enable_x64`)."""
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)),
                                            params))
