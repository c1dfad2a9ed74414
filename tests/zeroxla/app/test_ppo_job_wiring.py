"""What `zeroxla ppo` hands its trainer: the actor of `--actor`'s checkpoint and the reward model
of `--reward`'s, the critic starting from that reward model (DeepSpeed-Chat's step 3).

The runs are written here, tiny and untrained, so the test takes seconds: a GPT-tiny actor and a
reward model whose base and head are drawn with seeds no factory default uses, so that a job
building a fresh reward model, the reward run's initial one or any model but the saved one
hands on other weights. The reference is the models this test saved, read from memory, not
through the job's loading code. The PPO iterations themselves are checked against numpy in
tests/zeroxla/rlhf/test_ppo.py; the whole job, slowly, in test_chat_jobs.py.
"""

import dataclasses
import json
import operator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.app.jobs import loading
from zeroxla import checkpoint, models
from zeroxla.app import data
from zeroxla.app.jobs import ppo as ppo_job
from zeroxla.app.run.job import RunSettings
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.rlhf import PPOConfig, RewardModel, pairwise_loss_terms, without_lm_head
from zeroxla.rlhf.rollout_correction import RolloutCorrection

PPO = PPOConfig(prompts_per_iteration=8, prompt_length=8, answer_length=8)


def flat_params(model):
    """{path: float64 array} of `model`'s parameters."""
    return {"/".join(map(str, path)): np.asarray(v.get_value(), np.float64)
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def save_run(directory, factory, config, metadata, **step_options):
    """Saves `factory()`'s model as a ZeRO-3 checkpoint (step 0) under `directory`, as the job
    that trains it would; returns the model it saved, gathered."""
    step = zeroxla.make_step(factory, zeroxla.make_mesh(nodes=2, local=4),
                             optimizer=optax.sgd(1e-3), config=zeroxla.ZeroConfig(stage=3),
                             **step_options)
    state = step.init(0)
    checkpoint.save(directory, state, layout=step.layout, model_config=config,
                    metadata=metadata)
    return zeroxla.gathered_model(state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(tmp dir, SFT run dir, reward run dir, saved actor, saved reward model)."""
    tmp = tmp_path_factory.mktemp("ppo_wiring")
    tokenizer = data.load_corpus().tokenizer
    config = models.PRESETS["gpt-tiny"][1]().replace(vocab_size=tokenizer.vocab_size)
    record = {"tokenizer": tokenizer_record(tokenizer)}

    def trained_reward_model():          # seeds and a head no default draws
        model = RewardModel(models.GPT(config, rngs=nnx.Rngs(11)))
        head = np.random.default_rng(12).standard_normal(model.v_head[...].shape)
        model.v_head[...] = jnp.asarray(head, jnp.float32)
        return model

    actor = save_run(tmp / "sft" / "checkpoint",
                     lambda: models.GPT(config, rngs=nnx.Rngs(5)), config, record)
    reward = save_run(tmp / "rm" / "checkpoint", trained_reward_model, config,
                      {"model_kind": loading.REWARD_KIND, **record},
                      loss_fn=pairwise_loss_terms, trainable=without_lm_head)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"ROMEO:\nBut soft, what light {c}"})
                               + "\n" for c in "abcdefgh"))
    return tmp, tmp / "sft", tmp / "rm", actor, reward


def test_ppo_job_hands_the_trainer_the_saved_reward_model_and_actor(runs, monkeypatch):
    """The job built (everything loaded, nothing computed: the runner drives the iterations)
    with a recording trainer in place of `PPOTrainer`."""
    tmp, sft_run, rm_run, actor, reward = runs
    handed = {}

    def recording_trainer(config, actor, **kwargs):
        handed.update(kwargs, config=config, actor=actor)
        return object()

    monkeypatch.setattr(ppo_job, "PPOTrainer", recording_trainer)
    out = tmp / "ppo"
    job = ppo_job.PPOJob(ppo_job.PPOJobConfig(
        actor=str(sft_run), reward=str(rm_run), prompts=str(tmp / "prompts.jsonl"), ppo=PPO,
        iterations=2, run=RunSettings(seed=3, out_dir=str(out), progress=False)))
    assert not out.exists()                      # building the job makes no directory
    assert handed["config"] == PPO and job.total == 2 and handed["seed"] == 3
    want_reward, want_actor = flat_params(reward), flat_params(actor)
    assert np.abs(want_reward["v_head"]).max() > 0.1
    for name, model, want in (("reward_model", handed["reward_model"], want_reward),
                              ("critic_init", handed["critic_init"], want_reward),
                              ("actor", handed["actor"], want_actor)):
        got = flat_params(model)
        assert sorted(got) == sorted(want), name
        for path in want:
            np.testing.assert_array_equal(got[path], want[path], err_msg=f"{name}: {path}")
    prompts = [json.loads(line)["prompt"] for line in
               (tmp / "prompts.jsonl").read_text().splitlines()]
    tokenizer = data.load_corpus().tokenizer
    np.testing.assert_array_equal(handed["prompt_tokens"],
                                  [tokenizer.encode(p)[-PPO.prompt_length:] for p in prompts])


def _batch_invariant_run(tmp_path, monkeypatch, actor, *flags):
    """`zeroxla ppo --batch-invariant FLAGS` with `actor` loaded as --actor sft and a stand-in
    reward model of its config, the trainer replaced by a recorder -> (exit code, the actor
    and the critic's start the trainer was given, or None)."""
    from types import SimpleNamespace

    from zeroxla.app.cli import main
    from zeroxla.app.tokenizers.basic import CharTokenizer

    tokenizer = CharTokenizer.from_text("abcdefghij klmnop")
    reward = SimpleNamespace(base=SimpleNamespace(config=actor.config))
    given = []

    def trainer(ppo, policy, **kwargs):
        given.append((ppo, policy, kwargs["critic_init"]))
        raise ValueError("the trainer is not built here")

    monkeypatch.setattr(ppo_job, "load_actor", lambda run: (actor, tokenizer))
    monkeypatch.setattr(ppo_job, "load_reward", lambda run, policy, tok: reward)
    monkeypatch.setattr(ppo_job, "PPOTrainer", trainer)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"abcdefgh {c}"}) + "\n" for c in "klmnop"))
    code = main(["ppo", "--actor", "sft", "--reward", "rm", "--prompts", "prompts.jsonl",
                 "--batch-invariant", "--max-prompt-seq-len", "8", "--max-answer-seq-len", "8",
                 *flags, "--out", str(tmp_path / "run"), "--no-progress"])
    return code, (given[0] if given else None), reward


def test_batch_invariant_reaches_the_actor_and_is_refused_by_option(tmp_path, monkeypatch,
                                                                    capsys):
    """`--batch-invariant` sets PPOConfig.batch_invariant and hands the trainer the actor
    rebuilt with batch_invariant=True holding the loaded actor's very leaves (nothing
    compiled: shapes only); the critic starts from the reward model as given. A GPT actor and
    a tensor-parallel rollout are refused naming the options."""
    actor = models.abstract_model(models.LlamaConfig.tiny().replace(vocab_size=20))
    code, given, reward = _batch_invariant_run(tmp_path, monkeypatch, actor,
                                               "--inference-tp-size", "1")
    assert code == 2 and given is not None
    config, policy, critic_init = given
    assert config.batch_invariant and critic_init is reward
    assert policy is not actor and policy.config == actor.config.replace(batch_invariant=True)
    leaves = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (policy, actor)]
    assert len(leaves[0]) == len(leaves[1]) and all(map(operator.is_, *leaves))
    capsys.readouterr()
    code, given, _ = _batch_invariant_run(tmp_path, monkeypatch, actor)      # tp 2, the default
    assert code == 2 and given is None
    assert "--batch-invariant with --inference-tp-size=2" in capsys.readouterr().err
    gpt = models.abstract_model(models.GPTConfig.tiny().replace(vocab_size=20))
    code, given, _ = _batch_invariant_run(tmp_path, monkeypatch, gpt, "--inference-tp-size", "1")
    err = capsys.readouterr().err
    assert code == 2 and given is None and "--batch-invariant with a gpt2 actor" in err, err


def test_batch_invariant_needs_a_float32_rollout():
    with pytest.raises(ValueError, match="PPOConfig.batch_invariant=True is invalid; accepted: "
                                         "True or False; True with rollout_dtype='float32'"):
        PPOConfig(batch_invariant=True, rollout_dtype="bfloat16")


def resolved(*argv):
    """The job tree `zeroxla ppo ARGV` runs (the command line read, nothing run)."""
    from zeroxla.app.cli import build_parser
    from zeroxla.app.run import command

    args = build_parser().parse_args(["ppo", "--actor", "sft", "--reward", "rm", "--prompts",
                                      "prompts.jsonl", *argv])
    return command.resolve(ppo_job.SPEC, ppo_job.OPTIONS.given(args))[0]


def test_decoupled_options_reach_the_ppo_config():
    """`--rollout-correction decoupled --behav-imp-weight-cap C` (GRPO's options) is the PPO
    config's `rollout_corr = RolloutCorrection.decoupled(C)`; without a cap, uncapped."""
    job = resolved("--mesh", "2x4", "--rollout-devices", "4", "--max-staleness", "1",
                   "--rollout-correction", "decoupled", "--behav-imp-weight-cap", "5")
    assert job.ppo_config == PPOConfig(rollout_devices=4, max_staleness=1,
                                       rollout_corr=RolloutCorrection.decoupled(5.0))
    assert (resolved("--rollout-correction", "decoupled").ppo_config.rollout_corr
            == RolloutCorrection.decoupled(None))
    plain = resolved("--rollout-is", "token")
    assert plain.ppo_config.rollout_corr == RolloutCorrection(is_level="token")


@pytest.mark.parametrize("argv, message", [
    (("--rollout-correction", "decoupled", "--rollout-is", "token"),
     "--rollout-correction decoupled with --rollout-is, --rollout-rs or --rollout-bypass"),
    pytest.param(("--rollout-correction", "decoupled", "--rollout-bypass"),
                 "--rollout-correction decoupled with --rollout-is", marks=pytest.mark.slow),
    (("--behav-imp-weight-cap", "5"), "--behav-imp-weight-cap 5.0 is invalid; accepted: none, "
     "or a number > 1 with --rollout-correction decoupled"),
    pytest.param(("--rollout-correction", "decoupled", "--behav-imp-weight-cap", "1"),
                 "--behav-imp-weight-cap 1.0 is invalid", marks=pytest.mark.slow)])
def test_decoupled_conflicts_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match=message):
        resolved(*argv)


@pytest.mark.slow
def test_tis_is_not_a_ppo_correction(capsys):
    """GRPO's "tis" weights a KL term PPO's loss does not have: argparse names the choices."""
    from zeroxla.app.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["ppo", "--rollout-correction", "tis"])
    assert "invalid choice: 'tis' (choose from 'decoupled')" in capsys.readouterr().err


@pytest.mark.slow
def test_async_decoupled_ppo_job_runs_through_the_runner(runs):
    """`zeroxla ppo --rollout-devices 4 --max-staleness 1 --rollout-correction decoupled` on the
    2 x 4 mesh, 2 iterations in-process: iteration 1 trains on version 0's rollout (staleness
    1), the records say so, and the summary's PPO config is the decoupled objective's."""
    from zeroxla.app.cli import main

    tmp, sft_run, rm_run, _, _ = runs
    out = tmp / "ppo_async"
    code = main(["ppo", "--actor", str(sft_run), "--reward", str(rm_run), "--prompts",
                 str(tmp / "prompts.jsonl"), "--mesh", "2x4", "--rollout-devices", "4",
                 "--max-staleness", "1", "--rollout-correction", "decoupled",
                 "--behav-imp-weight-cap", "5", "--iterations", "2", "--per-iteration-prompts",
                 "8", "--max-prompt-seq-len", "8", "--max-answer-seq-len", "8",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["policy_version"], r["staleness"]) for r in records] == [
        (0, 0, 0), (1, 0, 1)]
    assert all(np.isfinite(r["actor_loss"]) for r in records)
    # the decoupled weights pi_prox / pi_behav are in force: their metrics, 1 at staleness 0
    assert abs(records[0]["rollout_corr/rollout_is_mean"] - 1) < 1e-4, records[0]
    assert records[1]["rollout_corr/rollout_is_max"] > 1.01, records[1]    # version 0 vs 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ppo"]["rollout_corr"] == dataclasses.asdict(RolloutCorrection.decoupled(5.0))
    assert (summary["ppo"]["rollout_devices"], summary["ppo"]["max_staleness"]) == (4, 1)
