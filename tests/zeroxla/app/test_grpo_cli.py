"""`zeroxla grpo`'s options (zeroxla/app/grpo_cli.py) reach GRPOConfig under TRL's names, and
bad combinations are refused before anything runs, naming the option."""

import json
import signal

import pytest

from zeroxla.app import grpo_job
from zeroxla.app.cli import build_parser, main
from zeroxla.rlhf import GRPOConfig


def test_options_reach_the_config(monkeypatch):
    seen = {}
    monkeypatch.setattr(grpo_job, "run", lambda job: seen.setdefault("job", job) and {})
    args = build_parser().parse_args([
        "grpo", "--actor", "runs/sft", "--loss-type", "dr_grpo", "--scale-rewards", "none",
        "--epsilon", "0.1", "--epsilon-high", "0.3", "--beta", "0.04", "--num-iterations", "2",
        "--advantage", "rloo", "--num-generations", "4", "--per-iteration-prompts", "2",
        "--max-completion-length", "12", "--reward-funcs", "accuracy", "format",
        "--reward-weights", "1", "0.5", "--iterations", "3", "--save-every", "2"])
    assert args.handler(args) == 0
    job = seen["job"]
    assert job.grpo == GRPOConfig(loss_type="dr_grpo", scale_rewards="none", epsilon=0.1,
                                  epsilon_high=0.3, beta=0.04, num_iterations=2,
                                  advantage="rloo", num_generations=4, prompts_per_iteration=2,
                                  max_completion_length=12)
    assert job.reward_funcs == ("accuracy", "format") and job.reward_weights == (1.0, 0.5)
    assert (job.iterations, job.save_every, job.prompts) == (3, 2, None)


@pytest.mark.parametrize("fields, message", [
    (dict(prompts="rows.jsonl"), "--prompts without --reward-funcs or --reward"),
    (dict(reward_weights=(1.0,)), "--reward-weights has 1 values for 2 reward sources"),
    (dict(grpo=GRPOConfig(num_generations=3, prompts_per_iteration=1)),
     "--per-iteration-prompts x --num-generations 3 is not a multiple of the 8"),
    (dict(iterations=0), "GRPOJobConfig.iterations=0 is invalid")])
def test_bad_jobs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        grpo_job.GRPOJobConfig(actor="runs/sft", **fields)


@pytest.mark.parametrize("fields, message", [
    (dict(loss_type="bnpo"), "loss_type='bnpo' is invalid; accepted: grpo | dr_grpo | dapo"),
    (dict(scale_rewards=True), "scale_rewards=True is invalid; accepted: group | batch | none"),
    (dict(epsilon=1.5), "epsilon=1.5 is invalid"), (dict(beta=-1), "beta=-1 is invalid")])
def test_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**fields)


def test_rollout_correction_options_reach_the_config(monkeypatch):
    seen = {}
    monkeypatch.setattr(grpo_job, "run", lambda job: seen.setdefault("job", job) and {})
    args = build_parser().parse_args(["grpo", "--actor", "runs/sft", "--rollout-correction",
                                      "tis", "--tis-cap", "3", "--reward-funcs", "accuracy"])
    assert args.handler(args) == 0
    assert seen["job"].grpo == GRPOConfig(rollout_correction="tis", tis_cap=3.0)
    with pytest.raises(ValueError, match="GRPOConfig.rollout_correction='is' is invalid"):
        GRPOConfig(rollout_correction="is")
    with pytest.raises(ValueError, match="GRPOConfig.tis_cap=0 is invalid"):
        GRPOConfig(tis_cap=0)


@pytest.mark.parametrize("weight", ["nan", "inf", "1e999", "x"])
def test_reward_weights_must_be_finite(weight, capsys):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["grpo", "--actor", "runs/sft", "--reward-weights", "1",
                                   weight])
    assert refused.value.code == 2
    assert f"argument --reward-weights: {weight!r} is invalid; accepted: a finite number" in (
        capsys.readouterr().err)


def test_reward_weights_may_be_zero_or_negative():
    args = build_parser().parse_args(["grpo", "--actor", "runs/sft", "--reward-weights", "0",
                                      "-0.5", "2e3"])
    assert args.reward_weights == [0.0, -0.5, 2000.0]


@pytest.mark.parametrize("argv, message", [
    (["--num-generations", "1"], "--num-generations 1 is invalid; accepted: an integer >= 2"),
    (["--epsilon", "1.5"], "--epsilon 1.5 is invalid; accepted: a number in (0, 1)"),
    (["--epsilon-high", "0.3", "--tis-cap", "1", "--per-iteration-prompts", "2",
      "--num-generations", "1"], "--num-generations 1 is invalid")])
def test_cli_errors_name_the_option_not_the_config_field(argv, message, capsys):
    assert main(["grpo", "--actor", "runs/sft", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "GRPOConfig" not in err, err


def test_a_reward_module_that_fails_to_import_stops_before_anything_is_written(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "zx_cli_bad_reward.py").write_text("def score(p, c):\n    return [1.0\n")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n")
    monkeypatch.chdir(tmp_path)                  # the module is found in the working directory
    out = tmp_path / "run"
    assert main(["grpo", "--actor", str(tmp_path / "sft"), "--prompts", "rows.jsonl",
                 "--reward-funcs", "zx_cli_bad_reward:score", "--out", str(out)]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert "--reward-funcs zx_cli_bad_reward:score" in first, first
    assert f"{tmp_path / 'zx_cli_bad_reward.py'}:2: SyntaxError" in first, first
    assert not out.exists()


def test_interrupt_message_counts_iterations_as_metrics_jsonl(tmp_path, monkeypatch, capsys):
    """GRPOInterrupted(signum, 2) follows two finished iterations, logged in metrics.jsonl as
    iterations 0 and 1 (test_grpo.py::test_grpo_job_records_stops_resumes_and_exports): the
    message names 1, the log's last."""
    logged = [0, 1]

    def interrupted(job):
        raise grpo_job.GRPOInterrupted(signal.SIGINT, len(logged), tmp_path)

    monkeypatch.setattr(grpo_job, "run", interrupted)
    assert main(["grpo", "--actor", "runs/sft"]) == 130
    err = capsys.readouterr().err
    assert f"interrupted (Ctrl-C) after iteration {logged[-1]}; saved a checkpoint" in err, err
    assert f"after iteration {logged[-1]};" in str(interrupted_error(tmp_path, len(logged)))
    assert "before iteration 0" in str(interrupted_error(tmp_path, 0))


def interrupted_error(run_dir, done):
    return grpo_job.GRPOInterrupted(signal.SIGINT, done, run_dir)


def finished_run(path, iterations):
    """A run directory as a finished `zeroxla grpo --iterations N` leaves it: the checkpoint
    (of a one-layer model, cheap to save; its metadata's "iteration" is the next one, N),
    metrics.jsonl's records 0 .. N - 1 and summary.json."""
    import optax
    from flax import nnx

    import zeroxla
    from zeroxla import checkpoint

    step = zeroxla.make_step(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=0))
    checkpoint.save(path / "checkpoint", step.init(0), layout=step.layout,
                    metadata={"iteration": iterations})
    (path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i}) + "\n"
                                                for i in range(iterations)))
    (path / "summary.json").write_text("{}\n")
    return path


def test_resume_of_a_finished_run_has_nothing_left_to_do(tmp_path, capsys):
    run = finished_run(tmp_path / "grpo", 3)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["iteration"]
    files = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    assert main(["grpo", "--actor", str(tmp_path / "sft"), "--resume", str(run),
                 "--iterations", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"zeroxla grpo: nothing left to do: --resume {run} has run its last iteration, {last}, "
        "of --iterations 3; accepted: a larger --iterations to continue it"], captured.err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == files
