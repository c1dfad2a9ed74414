"""The TRL-style trainers (zeroxla/app/trainers.py) run the jobs as the command does.

References: `zeroxla train` and `zeroxla grpo` run in-process through the CLI's `main` with the
same settings as command-line options (their trees made by argparse and the option rows, not by
the trainers' args) on a tiny GPT-2 written by transformers: the SFT trainer on a
`datasets.Dataset` equals `zeroxla train` on the same rows as JSON lines, and the GRPO trainer
with a Python reward function equals `zeroxla grpo --reward-funcs module:function`, record for
record, floats exactly (the wall-clock figures aside); `transformers.TrainingArguments`' fields
for the TRL names every job shares.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from job_runs import distinct_chars
from zeroxla.app import chat_data, cli
from zeroxla.app.jobs import dpo as dpo_job
from zeroxla.app.jobs import grpo as grpo_job
from zeroxla.app.jobs import reward as reward_job
from zeroxla.app.jobs.train import cli as train_cli
from zeroxla.app.run import command, rundir
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
from zeroxla.app.trainer_args import RUN_NAMES, TrainerArgs, tree_fields
from zeroxla.app.trainers import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig,
                                  RewardTrainer, SFTConfig, SFTTrainer)

datasets = pytest.importorskip("datasets")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

def untimed(records):
    """`records` without their wall-clock figures (seconds, tokens per second: the keys ending
    in `_s`), which two runs never measure alike."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_rows():
    return [{"prompt": e.prompt, "completion": e.response}
            for e in chat_data.shakespeare_sft(32, seed=0)]


def command_tree(argv):
    """The tree `zeroxla ARGV` runs (its --out left out: that run exists by now): the command
    line read, nothing run."""
    if "--out" in argv:
        at = argv.index("--out")
        argv = argv[:at] + argv[at + 2:]
    args = cli.build_parser().parse_args(argv)
    spec = {"train": train_cli.SPEC, "grpo": grpo_job.SPEC, "dpo": dpo_job.SPEC,
            "reward": reward_job.SPEC}[argv[0]]
    return command.resolve(spec, spec.table.given(args))[0]


def placed(tree, data_field, data, out):
    """`tree` reading `data` (its dotted `data_field`) and writing to `out`."""
    section, _, field = data_field.rpartition(".")
    run = dataclasses.replace(tree.run, out_dir=str(out))
    if not section:
        return dataclasses.replace(tree, run=run, **{field: str(data)})
    inner = dataclasses.replace(getattr(tree, section), **{field: str(data)})
    return dataclasses.replace(tree, run=run, **{section: inner})


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, sft_rows):
    """(`zeroxla train`'s command line and its run on JSON lines, the SFTTrainer on a Dataset
    and its records): three steps of a tiny GPT-2 from its Hugging Face directory."""
    tmp = tmp_path_factory.mktemp("sft")
    base = gpt2_checkpoint(tmp / "gpt2")
    data = tmp / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows), encoding="utf-8")
    cli_run = tmp / "cli"
    argv = ["train", "--init-from", str(base), "--data", str(data), "--steps", "3",
            "--batch-size", "8", "--seq-len", "64", "--lr", "1e-3", "--sample-tokens", "0",
            "--out", str(cli_run), "--no-progress"]
    assert cli.main(argv) == 0
    trainer = SFTTrainer(model=base, train_dataset=datasets.Dataset.from_list(sft_rows),
                         args=SFTConfig(output_dir=str(tmp / "trainer"), max_steps=3,
                                        batch_size=8, max_length=64, learning_rate=1e-3,
                                        sample_tokens=0, progress=False))
    return argv, trainer, trainer.train()


@pytest.mark.slow
def test_sft_trainer_on_a_dataset_equals_zeroxla_train_on_json_lines(sft_runs):
    argv, trainer, records = sft_runs
    expected = metrics(Path(argv[argv.index("--out") + 1]))
    print(f"zeroxla train losses {[r['loss'] for r in expected]}; SFTTrainer's "
          f"{[r['loss'] for r in records]}")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [list(r) for r in records] == [list(r) for r in expected]
    assert untimed(records) == untimed(expected)
    assert records == metrics(trainer.run_dir)
    # The command's tree but where the trainer's data and run directory are.
    data = trainer.run_dir / "train_dataset.parquet"
    assert data.is_file()
    assert trainer.tree == placed(command_tree(argv), "data.path", data, trainer.run_dir)


@pytest.mark.slow
def test_grpo_trainer_equals_zeroxla_grpo_record_for_record(sft_runs, tmp_path):
    """A Python reward function given as a callable is the command's `module:function`."""
    argv = sft_runs[0]
    actor = argv[argv.index("--out") + 1]
    rows = [{"prompt": p} for p in chat_data.shakespeare_prompts(8, seed=2)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    argv = ["grpo", "--actor", actor, "--prompts", str(prompts), "--reward-funcs",
            "job_runs:distinct_chars", "--iterations", "2", "--num-generations", "2",
            "--per-iteration-prompts", "4", "--max-prompt-seq-len", "8",
            "--max-completion-length", "6", "--learning-rate", "1e-2",
            "--out", str(tmp_path / "cli"), "--no-progress"]
    assert cli.main(argv) == 0
    trainer = GRPOTrainer(model=actor, reward_funcs=[distinct_chars],
                          train_dataset=datasets.Dataset.from_list(rows),
                          args=GRPOConfig(output_dir=str(tmp_path / "trainer"), max_steps=2,
                                          num_generations=2, prompts_per_iteration=4,
                                          prompt_length=8, max_completion_length=6,
                                          learning_rate=1e-2, progress=False))
    records = trainer.train()
    expected = metrics(tmp_path / "cli")
    print(f"zeroxla grpo rewards {[r['reward'] for r in expected]}; GRPOTrainer's "
          f"{[r['reward'] for r in records]}")
    assert [r["iteration"] for r in records] == [0, 1]
    assert [list(r) for r in records] == [list(r) for r in expected]
    assert untimed(records) == untimed(expected)
    assert trainer.tree.reward_funcs == ("job_runs:distinct_chars",)
    assert trainer.tree == placed(command_tree(argv), "prompts",
                                  trainer.run_dir / "train_dataset.parquet", trainer.run_dir)


@pytest.mark.parametrize("trainer, args, argv", [
    (DPOTrainer, DPOConfig(max_steps=3, beta=0.2, max_length=96, loss_type="ipo",
                           mesh=(1, 8), eval_steps=2, seed=3),
     ["dpo", "--steps", "3", "--beta", "0.2", "--seq-len", "96", "--loss-type", "ipo",
      "--mesh", "1x8", "--eval-every", "2", "--seed", "3"]),
    (RewardTrainer, RewardConfig(max_steps=4, learning_rate=1e-4, max_length=32,
                                 save_total_limit=2, save_steps=2, report_to="tensorboard"),
     ["reward", "--steps", "4", "--learning-rate", "1e-4", "--seq-len", "32", "--keep-last",
      "2", "--save-every", "2", "--report-to", "tensorboard"]),
], ids=["dpo", "reward"])
def test_dpo_and_reward_trainers_make_the_commands_tree(trainer, args, argv):
    """The pairs as a path, as the command's --data takes it (nothing run)."""
    made = trainer(model="base", args=args, train_dataset="pairs.jsonl")
    expected = command_tree([*argv, "--init-from", "base", "--data", "pairs.jsonl"])
    assert made.tree == placed(expected, "data", "pairs.jsonl", made.run_dir)
    assert made.run_dir.name.startswith(f"{argv[0]}-")


ARGS = (SFTConfig, RewardConfig, DPOConfig, GRPOConfig)


@pytest.mark.parametrize("args", ARGS, ids=lambda a: a.__name__)
def test_every_trl_name_maps_to_a_field_of_the_tree(args):
    fields = tree_fields(args.TREE)
    for name, path in args.trl_names().items():
        assert path in fields, (name, path)
        assert args.path(name) == path
    shared = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(RUN_NAMES) | {"max_steps", "learning_rate", "max_grad_norm"} <= shared


def test_settings_become_the_tree_the_options_make():
    """TRL's names, a section's field, a dotted path and a whole section, over the defaults."""
    from zeroxla.rlhf import GRPOConfig as Algorithm

    expected = command_tree([
        "grpo", "--actor", "runs/sft", "--iterations", "3", "--num-generations", "4",
        "--beta", "0.04", "--mesh", "1x8", "--save-every", "2", "--report-to", "tensorboard"])
    given = GRPOConfig(max_steps=3, num_generations=4, **{"grpo.beta": 0.04}, mesh=[1, 8],
                       save_steps=2, report_to=["tensorboard"])
    assert given.tree(actor="runs/sft") == expected
    # The tree's own field before a section's: the job caps prompts at `prompt_length`.
    assert GRPOConfig.path("prompt_length") == "prompt_length"
    whole = GRPOConfig(grpo=Algorithm(num_generations=4, beta=0.04), beta=0.1)
    assert whole.tree(actor="a").grpo == Algorithm(num_generations=4, beta=0.1)


@pytest.mark.parametrize("make, kind, message", [
    (lambda: GRPOConfig(max_steps=0).tree(actor="a"), ValueError,
     r"GRPOConfig\(max_steps=0\): GRPOJobConfig.iterations=0 is invalid; accepted: an integer"),
    (lambda: GRPOConfig(beta=-1).tree(actor="a"), ValueError,
     r"GRPOConfig\(beta=-1\): GRPOConfig.beta=-1 is invalid"),
    (lambda: SFTConfig(learning_rate=0).tree(), ValueError,
     r"SFTConfig\(learning_rate=0\): TrainJobConfig.schedule.lr=0 is invalid"),
    (lambda: DPOConfig(bogus=1), ValueError, r"DPOConfig\(bogus=...\): unknown setting 'bogus'; "
     r"accepted: TRL's names .*max_length.*, or a field of DPOJobConfig: "),
    (lambda: GRPOConfig(**{"grpo.nope": 1}), ValueError,
     r"GRPOConfig\(grpo.nope=...\): unknown setting 'grpo.nope'"),
    (lambda: GRPOConfig(max_steps=2, iterations=3), ValueError,
     "max_steps and iterations both set GRPOJobConfig.iterations"),
    (lambda: RewardConfig(init_from="x"), ValueError,
     r"RewardConfig\(init_from=...\) sets RewardJobConfig.init_from, which the trainer's model"),
    (lambda: SFTConfig(report_to="all"), ValueError,
     r"SFTConfig\(report_to='all'\): --report-to all is invalid; accepted: none, or"),
    (lambda: DPOTrainer(model="m", args=GRPOConfig()), TypeError,
     r"DPOTrainer\(args=GRPOConfig\(\)\) is invalid; accepted: a DPOConfig"),
    (lambda: RewardTrainer(model=None), TypeError, r"RewardTrainer\(model=None\) is invalid"),
    (lambda: SFTTrainer(train_dataset=7), TypeError,
     r"SFTTrainer\(train_dataset=int\) is invalid; accepted: a datasets.Dataset, a list"),
    (lambda: SFTTrainer(train_dataset=datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"text": "a"}])})), TypeError,
     r"train_dataset=DatasetDict with splits train\) is invalid; accepted: one split, e.g. "
     r"train_dataset=ds\['train'\]"),
    (lambda: SFTTrainer(train_dataset=[{"text": "a"}, "b"]), TypeError,
     r"train_dataset\[1\] is a str; accepted: a dict of columns per row"),
    (lambda: SFTTrainer(train_dataset=[{"text": {1, 2}}]), TypeError,
     r"train_dataset\[0\]: Object of type set is not JSON serializable; accepted: JSON values"),
    (lambda: GRPOTrainer(model="m", reward_funcs=[distinct_chars, 3]), TypeError,
     r"reward_funcs\[1\]=3 is invalid; accepted: a callable"),
    (lambda: GRPOTrainer(model="m", reward_funcs="nowhere"), ValueError,
     "--reward-funcs 'nowhere' is invalid"),
], ids=["max_steps", "beta", "learning_rate", "unknown", "dotted", "twice", "supplied",
        "report_to", "args", "model", "dataset", "dataset_dict", "row", "row_value", "reward_funcs",
        "reward_name"])
def test_bad_args_are_refused_naming_the_field(make, kind, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kind, match=message):
        make()
    assert not (tmp_path / "runs").exists()


def test_a_job_that_fails_to_start_leaves_its_dataset_file_alone(tmp_path):
    """Rows without the job's columns are refused, naming the file, when the job reads them;
    the run directory then holds the dataset file alone, which is no run, so the same
    output_dir is accepted again (run directories are the runner's: it made nothing yet)."""
    out = tmp_path / "run"
    trainer = SFTTrainer(train_dataset=[{"question": "a"}] * 4,
                         args=SFTConfig(output_dir=str(out), max_steps=1, progress=False))
    with pytest.raises(ValueError, match="train_dataset.jsonl"):
        trainer.train()
    assert sorted(p.name for p in out.iterdir()) == ["train_dataset.jsonl"]
    rundir.check_out_dir(out)


def test_a_trainer_args_repr_is_what_was_given():
    assert repr(GRPOConfig(max_steps=3, mesh=[1, 8])) == "GRPOConfig(max_steps=3, mesh=(1, 8))"
    assert GRPOConfig(max_steps=3) == GRPOConfig(iterations=3)
    assert isinstance(SFTConfig(), TrainerArgs)
