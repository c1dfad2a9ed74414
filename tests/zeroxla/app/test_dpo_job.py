"""`zeroxla dpo` as a job, on a tiny random GPT-2 written by `transformers` and the bundled
tiny-shakespeare pairs: from the start (policy = reference: log 2, zero margins) held-out reward
accuracy, margin and loss reach stated values; the exported policy, read back by
`transformers`, reproduces the run's final held-out accuracy and margin in float64 against the
starting checkpoint; Ctrl-C saves the running step, and the run resumed from it redoes the later
steps exactly. (The runner's own rules: tests/zeroxla/app/run/test_runner.py.)"""

import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from zeroxla import checkpoint
from zeroxla.app import chat_data, cli
from zeroxla.app.jobs import dpo as dpo_job
from zeroxla.app.jobs import loading
from zeroxla.app.run import command, rundir, runner
from zeroxla.app.run.job import RunSettings
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
from zeroxla.rlhf.dpo.losses import DPOConfig
from job_runs import quiet

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 30, 20
DPO = DPOConfig(beta=0.1, learning_rate=1e-3, batch_size=16, seq_len=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(tmp dir, HF dir, the job, its summary)."""
    tmp = tmp_path_factory.mktemp("dpo")
    hf = gpt2_checkpoint(tmp / "gpt2")
    job = dpo_job.DPOJobConfig(init_from=str(hf), dpo=DPO, steps=STEPS,
                               run=RunSettings(eval_every=10, save_every=SAVE_EVERY, seed=0,
                                               out_dir=str(tmp / "dpo"), progress=False))
    return tmp, hf, job, runner.run(dpo_job.DPOJob(job), write=quiet)


def _elsewhere(job, out, **changes):
    """`job` writing into `out` (and other fields changed)."""
    return dataclasses.replace(job, run=dataclasses.replace(job.run, out_dir=str(out)), **changes)


def test_held_out_reward_accuracy_rises_from_the_start(run):
    tmp, _, job, summary = run
    records = rundir.read_metrics(tmp / "dpo" / rundir.METRICS_FILE)
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert all({"loss", "accuracy", "margin"} <= r.keys() for r in records[1:])
    start = records[0]
    # The policy starts as the reference: log 2 and zero margins, up to float32 rounding of
    # two differently compiled forwards (the reference's and the ZeRO-3 step's).
    np.testing.assert_allclose(start["val_loss"], np.log(2.0), rtol=1e-6)
    assert abs(start["val_margin"]) < 1e-5
    np.testing.assert_allclose(records[1]["loss"], np.log(2.0), rtol=1e-6)
    print(f"DPO held-out reward accuracy {start['val_accuracy']:.3f} -> "
          f"{summary['val_accuracy']:.3f}, margin {summary['val_margin']:.3f}, loss "
          f"{start['val_loss']:.4f} -> {summary['val_loss']:.4f}")
    # At the start every held-out pair is a tie broken by rounding (its accuracy, the share of
    # margins > 0, is noise about one half): the stated margins are on the end point, the
    # margin and the loss.
    assert summary["val_accuracy"] >= 0.85
    assert summary["val_margin"] >= 1.0
    assert summary["val_loss"] < start["val_loss"] - 0.3


def test_exported_policy_reproduces_the_held_out_figures_in_transformers(run):
    """float64 transformers log-probs of the exported policy and of the starting checkpoint,
    on the held-out pairs the job split off: their accuracy and margin are the run's."""
    tmp, hf, job, summary = run
    tokenizer, _ = loading.open_policy(str(hf), DPO.seq_len)
    _, val, _ = dpo_job.pair_rows(job, tokenizer)

    def sums(path):
        model = transformers.GPT2LMHeadModel.from_pretrained(path).to(torch.float64).eval()
        out = []
        for key in ("chosen", "rejected"):
            tokens = torch.tensor(val[key], dtype=torch.long)
            with torch.no_grad():
                logp = torch.log_softmax(model(tokens[:, :-1]).logits, -1)
            token = logp.gather(-1, tokens[:, 1:, None])[..., 0].numpy()
            out.append((token * val[f"{key}_mask"]).sum(-1))
        return out

    (pc, pr), (rc, rr) = sums(summary["policy_hf"]), sums(hf)
    margins = DPO.beta * ((pc - rc) - (pr - rr))
    np.testing.assert_allclose(np.mean(margins > 0), summary["val_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(np.mean(margins), summary["val_margin"], rtol=1e-4)
    np.testing.assert_allclose(np.mean(np.logaddexp(0, -margins)), summary["val_loss"], rtol=1e-4)


def test_ctrl_c_saves_and_resume_redoes_the_later_steps_exactly(run, capsys):
    """The same job stopped by SIGINT during step 10 saves step 10 and raises RunInterrupted;
    `zeroxla dpo --resume` continues it to the same step records as the uninterrupted run."""
    tmp, _, job, summary = run
    out = tmp / "interrupted"

    def interrupt(line):
        if line.startswith("step    10"):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(runner.RunInterrupted) as stopped:
        runner.run(dpo_job.DPOJob(_elsewhere(job, out)), write=interrupt)
    assert stopped.value.signum == signal.SIGINT and not (out / "policy_hf").exists()
    assert sorted(p.name for p in (out / rundir.CHECKPOINT_DIR).iterdir()) == ["10"]
    assert cli.main(["dpo", "--resume", str(out), "--no-progress"]) == 0
    original = rundir.read_metrics(tmp / "dpo" / rundir.METRICS_FILE)
    assert rundir.read_metrics(out / rundir.METRICS_FILE) == original
    assert json.loads((out / rundir.SUMMARY_FILE).read_text())["val_accuracy"] == \
        summary["val_accuracy"]
    # An option given with --resume is taken and said by name; the policy it starts from (the
    # frozen reference) cannot change, and is refused by name.
    _, _, lines = command.resolve(dpo_job.SPEC, {"resume": str(out), "beta": 0.5})
    assert "--beta 0.1 -> 0.5" in lines[0], lines
    assert cli.main(["dpo", "--resume", str(out), "--init-from", str(tmp)]) == 2
    err = capsys.readouterr().err
    assert f"--init-from {str(_)!r}" not in err and "cannot change" in err, err
    assert f"-> {str(tmp)!r} cannot change" in err, err


def test_pairs_without_preference_are_reported_in_rewards_words(run, tmp_path):
    """The start line counts the pairs whose chosen and rejected are the same tokens in the
    words `zeroxla reward` uses; the job (stopped at that line) leaves no directory."""
    tmp, hf, job, _ = run
    pairs = chat_data.shakespeare_pairs(20, seed=1)
    for i in (3, 7):
        pairs[i] = chat_data.PairExample(pairs[i].prompt, pairs[i].chosen, pairs[i].chosen)
    data = chat_data.write_jsonl(pairs, tmp_path / "pairs.jsonl")
    lines = []

    def stop_at_start(line):
        lines.append(line)
        if not line.startswith("zeroxla dpo: run directory "):
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        runner.run(dpo_job.DPOJob(_elsewhere(job, out, data=str(data))), write=stop_at_start)
    assert "(18 train / 2 held-out pairs; 2 with the same tokens for chosen and rejected add " \
           "nothing to the loss)" in lines[-1], lines
    assert not out.exists()


def test_a_diverging_run_exits_1_keeping_its_last_finite_state(run, tmp_path, capsys):
    """`--learning-rate 3e38` (Adam's first update moves every weight by ~3e38): the loss turns
    non-finite, the step skips that update, the run stops with exit 1 naming the step, keeps a
    finite checkpoint and exports nothing (it used to finish with NaN and export it)."""
    _, hf, _, _ = run
    out = tmp_path / "diverged"
    code = cli.main(["dpo", "--init-from", str(hf), "--steps", "6", "--batch-size", "16",
                     "--learning-rate", "3e38", "--eval-every", "6", "--out", str(out),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "(not finite), so training stopped" in err and "nothing was exported" in err
    assert not (out / "policy_hf").exists() and not (out / rundir.SUMMARY_FILE).exists()
    for line in (out / rundir.METRICS_FILE).read_text().splitlines():   # strict JSON
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
    assert "holds the parameters" in err, err        # the step skipped the update
    params = checkpoint.load_params(out / rundir.CHECKPOINT_DIR)
    assert all(np.isfinite(np.asarray(v)).all()
               for v in jax.tree.leaves(nnx.state(params, nnx.Param)))
