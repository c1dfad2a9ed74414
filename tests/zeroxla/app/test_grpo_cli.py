"""`zeroxla grpo`'s options (zeroxla/app/grpo_cli.py) reach GRPOConfig under TRL's names, and
bad combinations are refused before anything runs, naming the option."""

import pytest

from zeroxla.app import grpo_job
from zeroxla.app.cli import build_parser
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
