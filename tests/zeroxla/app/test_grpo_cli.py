"""`zeroxla grpo`'s options (the rows of zeroxla/app/jobs/grpo.py) reach GRPOConfig under TRL's
names, and bad combinations are refused before anything runs, naming the option."""

import dataclasses
import json
import operator
import os
import signal

import jax
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.app.cli import build_parser, main
from zeroxla.app.jobs import grpo as grpo_job
from zeroxla.app.run import command, runner
from zeroxla.app.run.job import RunSettings
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.rollout_correction import RolloutCorrection


def resolved(argv):
    """The job tree `zeroxla grpo ARGV` runs (the command line read, nothing run)."""
    args = build_parser().parse_args(["grpo", *argv])
    return command.resolve(grpo_job.SPEC, grpo_job.OPTIONS.given(args))[0]


def test_options_reach_the_config():
    job = resolved([
        "--actor", "runs/sft", "--loss-type", "dr_grpo", "--scale-rewards", "none",
        "--epsilon", "0.1", "--epsilon-high", "0.3", "--beta", "0.04", "--num-iterations", "2",
        "--advantage", "rloo", "--num-generations", "4", "--per-iteration-prompts", "2",
        "--max-completion-length", "12", "--reward-funcs", "accuracy", "format",
        "--reward-weights", "1", "0.5", "--iterations", "3", "--save-every", "2"])
    assert job.grpo == GRPOConfig(loss_type="dr_grpo", scale_rewards="none", epsilon=0.1,
                                  epsilon_high=0.3, beta=0.04, num_iterations=2,
                                  advantage="rloo", num_generations=4, prompts_per_iteration=2,
                                  max_completion_length=12)
    assert job.reward_funcs == ("accuracy", "format") and job.reward_weights == (1.0, 0.5)
    assert (job.iterations, job.run.save_every, job.prompts) == (3, 2, None)


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
    (dict(epsilon=1.5), "epsilon=1.5 is invalid"), (dict(beta=-1), "beta=-1 is invalid"),
    (dict(batch_invariant=True, rollout_dtype="bfloat16"),
     "batch_invariant=True is invalid; accepted: True or False; True with rollout_dtype")])
def test_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**fields)


def test_rollout_correction_options_reach_the_config():
    job = resolved(["--actor", "runs/sft", "--rollout-correction", "tis", "--tis-cap", "3",
                    "--reward-funcs", "accuracy"])
    assert job.grpo == GRPOConfig(rollout_correction="tis", tis_cap=3.0)
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


class Counting(grpo_job.GRPOJob):
    """`zeroxla grpo`'s job as the runner counts and saves it (its NAME, UNIT, COUNTER, lines,
    recorded tree) on a one-layer model, with no actor, rollouts or rewards: a run takes a
    second. `signal_at`: SIGINT to ourselves during that iteration (0-based)."""

    state = None
    EXPORT_DIR = None
    signal_at = None

    def __init__(self, config):
        self.config, self.total, self.tokenizer = config, config.iterations, None
        self.step = zeroxla.make_step(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                                      zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                                      config=zeroxla.ZeroConfig(stage=0))
        self.state = self.step.init(0)

    def describe(self, first):
        if self.signal_at == -1:
            os.kill(os.getpid(), signal.SIGINT)
        return f"iterations {first}..{self.total - 1}"

    def advance(self, done):
        if done == self.signal_at:
            os.kill(os.getpid(), signal.SIGINT)
        return {"reward": 0.0, "kl": 0.0, "loss": 0.0, "clip_fraction": 0.0}

    def evaluate(self):
        return {}

    def checkpoint_metadata(self, out, part):
        return {}

    def draw(self, out, records):
        pass

    def finish(self, out, records, before):
        return {}


def command_line(argv):
    """`zeroxla grpo ARGV` as the command runs it, with `Counting` for the job."""
    args = build_parser().parse_args(["grpo", *argv])
    return command.run_command(dataclasses.replace(grpo_job.SPEC, job=Counting), args)


def metrics_iterations(out):
    return [json.loads(line)["iteration"] for line in
            (out / "metrics.jsonl").read_text().splitlines()]


def test_an_interrupt_saves_the_iterations_done_and_says_how_to_resume(tmp_path, monkeypatch,
                                                                       capsys):
    """SIGINT during the second of three iterations: it finishes, is saved, and the command
    exits 130 naming the checkpoint and the --resume that continues it."""
    monkeypatch.setattr(Counting, "signal_at", 1)
    out = tmp_path / "grpo"
    assert command_line(["--actor", "sft", "--iterations", "3", "--out", str(out),
                         "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("zeroxla grpo: interrupted (Ctrl-C) after iteration "), err
    assert f"; saved checkpoint {out / 'checkpoint'}/" in err, err
    assert err.endswith(f"\nresume with: zeroxla grpo --resume {out}\n"), err
    assert metrics_iterations(out) == [0, 1]
    assert not (out / "summary.json").exists()


def test_interrupt_message_counts_iterations_as_metrics_jsonl(tmp_path, monkeypatch):
    """Two finished iterations are logged in metrics.jsonl as iterations 0 and 1: the message
    names 1, the log's last; an interrupt before any iteration, "before iteration 0"."""
    monkeypatch.setattr(Counting, "signal_at", 1)
    tree = grpo_job.GRPOJobConfig(actor="sft", iterations=3, run=RunSettings(
        out_dir=str(tmp_path / "two"), progress=False))
    with pytest.raises(runner.RunInterrupted) as stopped:
        runner.run(Counting(tree), write=lambda line: None)
    logged = metrics_iterations(tmp_path / "two")
    assert logged == [0, 1]
    assert f"after iteration {logged[-1]};" in str(stopped.value), stopped.value
    monkeypatch.setattr(Counting, "signal_at", -1)
    tree = dataclasses.replace(tree, run=RunSettings(out_dir=str(tmp_path / "none"),
                                                     progress=False))
    with pytest.raises(runner.RunInterrupted) as stopped:
        runner.run(Counting(tree), write=lambda line: None)
    assert "before iteration 0" in str(stopped.value), stopped.value


def test_resume_of_a_finished_run_has_nothing_left_to_do(tmp_path, capsys):
    """A finished `zeroxla grpo --iterations 3` run (its checkpoint, metrics.jsonl 0 .. 2 and
    summary.json) resumed with --iterations 3: one line, exit 0, nothing written."""
    run = tmp_path / "grpo"
    assert command_line(["--actor", "sft", "--iterations", "3", "--out", str(run),
                         "--no-progress"]) == 0
    assert metrics_iterations(run) == [0, 1, 2]
    capsys.readouterr()
    files = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    assert command_line(["--resume", str(run), "--iterations", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"zeroxla grpo: nothing left to do: --resume {run} has run iteration 3 of 3; accepted: "
        "more iterations to continue it"], captured.err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == files


def test_a_token_budget_on_an_moe_actor_that_weighs_its_aux_loss_is_refused_by_option(
        tmp_path, monkeypatch, capsys):
    """`--ppo-max-token-len-per-gpu` on an actor whose config weighs the router's auxiliary
    loss: refused before the trainer is built (no rollout), naming the options typed (the
    budget, --actor) and the actor's config fields, not the step's gradient_accumulation_steps
    or GRPOConfig."""
    from zeroxla import models
    from zeroxla.app.tokenizers.basic import CharTokenizer
    from zeroxla.rlhf.grpo import arithmetic_task as task

    tokenizer = CharTokenizer.from_text(task.ALPHABET)
    config = models.Qwen3MoeConfig(vocab_size=tokenizer.vocab_size, max_seq_len=64, d_model=16,
                                   num_heads=2, num_kv_heads=2, explicit_head_dim=8,
                                   num_layers=1, mlp_dim=16, num_experts=4,
                                   experts_per_token=2, expert_mlp_dim=8, expert_tile=4,
                                   router_aux_loss_coef=0.01, output_router_logits=True)
    actor = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(0))
    monkeypatch.setattr(grpo_job, "load_actor", lambda run: (actor, tokenizer))
    monkeypatch.setattr(grpo_job, "GRPOTrainer", None)          # built: a TypeError, not 2
    monkeypatch.chdir(tmp_path)
    assert main(["grpo", "--actor", "sft", "--ppo-max-token-len-per-gpu", "64",
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--ppo-max-token-len-per-gpu 64" in err and "--actor sft" in err, err
    assert "router_aux_loss_coef=0.01" in err and "output_router_logits=False" in err, err
    assert "GRPOConfig" not in err and "gradient_accumulation_steps" not in err, err
    assert not (tmp_path / "run").exists()


def test_rollout_corr_options_reach_the_section():
    """verl's rollout-correction options set `RolloutCorrection`; a bad value names the
    option; with the tis alias they are refused."""
    job = resolved(["--actor", "runs/sft", "--rollout-is", "geometric", "--rollout-is-threshold",
                    "1.5", "--rollout-is-threshold-lower", "0.5", "--rollout-rs", "seq_sum", "k1",
                    "--rollout-rs-threshold", "3", "--rollout-bypass"])
    assert job.rollout_corr == RolloutCorrection(
        is_level="geometric", is_threshold=1.5, is_threshold_lower=0.5, rs=("seq_sum", "k1"),
        rs_threshold=3.0, bypass=True)
    with pytest.raises(ValueError, match="--rollout-rs-threshold None is invalid"):
        resolved(["--actor", "runs/sft", "--rollout-rs", "token", "k3"])
    with pytest.raises(ValueError, match="--rollout-correction tis with --rollout-is"):
        resolved(["--actor", "runs/sft", "--rollout-correction", "tis", "--rollout-is", "token"])


def test_async_options_reach_the_config():
    """The decoupled objective, its cap and partial rollouts set `GRPOConfig`'s fields; a cap
    without the decoupled objective names the option."""
    job = resolved(["--actor", "runs/sft", "--mesh", "2x4", "--rollout-devices", "4",
                    "--max-staleness", "1", "--partial-rollout", "2", "--rollout-correction",
                    "decoupled", "--behav-imp-weight-cap", "5"])
    assert (job.grpo.rollout_devices, job.grpo.max_staleness, job.grpo.partial_rollout,
            job.grpo.rollout_correction, job.grpo.behav_imp_weight_cap) == (
        4, 1, 2, "decoupled", 5.0)
    assert job.grpo.correction == RolloutCorrection.decoupled(5.0)
    with pytest.raises(ValueError, match="--behav-imp-weight-cap 5.0 is invalid"):
        resolved(["--actor", "runs/sft", "--behav-imp-weight-cap", "5"])


def _batch_invariant_run(tmp_path, monkeypatch, actor, *flags):
    """`zeroxla grpo --batch-invariant FLAGS` on `actor` (loaded as --actor sft), the trainer
    replaced by a recorder -> (exit code, the actor the trainer was given or None)."""
    from zeroxla.app.tokenizers.basic import CharTokenizer
    from zeroxla.rlhf.grpo import arithmetic_task as task

    given = []

    def trainer(grpo, policy, **kwargs):
        given.append(policy)
        raise ValueError("the trainer is not built here")

    monkeypatch.setattr(grpo_job, "load_actor",
                        lambda run: (actor, CharTokenizer.from_text(task.ALPHABET)))
    monkeypatch.setattr(grpo_job, "GRPOTrainer", trainer)
    monkeypatch.chdir(tmp_path)
    code = main(["grpo", "--actor", "sft", "--batch-invariant", *flags,
                 "--out", str(tmp_path / "run"), "--no-progress"])
    return code, (given[0] if given else None)


def test_batch_invariant_reaches_the_actor_and_is_refused_by_option(tmp_path, monkeypatch,
                                                                    capsys):
    """`--batch-invariant` sets GRPOConfig.batch_invariant and hands the trainer the actor
    rebuilt with batch_invariant=True and the same weights; a GPT actor and a tensor-parallel
    rollout are refused naming the options, the first with the families that have the mode."""
    from zeroxla import models

    assert resolved(["--actor", "runs/sft", "--batch-invariant"]).grpo.batch_invariant
    # shapes only (nothing compiled): the rebuilt actor holds the loaded one's very leaves
    actor = models.abstract_model(models.LlamaConfig.tiny().replace(vocab_size=20))
    code, given = _batch_invariant_run(tmp_path, monkeypatch, actor, "--inference-tp-size", "1")
    assert code == 2 and given is not None and given is not actor
    assert given.config == actor.config.replace(batch_invariant=True)
    leaves = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (given, actor)]
    assert len(leaves[0]) == len(leaves[1]) and all(map(operator.is_, *leaves))
    capsys.readouterr()
    code, given = _batch_invariant_run(tmp_path, monkeypatch, actor)      # tp 2, the default
    assert code == 2 and given is None
    assert "--batch-invariant with --inference-tp-size=2" in capsys.readouterr().err
    gpt = models.abstract_model(models.GPTConfig.tiny().replace(vocab_size=20))
    code, given = _batch_invariant_run(tmp_path, monkeypatch, gpt, "--inference-tp-size", "1")
    err = capsys.readouterr().err
    assert code == 2 and given is None and "--batch-invariant with a gpt2 actor" in err, err
    assert "llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe" in err, err
