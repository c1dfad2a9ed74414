"""DeepSpeed-Chat's steps 2 and 3 as jobs: `zeroxla reward` and `zeroxla ppo`, on a tiny random
GPT-2 written by `transformers` and the bundled tiny-shakespeare pairs.

References: the pair metrics recomputed in float64 numpy from the reward model's own scores of
the held-out pairs; `transformers` for the exported actor (its logits and tokenizer).
"""

import dataclasses
import json

import numpy as np
import pytest

import zeroxla
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
from zeroxla.app import chat_data, cli, ppo_job, reward_job, train
from zeroxla.app.job import TrainJobConfig
from zeroxla.rlhf import PPOConfig
from zeroxla.rlhf.reward_model import end_scores

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
PPO = PPOConfig(kl_ctl=0.1, ppo_epochs=2, actor_lr=1e-3, critic_lr=1e-3,
                prompts_per_iteration=16, prompt_length=12, answer_length=12,
                reference_int8=True)          # MixZ++: the frozen reference as int8 codes


def quiet(line):
    del line


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(tmp dir, HF dir, SFT run, reward run, reward summary)."""
    tmp = tmp_path_factory.mktemp("chat")
    hf = gpt2_checkpoint(tmp / "gpt2")
    chat_data.write_jsonl(chat_data.shakespeare_sft(128, seed=0), tmp / "sft.jsonl")
    chat_data.write_jsonl(chat_data.shakespeare_pairs(400, seed=1), tmp / "pairs.jsonl")
    chat_data.write_jsonl(chat_data.shakespeare_prompts(64, seed=2), tmp / "prompts.jsonl")
    train.run(TrainJobConfig(init_from=str(hf), data=str(tmp / "sft.jsonl"), steps=20,
                             batch_size=16, seq_len=48, lr=3e-3, warmup_steps=2, eval_every=20,
                             eval_batches=1, sample_tokens=0, out_dir=str(tmp / "sft"),
                             progress=False), write=quiet)
    summary = reward_job.run(reward_job.RewardJobConfig(
        init_from=str(hf), data=str(tmp / "pairs.jsonl"), steps=60, seq_len=64, eval_every=30,
        out_dir=str(tmp / "rm"), progress=False), write=quiet)
    return tmp, hf, tmp / "sft", tmp / "rm", summary


def test_reward_model_validation_accuracy_rises_well_above_chance(runs):
    tmp, _, _, rm_run, summary = runs
    records = [json.loads(line) for line in (rm_run / "metrics.jsonl").read_text().splitlines()]
    print(f"reward model: validation accuracy {records[0]['val_accuracy']:.3f} -> "
          f"{summary['val_accuracy']:.3f}, margin {summary['val_margin']:.3f}")
    assert records[0]["val_accuracy"] == 0.0           # a zero head ties every pair
    assert summary["val_accuracy"] >= 0.8
    assert records[-1]["loss"] < np.log(2) - 0.2

    # The reported metrics are those of the saved model's scores, recomputed here in float64.
    model, tokenizer = reward_job.load_reward_model(rm_run)
    pairs, val = reward_job.split_examples(chat_data.read_pair_jsonl(tmp / "pairs.jsonl"), 0.1, 0)
    arrays = chat_data.pair_arrays(val, tokenizer, 64, eos_id=tokenizer.eos_id)
    chosen = np.asarray(end_scores(model(arrays["chosen"]), arrays["chosen_end"]), np.float64)
    rejected = np.asarray(end_scores(model(arrays["rejected"]), arrays["rejected_end"]),
                          np.float64)
    np.testing.assert_allclose(summary["val_accuracy"], np.mean(chosen > rejected), rtol=1e-6)
    np.testing.assert_allclose(summary["val_margin"], np.mean(chosen - rejected), rtol=1e-4)
    np.testing.assert_allclose(summary["val_loss"],
                               np.mean(np.log1p(np.exp(-(chosen - rejected)))), rtol=1e-4)


def test_ppo_job_trains_saves_and_exports_the_actor(runs):
    tmp, _, sft_run, rm_run, _ = runs
    out = tmp / "ppo"
    summary = ppo_job.run(ppo_job.PPOJobConfig(
        actor=str(sft_run), reward=str(rm_run), prompts=str(tmp / "prompts.jsonl"), ppo=PPO,
        iterations=2, out_dir=str(out), progress=False), write=quiet)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert (out / ppo_job.PLOT_FILE).stat().st_size > 0
    assert summary["time_split"]["generation_s"] > 0

    actor = zeroxla.load_params(out / "checkpoint" / "actor")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / ppo_job.ACTOR_EXPORT_DIR)
    x = np.random.default_rng(0).integers(0, 512, size=(2, 24)).astype(np.int32)
    with torch.no_grad():
        theirs = exported.eval()(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(actor(x)), theirs, atol=1e-4, rtol=0)
    sft_actor = zeroxla.load_params(sft_run / "checkpoint")
    assert not np.allclose(np.asarray(sft_actor(x)), np.asarray(actor(x)), atol=1e-6)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out / ppo_job.ACTOR_EXPORT_DIR)
    _, tokenizer = ppo_job.load_actor(sft_run)
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
                               ppo=PPO, iterations=1, out_dir=str(tmp_path / "ppo"))
    with pytest.raises(chat_data.ChatDataError, match=r"prompt 2 .* fewer than"):
        ppo_job.run(job, write=quiet)
    with pytest.raises(ValueError, match="is a reward-model run"):
        ppo_job.run(job.__class__(**{**job.__dict__, "actor": str(rm_run)}), write=quiet)
    with pytest.raises(ValueError, match=f"--reward {hf} holds no complete zeroxla checkpoint; "
                                         "accepted: a `zeroxla reward` run directory"):
        ppo_job.run(dataclasses.replace(job, reward=str(hf)), write=quiet)
    prompts = tmp / "prompts.jsonl"
    with pytest.raises(ValueError, match=r"--inference-tp-size 3 does not fit the 8 devices of "
                                         r"--mesh 2x4 and the 4 attention heads of --actor .*; "
                                         r"accepted: 1, 2, 4$"):
        ppo_job.run(dataclasses.replace(job, prompts=str(prompts), inference_tp_size=3),
                    write=quiet)
    with pytest.raises(ValueError, match=r"--max-prompt-seq-len 12 \+ --max-answer-seq-len 120 = "
                                         r"132 tokens exceed the max_seq_len=128 of --actor"):
        ppo_job.run(dataclasses.replace(job, prompts=str(prompts),
                                        ppo=PPO.replace(answer_length=120)), write=quiet)
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
    job = reward_job.RewardJobConfig(init_from=str(hf), data=str(tmp / "pairs.jsonl"), steps=2,
                                     eval_every=1, seq_len=64, out_dir=str(out), progress=False)
    with pytest.raises(KeyboardInterrupt):           # Ctrl-C during step 1's report
        reward_job.run(job, write=stop_at("step", KeyboardInterrupt()))
    assert not out.exists()
    reward_job.run(job, write=quiet)                 # the same --out again: accepted
    assert (out / "summary.json").is_file()

    out = tmp_path / "ppo"
    job = ppo_job.PPOJobConfig(actor=str(sft_run), reward=str(rm_run),
                               prompts=str(tmp / "prompts.jsonl"), ppo=PPO, iterations=1,
                               out_dir=str(out), progress=False)
    with pytest.raises(RuntimeError, match="disk full"):
        ppo_job.run(job, write=stop_at("iteration", RuntimeError("disk full")))
    assert not out.exists()
