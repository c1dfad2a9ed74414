"""The GRPO loop (zeroxla/rlhf/grpo/trainer.py) end to end on the bundled arithmetic task: the
reward reaches the update (permuting a reward function's outputs across samples changes the
trained weights, while the same rewards reproduce them bit for bit; with SGD, each update equals
the float64 reference's for its rewards, test_grpo_update_reference.py), a reward model's end
score reaches the reward, and `zeroxla grpo`'s job writes its records, stops with a checkpoint,
resumes and exports."""

import json
import os
import signal

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import checkpoint, models, rlhf
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from test_grpo_update_reference import assert_update, reference_update
from job_runs import distinct_chars

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
EOS = int(TOKENIZER.encode(task.END)[0])
CONFIG = GRPOConfig(num_generations=4, prompts_per_iteration=4, prompt_length=8,
                    max_completion_length=6, num_iterations=2, beta=0.04, learning_rate=1e-2)


SGD_LR = 0.2


def tiny_actor():
    return models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=32, seed=3)


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


@pytest.mark.slow
def test_the_reward_model_adds_its_end_score_read_in_the_step_layout():
    """`reward_model=` (scored in a frozen ZeRO-3 step over the trainer's mesh): each answer's
    `reward_model` part is the plain model's value at its last real token (answer start +
    answer length - 1), and the reward is the functions' plus `reward_model_weight` times it."""
    rm = rlhf.RewardModel(tiny_actor())
    rm.v_head[...] = jax.numpy.asarray(
        np.random.default_rng(7).standard_normal(rm.v_head[...].shape), jax.numpy.float32)
    trainer = GRPOTrainer(CONFIG, tiny_actor(), mesh=zeroxla.make_mesh(2, 4),
                          tokenizer=TOKENIZER, prompts=task.split_problems(32, 0)[0],
                          reward_funcs=[distinct_chars], reward_model=rm,
                          reward_model_weight=0.5, eos_id=EOS, seed=0)
    rollout, _, _ = trainer.generate_experience(0)
    values = np.asarray(nnx.jit(lambda m, t: m(t))(rm, jax.numpy.asarray(rollout.tokens)))
    ends = rollout.answer_starts() + rollout.action_mask.sum(1).astype(int) - 1      # [B]
    want = values[np.arange(len(ends)), ends]
    assert np.std(want) > 0.1
    np.testing.assert_allclose(rollout.reward_parts["reward_model"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rollout.rewards, rollout.reward_parts["distinct_chars"]
                               + 0.5 * rollout.reward_parts["reward_model"], rtol=1e-6)


def save_actor_run(path):
    step = zeroxla.make_step(tiny_actor(), zeroxla.make_mesh(2, 4), optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=3))
    checkpoint.save(path / "checkpoint", step.init(0), layout=step.layout,
                    metadata={"tokenizer": tokenizer_record(TOKENIZER)})
    return path


@pytest.mark.slow
def test_grpo_job_records_stops_resumes_and_exports(tmp_path):
    """SIGINT after the second of three iterations saves it and raises RunInterrupted;
    --resume runs the third, appends its record, exports the actor."""
    from zeroxla.app import cli
    from zeroxla.app.jobs import grpo as grpo_job
    from zeroxla.app.run import runner
    from zeroxla.app.run.job import RunSettings

    def write(line):                     # the request comes as iteration 1 (the 2nd) is saved
        if line.startswith("iteration 1: saved checkpoint"):
            os.kill(os.getpid(), signal.SIGINT)

    actor, out = save_actor_run(tmp_path / "sft"), tmp_path / "grpo"
    job = grpo_job.GRPOJobConfig(actor=str(actor), grpo=CONFIG, prompt_length=24, iterations=3,
                                 run=RunSettings(save_every=1, out_dir=str(out),
                                                 progress=False))
    with pytest.raises(runner.RunInterrupted) as stopped:
        runner.run(grpo_job.GRPOJob(job), write=write)
    assert (stopped.value.signum, stopped.value.done) == (signal.SIGINT, 2)
    assert checkpoint.latest_step(out / "checkpoint") == 2 * CONFIG.num_iterations
    assert not (out / "summary.json").exists()

    assert cli.main(["grpo", "--resume", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for key in ("reward", "accuracy", "kl", "clip_fraction", "generation_s", "scoring_s",
                "training_s", "reward/accuracy_reward", "reward/format_reward",
                "generation/tokens_per_s", "generation/kv_pages_mean",
                "generation/prefill_tokens"):      # the rollout engine's (continuous batching)
        assert all(np.isfinite(r[key]) for r in records), key
    assert summary["accuracy_before"] is None and 0 <= summary["accuracy_after"] <= 1
    assert (out / "actor_hf" / "config.json").is_file()
    assert checkpoint.latest_step(out / "checkpoint") == 3 * CONFIG.num_iterations


REWARD_CALLS = []


def fails_at_the_third_call(prompts, completions, **_):
    """`distinct_chars`, until its third call (iteration 2) raises."""
    REWARD_CALLS.append(len(completions))
    if len(REWARD_CALLS) == 3:
        raise ConnectionError("the reward service went away")
    return distinct_chars(prompts, completions)


def grpo_command(actor, prompts, out, *argv):
    """`zeroxla grpo` of `actor` on the `prompts` file, CONFIG's settings."""
    from zeroxla.app import cli

    return cli.main(["grpo", "--actor", str(actor), "--prompts", str(prompts),
                     "--num-generations", "4", "--per-iteration-prompts", "4",
                     "--max-completion-length", "6", "--num-iterations", "2", "--beta", "0.04",
                     "--max-prompt-seq-len", "24", "--out", str(out), "--no-progress", *argv])


def prompts_file(path):
    path.write_text("".join(json.dumps(row) + "\n" for row in task.split_problems(32, 0)[0]))
    return path


@pytest.mark.slow
def test_a_failure_after_a_checkpoint_keeps_it_and_resume_says_what_changed(tmp_path, capsys):
    """A reward function that raises at iteration 2 of a --save-every 1 run: exit 2 naming it,
    the checkpoints of iterations 0 and 1 and their records kept. --resume takes another
    --seed and --reward-funcs and names them in its first line; a --prompts file edited since
    and another --actor are refused by name."""
    from zeroxla.app.jobs import grpo as grpo_job
    from zeroxla.app.run import command

    actor, out = save_actor_run(tmp_path / "sft"), tmp_path / "grpo"
    prompts = prompts_file(tmp_path / "prompts.jsonl")
    REWARD_CALLS.clear()
    assert grpo_command(actor, prompts, out, "--reward-funcs", "accuracy",
                        f"{__name__}:fails_at_the_third_call", "--iterations", "3",
                        "--save-every", "1") == 2
    err = capsys.readouterr().err
    assert "reward function fails_at_the_third_call raised ConnectionError: the reward " \
           "service went away" in err, err
    assert sorted(int(p.name) for p in (out / "checkpoint").iterdir()) == [
        CONFIG.num_iterations, 2 * CONFIG.num_iterations]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]

    funcs = ("accuracy", f"{__name__}:distinct_chars")
    tree, _, lines = command.resolve(grpo_job.SPEC, {"resume": str(out), "seed": 1,
                                                      "reward_funcs": funcs})
    assert (tree.run.seed, tree.reward_funcs) == (1, funcs)
    assert "--seed 0 -> 1" in lines[0], lines
    assert (f"--reward-funcs ['accuracy', '{__name__}:fails_at_the_third_call'] -> "
            f"['accuracy', '{__name__}:distinct_chars']") in lines[0], lines
    with pytest.raises(ValueError, match="--actor .* cannot change"):
        command.resolve(grpo_job.SPEC, {"resume": str(out), "actor": str(tmp_path)})
    with open(prompts, "a") as f:
        f.write(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=f"--prompts {prompts} changed since the run read it"):
        command.resolve(grpo_job.SPEC, {"resume": str(out)})


@pytest.mark.slow
def test_a_diverging_run_exits_1_without_export_or_nan(tmp_path, capsys):
    """--learning-rate 1e6: the loss is no longer finite in the first iteration; the run stops
    (exit 1) naming it, keeps the last finite parameters (the update was skipped), exports
    nothing and writes no NaN."""
    actor, out = save_actor_run(tmp_path / "sft"), tmp_path / "grpo"
    prompts = prompts_file(tmp_path / "prompts.jsonl")
    assert grpo_command(actor, prompts, out, "--reward-funcs", "accuracy",
                        f"{__name__}:distinct_chars", "--iterations", "2",
                        "--learning-rate", "1e6") == 1
    err = capsys.readouterr().err
    assert "(not finite), so training stopped" in err and "nothing was exported" in err, err
    assert not (out / "actor_hf").exists() and not (out / "summary.json").exists()

    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}")

    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    kept = zeroxla.load_params(out / "checkpoint")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(kept)))
