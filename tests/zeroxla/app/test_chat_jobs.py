"""DeepSpeed-Chat's steps 2 and 3 as jobs: `zeroxla reward` and `zeroxla ppo`, on a tiny random
GPT-2 written by `transformers` and the bundled tiny-shakespeare pairs; the trained reward model
exported to Hugging Face and used again from there. The runner's rules where they touch each
job's own code (tests/zeroxla/app/run/test_runner.py has the rules): Ctrl-C then --resume, an
edited data file refused, a diverging run.

References: the pair metrics recomputed in float64 numpy from the reward model's own scores of
the held-out pairs; `transformers` for the exported actor (its logits and tokenizer) and for the
exported reward model (its scores of the held-out pairs and of the PPO rollouts).
"""

import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla.app import chat_data, cli
from zeroxla.app.run import rundir
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.jobs import loading
from zeroxla.app.jobs import ppo as ppo_job
from zeroxla.app.jobs import reward as reward_job
from zeroxla.app.run import runner
from zeroxla.app.run.job import RunSettings
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.rlhf import PPOConfig, Rollout
from zeroxla.rlhf.reward_model import end_scores
from job_runs import quiet

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
PPO = PPOConfig(kl_ctl=0.1, ppo_epochs=2, actor_lr=1e-3, critic_lr=1e-3,
                prompts_per_iteration=16, prompt_length=12, answer_length=12)


def reward(write=quiet, **fields):
    """`zeroxla reward` in-process: the tree's `fields`, `run` given as RunSettings' fields."""
    run = RunSettings(**{"eval_every": 50, "progress": False, **fields.pop("run")})
    return runner.run(reward_job.RewardJob(reward_job.RewardJobConfig(**fields, run=run)),
                      write=write)


def ppo(write=quiet, **fields):
    """`zeroxla ppo` in-process, as `reward`."""
    run = RunSettings(**{"eval_every": 1, "progress": False, **fields.pop("run")})
    return runner.run(ppo_job.PPOJob(ppo_job.PPOJobConfig(**fields, run=run)), write=write)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(tmp dir, HF dir, SFT run, reward run, reward summary)."""
    tmp = tmp_path_factory.mktemp("chat")
    hf = gpt2_checkpoint(tmp / "gpt2")
    chat_data.write_jsonl(chat_data.shakespeare_sft(128, seed=0), tmp / "sft.jsonl")
    chat_data.write_jsonl(chat_data.shakespeare_pairs(400, seed=1), tmp / "pairs.jsonl")
    chat_data.write_jsonl(chat_data.shakespeare_prompts(64, seed=2), tmp / "prompts.jsonl")
    train_job.run(resolve_job(dict(init_from=str(hf), data=str(tmp / "sft.jsonl"), steps=20,
                                   batch_size=16, seq_len=48, lr=3e-3, warmup_steps=2,
                                   eval_every=20, eval_batches=1, sample_tokens=0,
                                   out_dir=str(tmp / "sft"), progress=False)), write=quiet)
    summary = reward(init_from=str(hf), data=str(tmp / "pairs.jsonl"), steps=60, seq_len=64,
                     run=dict(eval_every=30, out_dir=str(tmp / "rm")))
    return tmp, hf, tmp / "sft", tmp / "rm", summary


@pytest.fixture(scope="module")
def ppo_run(runs):
    """Two PPO iterations from the SFT and reward runs, uninterrupted: (out, summary)."""
    tmp, _, sft_run, rm_run, _ = runs
    out = tmp / "ppo"
    return out, ppo(actor=str(sft_run), reward=str(rm_run), prompts=str(tmp / "prompts.jsonl"),
                    ppo=PPO, iterations=2, run=dict(out_dir=str(out)))


def test_reward_model_validation_accuracy_rises_well_above_chance(runs):
    tmp, _, _, rm_run, summary = runs
    records = [json.loads(line) for line in (rm_run / "metrics.jsonl").read_text().splitlines()]
    print(f"reward model: validation accuracy {records[0]['val_accuracy']:.3f} -> "
          f"{summary['val_accuracy']:.3f}, margin {summary['val_margin']:.3f}")
    assert records[0]["val_accuracy"] == 0.0           # a zero head ties every pair
    assert summary["val_accuracy"] >= 0.8
    assert records[-1]["loss"] < np.log(2) - 0.2

    # The reported metrics are those of the saved model's scores, recomputed here in float64.
    model, tokenizer = loading.load_reward_model(rm_run)
    pairs, val = reward_job.split_examples(chat_data.read_pair_jsonl(tmp / "pairs.jsonl"), 0.1, 0)
    arrays = chat_data.pair_arrays(val, tokenizer, 64, eos_id=tokenizer.eos_id)
    chosen = np.asarray(end_scores(model(arrays["chosen"]), arrays["chosen_end"]), np.float64)
    rejected = np.asarray(end_scores(model(arrays["rejected"]), arrays["rejected_end"]),
                          np.float64)
    np.testing.assert_allclose(summary["val_accuracy"], np.mean(chosen > rejected), rtol=1e-6)
    np.testing.assert_allclose(summary["val_margin"], np.mean(chosen - rejected), rtol=1e-4)
    np.testing.assert_allclose(summary["val_loss"],
                               np.mean(np.log1p(np.exp(-(chosen - rejected)))), rtol=1e-4)


def test_ppo_job_trains_saves_and_exports_the_actor(runs, ppo_run):
    tmp, _, sft_run, rm_run, _ = runs
    out, summary = ppo_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]

    # The job scores with the reward model it loaded and starts the critic from it: the first
    # rollout's scores are the trained reward model's values at each answer's last real token,
    # its values the reward model's at positions P-1 .. P+G-2 (read by index, in float64).
    rollout = Rollout.load(out / ppo_job.ROLLOUT_DIR / "0.npz")
    assert sorted(p.name for p in (out / ppo_job.ROLLOUT_DIR).iterdir()) == ["0.npz", "1.npz"]
    reward_model, _ = loading.load_reward_model(rm_run)
    values = np.asarray(reward_model(rollout.tokens), np.float64)             # [B, P + G]
    p, lengths = PPO.prompt_length, rollout.action_mask.sum(1).astype(int)
    np.testing.assert_allclose(rollout.scores, [values[b, p + n - 1] for b, n in
                                                enumerate(lengths)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rollout.values, values[:, p - 1:-1] * rollout.action_mask,
                               rtol=1e-5, atol=1e-6)
    assert records[0]["reward"] == pytest.approx(float(np.mean(rollout.scores)), rel=1e-6)
    assert (out / ppo_job.PLOT_FILE).stat().st_size > 0
    # The critic's checkpoint records a reward model's kind and base config: read back as one.
    critic, _ = loading.load_reward_model(out / rundir.CHECKPOINT_DIR / "critic")
    assert np.asarray(critic(rollout.tokens)).shape == rollout.tokens.shape
    assert summary["time_split"]["generation_s"] > 0

    actor = zeroxla.load_params(out / "checkpoint" / "actor")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / ppo_job.PPOJob.EXPORT_DIR)
    x = np.random.default_rng(0).integers(0, 512, size=(2, 24)).astype(np.int32)
    with torch.no_grad():
        theirs = exported.eval()(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(actor(x)), theirs, atol=1e-4, rtol=0)
    sft_actor = zeroxla.load_params(sft_run / "checkpoint")
    assert not np.allclose(np.asarray(sft_actor(x)), np.asarray(actor(x)), atol=1e-6)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out / ppo_job.PPOJob.EXPORT_DIR)
    _, tokenizer = loading.load_actor(sft_run)
    assert hf_tokenizer.encode("Good morrow.") == tokenizer.encode("Good morrow.").tolist()


def test_bad_inputs_are_refused_before_any_compute(runs, tmp_path, capsys):
    tmp, hf, sft_run, rm_run, _ = runs
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    assert cli.main(["reward", "--init-from", str(hf), "--data", str(bad), "--out",
                     str(tmp_path / "rm")]) == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl:2" in err and "'rejected'" in err
    assert not (tmp_path / "rm").exists()

    short = tmp_path / "prompts.jsonl"
    short.write_text('{"prompt": "To be, or not to be, that is the question"}\n{"prompt": "Ay"}\n')
    job = ppo_job.PPOJobConfig(actor=str(sft_run), reward=str(rm_run), prompts=str(short),
                               ppo=PPO, iterations=1,
                               run=RunSettings(out_dir=str(tmp_path / "ppo"), progress=False))

    def run(tree):
        return runner.run(ppo_job.PPOJob(tree), write=quiet)

    with pytest.raises(chat_data.ChatDataError, match=r"prompt 2 .* fewer than"):
        run(job)
    with pytest.raises(ValueError, match="is a reward-model run"):
        run(job.__class__(**{**job.__dict__, "actor": str(rm_run)}))
    # A causal LM directory is refused by its architecture, naming the option.
    with pytest.raises(ValueError, match=f"--reward {hf}: config.json architectures="
                                         r"\['GPT2LMHeadModel'\]: GPT2LMHeadModel is a causal LM"):
        run(dataclasses.replace(job, reward=str(hf)))
    with pytest.raises(ValueError, match=f"--reward {tmp_path} holds no complete zeroxla "
                                         "checkpoint; accepted: a `zeroxla reward` run"):
        run(dataclasses.replace(job, reward=str(tmp_path)))
    prompts = tmp / "prompts.jsonl"
    with pytest.raises(ValueError, match=r"--inference-tp-size 3 does not fit the 8 devices of "
                                         r"--mesh 2x4 and the 4 attention heads of --actor .*; "
                                         r"accepted: 1, 2, 4$"):
        run(dataclasses.replace(job, prompts=str(prompts), inference_tp_size=3))
    with pytest.raises(ValueError, match=r"--max-prompt-seq-len 12 \+ --max-answer-seq-len 120 = "
                                         r"132 tokens exceed the max_seq_len=128 of --actor"):
        run(dataclasses.replace(job, prompts=str(prompts), ppo=PPO.replace(answer_length=120)))
    assert not (tmp_path / "ppo").exists()


def stop_at(prefix, failure):
    """A `write` that raises `failure` at the first line starting with `prefix`."""
    def write(line):
        if line.startswith(prefix):
            raise failure
    return write


def test_a_job_that_fails_after_making_its_directory_removes_it(runs, tmp_path):
    tmp, hf, sft_run, rm_run, _ = runs
    out = tmp_path / "rm"
    job = dict(init_from=str(hf), data=str(tmp / "pairs.jsonl"), steps=2, seq_len=64,
               run=dict(eval_every=1, out_dir=str(out)))
    with pytest.raises(KeyboardInterrupt):           # an error during step 1's report
        reward(stop_at("step", KeyboardInterrupt()), **dict(job))
    assert not out.exists()
    reward(**dict(job))                              # the same --out again: accepted
    assert (out / "summary.json").is_file()

    out = tmp_path / "ppo"
    with pytest.raises(RuntimeError, match="disk full"):
        ppo(stop_at("iteration", RuntimeError("disk full")), actor=str(sft_run),
            reward=str(rm_run), prompts=str(tmp / "prompts.jsonl"), ppo=PPO, iterations=1,
            run=dict(out_dir=str(out)))
    assert not out.exists()
def interrupt_at(prefix):
    """A `write` that sends this process SIGINT at the first line starting with `prefix`: the
    runner finishes that unit, saves it and raises RunInterrupted."""
    def write(line):
        if line.startswith(prefix):
            os.kill(os.getpid(), signal.SIGINT)
    return write


def copy_of(path, directory):
    """`path` copied into `directory` (a data file this test may edit)."""
    copy = directory / path.name
    copy.write_bytes(path.read_bytes())
    return copy


def edited_refused(command, out, option, path, line, capsys):
    """`zeroxla COMMAND --resume OUT` with `line` added to the data file `path` since is refused
    (exit 2) naming `option` and the file; `path` is then put back as it was."""
    original = path.read_bytes()
    path.write_bytes(original + line)
    assert cli.main([command, "--resume", str(out), "--no-progress"]) == 2
    assert f"{option} {path} changed since the run read it" in capsys.readouterr().err
    path.write_bytes(original)


def test_reward_ctrl_c_then_resume_redoes_the_later_steps_exactly(runs, tmp_path, capsys):
    """SIGINT during step 1 of 2 saves step 1 (no summary); `--resume` with the --data file
    edited since is refused naming it; with the file as it was, the run continues at step 2 to
    the records and figures of the same run uninterrupted."""
    tmp, hf, *_ = runs
    data = copy_of(tmp / "pairs.jsonl", tmp_path)
    fields = dict(init_from=str(hf), data=str(data), steps=2, seq_len=64)
    whole = reward(**fields, run=dict(eval_every=1, out_dir=str(tmp_path / "whole")))
    out = tmp_path / "rm"
    with pytest.raises(runner.RunInterrupted) as stopped:
        reward(interrupt_at("step     1"), **fields, run=dict(eval_every=1, out_dir=str(out)))
    assert stopped.value.signum == signal.SIGINT and stopped.value.done == 1
    assert sorted(p.name for p in (out / rundir.CHECKPOINT_DIR).iterdir()) == ["1"]
    assert not (out / rundir.SUMMARY_FILE).exists()
    edited_refused("reward", out, "--data", data,
                   b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n', capsys)
    assert cli.main(["reward", "--resume", str(out), "--no-progress"]) == 0
    assert rundir.read_metrics(out / rundir.METRICS_FILE) == rundir.read_metrics(
        tmp_path / "whole" / rundir.METRICS_FILE)
    resumed = json.loads((out / rundir.SUMMARY_FILE).read_text())
    assert {k: resumed[k] for k in ("val_accuracy", "val_margin", "val_loss", "final_train_loss",
                                    "first_val_accuracy")} == {
        k: whole[k] for k in ("val_accuracy", "val_margin", "val_loss", "final_train_loss",
                              "first_val_accuracy")}


def test_a_diverging_reward_run_exits_1_keeping_its_last_finite_checkpoint(runs, tmp_path,
                                                                         capsys):
    """A learning rate that makes the scores overflow (Adam's first update puts `v_head` at
    +-3e38, so step 2's scores are +-inf and its loss NaN): step 2 skips its update
    (`check_grad_overflow`), the run stops with exit 1 naming step 2, its checkpoint holds step
    1's finite parameters, and there is no summary."""
    tmp, hf, *_ = runs
    out = tmp_path / "rm"
    assert cli.main(["reward", "--init-from", str(hf), "--data", str(tmp / "pairs.jsonl"),
                     "--steps", "4", "--seq-len", "64", "--learning-rate", "3e38",
                     "--save-every", "1", "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "step 2: the loss is nan (not finite)" in err and "update was skipped" in err, err
    assert sorted(p.name for p in (out / rundir.CHECKPOINT_DIR).iterdir()) == ["1", "2"]
    assert not (out / rundir.SUMMARY_FILE).exists()
    meta = zeroxla.checkpoint.read_metadata(out / rundir.CHECKPOINT_DIR)
    factory = loading.reward_model_factory(
        zeroxla.checkpoint.model_config_from_record(meta["model_config"]))
    first, kept = (zeroxla.load_params(out / rundir.CHECKPOINT_DIR, step=step, model=factory)
                   for step in (1, 2))
    assert np.abs(np.asarray(kept.v_head[...])).max() > 1e38        # step 1's update
    for before, after in zip(jax.tree.leaves(nnx.state(first)), jax.tree.leaves(nnx.state(kept))):
        assert np.isfinite(np.asarray(after)).all()
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))


def test_ppo_ctrl_c_then_resume_continues_at_the_next_iteration(runs, ppo_run, tmp_path,
                                                                capsys):
    """SIGINT during iteration 0 of 2 saves the actor and the critic after it; `--resume`
    with the --prompts file edited since is refused naming it; with the file as it was, the run
    continues at iteration 1 to the records of the same run uninterrupted (the rollouts are
    drawn from (seed, iteration) and the restored states)."""
    tmp, _, sft_run, rm_run, _ = runs
    prompts = copy_of(tmp / "prompts.jsonl", tmp_path)
    out = tmp_path / "ppo"
    with pytest.raises(runner.RunInterrupted) as stopped:
        ppo(interrupt_at("iteration   0"), actor=str(sft_run), reward=str(rm_run),
            prompts=str(prompts), ppo=PPO, iterations=2, run=dict(out_dir=str(out)))
    assert stopped.value.signum == signal.SIGINT and stopped.value.done == 1
    for part in ("actor", "critic"):                 # ppo_epochs steps of each model
        assert [p.name for p in (out / rundir.CHECKPOINT_DIR / part).iterdir()] == ["2"]
    assert not (out / ppo_job.PPOJob.EXPORT_DIR).exists()
    edited_refused("ppo", out, "--prompts", prompts,
                   b'{"prompt": "ROMEO:\\nOne more prompt, long enough"}\n', capsys)
    assert cli.main(["ppo", "--resume", str(out), "--no-progress"]) == 0
    assert "resumed from" in capsys.readouterr().out

    def figures(run_dir):
        return [{k: v for k, v in record.items() if not k.endswith("_s")} for record in
                rundir.read_metrics(run_dir / rundir.METRICS_FILE, key="iteration")]

    assert [r["iteration"] for r in figures(out)] == [0, 1]
    assert figures(out) == figures(ppo_run[0])
    assert sorted(p.name for p in (out / ppo_job.ROLLOUT_DIR).iterdir()) == ["1.npz"]
    assert (out / ppo_job.PPOJob.EXPORT_DIR / "config.json").is_file()


# ---- the trained reward model through Hugging Face ----------------------------------------------
@pytest.fixture(scope="module")
def exported_rm(runs):
    """`zeroxla export` of the trained reward run: a GPT2ForSequenceClassification directory."""
    tmp, _, _, rm_run, _ = runs
    out = tmp / "rm_hf"
    assert cli.main(["export", str(rm_run / "checkpoint"), str(out)]) == 0
    return out


def val_pairs(tmp, tokenizer):
    """The held-out pairs of every reward run here (val_fraction 0.1, seed 0), as arrays."""
    _, val = reward_job.split_examples(chat_data.read_pair_jsonl(tmp / "pairs.jsonl"), 0.1, 0)
    return chat_data.pair_arrays(val, tokenizer, 64, eos_id=tokenizer.eos_id)


def pooled_scores(model, tokens):
    """transformers' own score of each row (its pooling: the last id that is not pad)."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]


def test_the_exported_reward_model_reproduces_the_runs_validation(runs, exported_rm):
    """transformers, given the held-out pairs padded with the export's pad id, scores them as the
    run did: its accuracy and margin are the run's final validation figures."""
    tmp, _, _, _, summary = runs
    model = transformers.AutoModelForSequenceClassification.from_pretrained(exported_rm).eval()
    pad = model.config.pad_token_id
    arrays = val_pairs(tmp, PretrainedTokenizer.from_dir(exported_rm))       # padded with `pad`
    chosen, rejected = (pooled_scores(model, arrays[k]).astype(np.float64)
                        for k in ("chosen", "rejected"))
    assert (arrays["chosen"] == pad).any()
    np.testing.assert_allclose(np.mean(chosen > rejected), summary["val_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(np.mean(chosen - rejected), summary["val_margin"], rtol=1e-4)


def test_reward_job_init_from_the_export_starts_from_its_head(runs, exported_rm):
    """`zeroxla reward --init-from` the export: its step-0 validation (before any update) is
    transformers' scores of the held-out pairs."""
    tmp = runs[0]
    out = tmp / "rm_again"
    reward(init_from=str(exported_rm), data=str(tmp / "pairs.jsonl"), steps=1, seq_len=64,
           run=dict(eval_every=1, out_dir=str(out)))
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(exported_rm).eval()
    arrays = val_pairs(tmp, PretrainedTokenizer.from_dir(exported_rm))
    chosen, rejected = (pooled_scores(model, arrays[k]).astype(np.float64)
                        for k in ("chosen", "rejected"))
    assert first["step"] == 0
    np.testing.assert_allclose(first["val_chosen_score"], np.mean(chosen), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(first["val_rejected_score"], np.mean(rejected), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(first["val_loss"], np.mean(np.logaddexp(0, rejected - chosen)),
                               rtol=1e-4)


def test_ppo_job_with_the_exported_reward_model_scores_with_it(runs, exported_rm):
    """`zeroxla ppo --reward` the export: the first rollout's scores are transformers' scores of
    its rows (each padded after its last real token with the export's pad id), the critic's
    first values transformers' scores at positions P-1 .. P+G-2."""
    tmp, _, sft_run, _, _ = runs
    out = tmp / "ppo_hf"
    ppo(actor=str(sft_run), reward=str(exported_rm), prompts=str(tmp / "prompts.jsonl"),
        ppo=PPO, iterations=1, run=dict(out_dir=str(out)))
    rollout = Rollout.load(out / ppo_job.ROLLOUT_DIR / "0.npz")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(exported_rm).eval()
    p = PPO.prompt_length
    real = np.concatenate([np.ones((len(rollout.tokens), p)), rollout.action_mask], axis=1) > 0
    padded = np.where(real, rollout.tokens, model.config.pad_token_id)
    np.testing.assert_allclose(rollout.scores, pooled_scores(model, padded), atol=1e-4, rtol=0)
    with torch.no_grad():
        hidden = model.base_model(torch.as_tensor(rollout.tokens, dtype=torch.long))
        every = model.score(hidden.last_hidden_state).numpy()[..., 0]        # [B, P + G]
    np.testing.assert_allclose(rollout.values, every[:, p - 1:-1] * rollout.action_mask,
                               atol=1e-4, rtol=0)
    assert np.std(rollout.scores) > 1e-3
