"""The GRPO loop (zeroxla/rlhf/grpo.py) end to end on the bundled arithmetic task: the reward
reaches the update (permuting a reward function's outputs across samples changes the trained
weights, while the same rewards reproduce them bit for bit; with SGD, each update equals the
float64 reference's for its rewards, test_grpo_update_reference.py), and `zeroxla grpo`'s job
writes its records, stops with a checkpoint, resumes and exports."""

import contextlib
import dataclasses
import json
import signal

import jax
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import checkpoint, models
from zeroxla.app.tokenizer import CharTokenizer
from zeroxla.app.tokenizer_records import tokenizer_record
from zeroxla.rlhf import GRPOConfig, arithmetic_task as task
from zeroxla.rlhf.grpo import GRPOTrainer
from test_grpo_update_reference import assert_update, reference_update

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
EOS = int(TOKENIZER.encode(task.END)[0])
CONFIG = GRPOConfig(num_generations=4, prompts_per_iteration=4, prompt_length=8,
                    max_completion_length=6, num_iterations=2, beta=0.04, learning_rate=1e-2)


SGD_LR = 0.2


def tiny_actor():
    return models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=32, seed=3)


def distinct_chars(prompts, completions, **_):
    """A reward that varies across random answers: distinct characters / 6."""
    return [len(set(c)) / 6 for c in completions]


def reversed_distinct_chars(prompts, completions, **_):
    return distinct_chars(prompts, completions)[::-1]


def trained_params(trainer, reward_fn):
    trainer.actor_state = trainer.actor_step.init(0)
    trainer.reward_funcs = type(trainer.reward_funcs)((reward_fn,))
    rollout, _, _ = trainer.generate_experience(0)
    trainer.train_grpo(rollout)
    return rollout, jax.tree.map(np.asarray, zeroxla.gathered_model(trainer.actor_state))


@pytest.mark.slow
def test_permuted_rewards_change_the_update():
    trainer = GRPOTrainer(CONFIG, tiny_actor(), mesh=zeroxla.make_mesh(2, 4),
                          tokenizer=TOKENIZER, prompts=task.split_problems(32, 0)[0],
                          reward_funcs=[distinct_chars], eos_id=EOS, seed=0)
    first, params = trained_params(trainer, distinct_chars)
    assert np.ptp(first.rewards) > 0 and np.any(first.advantages != 0)
    permuted, permuted_params = trained_params(trainer, reversed_distinct_chars)
    again, same_params = trained_params(trainer, distinct_chars)
    np.testing.assert_array_equal(first.tokens, permuted.tokens)     # the same answers
    np.testing.assert_array_equal(permuted.rewards, first.rewards[::-1])
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(permuted_params),
                 jax.tree.leaves(same_params))
    differ = False
    for a, b, c in leaves:
        np.testing.assert_array_equal(a, c)           # same rewards: the same update, exactly
        differ |= not np.allclose(a, b, rtol=0, atol=1e-6)
    assert differ, "permuting the rewards across samples left the update unchanged"

    # The amount: SGD's two steps (num_iterations=2, the second where the ratio moved) from the
    # same start equal the float64 reference's update for the rewards each run was given.
    sgd = GRPOTrainer(CONFIG, tiny_actor(), mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                      prompts=task.split_problems(32, 0)[0], reward_funcs=[distinct_chars],
                      eos_id=EOS, seed=0, optimizer=optax.sgd(SGD_LR))
    start = zeroxla.gathered_model(sgd.actor_step.init(0))
    expected = {}
    for name, fn in (("first", distinct_chars), ("permuted", reversed_distinct_chars)):
        rollout, _ = trained_params(sgd, fn)
        np.testing.assert_array_equal(rollout.tokens, first.tokens)
        expected[name] = reference_update(start, rollout, rollout.rewards, CONFIG, SGD_LR,
                                          steps=CONFIG.num_iterations)[1]
        assert_update(start, zeroxla.gathered_model(sgd.actor_state), expected[name])
    gap = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(expected["first"]),
                                                  jax.tree.leaves(expected["permuted"])))
    assert gap > 1e-3          # the two rewards' updates differ far beyond the tolerance


def save_actor_run(path):
    step = zeroxla.make_step(tiny_actor(), zeroxla.make_mesh(2, 4), optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=3))
    checkpoint.save(path / "checkpoint", step.init(0), layout=step.layout,
                    metadata={"tokenizer": tokenizer_record(TOKENIZER)})
    return path


@pytest.mark.slow
def test_grpo_job_records_stops_resumes_and_exports(tmp_path, monkeypatch):
    """A stop request after the second of three iterations saves and raises GRPOInterrupted;
    --resume runs the third, appends its record, exports the actor."""
    from zeroxla.app import grpo_job
    from zeroxla.app.interrupt import StopRequest

    stop = StopRequest()
    monkeypatch.setattr(grpo_job, "stop_requests", lambda *signals: contextlib.nullcontext(stop))

    def write(line):                     # the request comes while iteration 1 is logged
        if line.startswith("iteration   1"):
            stop.requested, stop.signum = True, signal.SIGINT

    actor, out = save_actor_run(tmp_path / "sft"), tmp_path / "grpo"
    job = grpo_job.GRPOJobConfig(actor=str(actor), grpo=CONFIG, prompt_length=24, iterations=3,
                                 save_every=1, out_dir=str(out))
    with pytest.raises(grpo_job.GRPOInterrupted) as stopped:
        grpo_job.run(job, write=write)
    assert (stopped.value.signum, stopped.value.iteration) == (signal.SIGINT, 2)
    assert checkpoint.latest_step(out / "checkpoint") == 2 * CONFIG.num_iterations
    assert not (out / "summary.json").exists()

    stop.requested = False
    summary = grpo_job.run(dataclasses.replace(job, out_dir=None, resume=str(out)),
                           write=lambda line: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for key in ("reward", "accuracy", "kl", "clip_fraction", "generation_s", "scoring_s",
                "training_s", "reward/accuracy_reward", "reward/format_reward"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert summary["accuracy_before"] is None and 0 <= summary["accuracy_after"] <= 1
    assert (out / "actor_hf" / "config.json").is_file()
    assert checkpoint.latest_step(out / "checkpoint") == 3 * CONFIG.num_iterations
