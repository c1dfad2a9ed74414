"""`zeroxla reward` and `zeroxla ppo` (and `train`) refuse bad input before any compute: exit 2,
one line naming the option, its value and what is accepted, and no run directory.

The pretrained base here is a config.json and tokenizer with no weights: every refusal tested
comes before the weights would be read, which is part of what is checked."""

import json
import re
import types

import pytest

from weightless import weightless_gpt2
from zeroxla.app import chat_data, cli
from zeroxla.app.jobs import loading
from zeroxla.app.jobs import ppo as ppo_job
from zeroxla.app.jobs import reward as reward_job
from zeroxla.app.run.job import ShardingSettings
from zeroxla.rlhf import PPOConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A Hugging Face directory with config.json and the tokenizer, and no weights."""
    return weightless_gpt2(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return chat_data.write_jsonl(chat_data.shakespeare_pairs(40, seed=1),
                                 tmp_path_factory.mktemp("data") / "pairs.jsonl")


def refused(argv, capsys, out):
    """The command's stderr, after checking it exits 2 and leaves no `out`."""
    assert cli.main([*argv, "--out", str(out), "--no-progress"]) == 2
    assert not out.exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("command, message", [
    (["reward", "--init-from", "BASE", "--data", "PAIRS"],
     "--batch-size 16 is not a multiple of the 3 data-parallel devices of --mesh 3x1; use 15"),
    (["ppo", "--actor", "a", "--reward", "r", "--prompts", "PAIRS"],
     "--per-iteration-prompts 32 is not a multiple of the 3 data-parallel devices of --mesh 3x1; "
     "use 30"),
    (["train", "--steps", "1"],
     "--batch-size 32 is not a multiple of the 3 data-parallel devices of --mesh 3x1; use 30"),
], ids=["reward", "ppo", "train"])
def test_a_mesh_that_does_not_divide_the_batch_is_refused(command, message, base, pairs, capsys,
                                                           tmp_path):
    argv = [{"BASE": str(base), "PAIRS": str(pairs)}.get(a, a) for a in command]
    err = refused([*argv, "--mesh", "3x1"], capsys, tmp_path / "run")
    assert message in err and "Traceback" not in err


def test_a_mesh_larger_than_the_devices_is_refused_naming_it(base, pairs, capsys, tmp_path):
    for argv in (["reward", "--init-from", str(base), "--data", str(pairs)],
                 ["ppo", "--actor", "a", "--reward", "r", "--prompts", str(pairs)]):
        err = refused([*argv, "--mesh", "4x4"], capsys, tmp_path / "run")
        assert "--mesh has 16 devices but only 8 are available; accepted: a --mesh NODESxLOCAL " \
               "with NODES x LOCAL <= 8" in err


def test_pairs_with_nothing_to_prefer_are_refused_naming_the_file(base, capsys, tmp_path):
    same = chat_data.write_jsonl([chat_data.PairExample(f"Q{i}: ", "yes.", "yes.")
                                  for i in range(20)], tmp_path / "same.jsonl")
    err = refused(["reward", "--init-from", str(base), "--data", str(same), "--batch-size", "8"],
                  capsys, tmp_path / "rm")
    assert (f"--data {same}: every one of its 20 examples has the same tokens for \"chosen\" and "
            "\"rejected\"") in err


def test_a_json_array_of_pairs_is_read_as_the_pairs_it_holds(base, tmp_path):
    examples = chat_data.shakespeare_pairs(20, seed=3)
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
                                for p in examples], indent=2))
    got = chat_data.read_pair_jsonl(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in got] == [
        (p.prompt, p.chosen, p.rejected) for p in examples]


def test_a_prompts_file_of_other_keys_or_none_names_the_file(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "hello"}\n{"text": "world"}\n')
    with pytest.raises(chat_data.ChatDataError, match=re.escape(
            f"{other}:1: missing field 'prompt'; accepted: 'prompt' (found ['text'])")):
        chat_data.read_prompt_jsonl(other)
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    with pytest.raises(chat_data.ChatDataError, match=re.escape(
            f"{empty}: no examples (the file is empty or blank)")):
        chat_data.read_prompt_jsonl(empty)


def test_an_out_that_holds_a_run_is_refused_without_offering_resume(base, pairs, capsys,
                                                                    tmp_path):
    old = tmp_path / "rm"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 0}\n')
    assert cli.main(["reward", "--init-from", str(base), "--data", str(pairs), "--batch-size",
                     "8", "--out", str(old), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {old} already holds a run (metrics.jsonl)" in err
    assert "--resume" not in err and f"--out {old}-2" in err
    assert sorted(p.name for p in old.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("argv, message", [
    (["ppo", "--kl-ctl", "-1"], "argument --kl-ctl: '-1' is invalid; accepted: a finite number >= 0"),
    (["ppo", "--gamma", "2"], "argument --gamma: '2' is invalid; accepted: a number in [0, 1]"),
    (["ppo", "--cliprange", "0"], "argument --cliprange: '0' is invalid; accepted: a finite "
                                  "positive number"),
    (["reward", "--weight-decay", "nan"], "argument --weight-decay: 'nan' is invalid; accepted: "
                                          "a finite number >= 0"),
    (["ppo", "--mesh", "2x4x1"], "argument --mesh: --mesh '2x4x1' is invalid; accepted: "
                                 "NODESxLOCAL"),
], ids=["kl-ctl", "gamma", "cliprange", "weight-decay", "mesh-form"])
def test_bad_hyper_parameters_name_their_option(argv, message, capsys):
    required = {"ppo": ["--actor", "a", "--reward", "r", "--prompts", "p"],
                "reward": ["--init-from", "b", "--data", "d"]}[argv[0]]
    with pytest.raises(SystemExit) as exit_:
        cli.main([argv[0], *required, *argv[1:]])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_actor_and_reward_runs_are_checked_by_name(base, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"--actor {tmp_path / 'none'}: no such "
                                                   "directory; accepted: a `zeroxla train` run")):
        loading.load_actor(tmp_path / "none")
    # A Hugging Face directory is step 1's input, not its output.
    with pytest.raises(ValueError, match=re.escape(f"--actor {base} holds no complete zeroxla "
                                                   "checkpoint; accepted: a `zeroxla train` run "
                                                   "directory (step 1, SFT: zeroxla train "
                                                   "--init-from HF_DIR --data sft.jsonl)")):
        loading.load_actor(base)


def test_inference_tp_must_divide_the_devices_and_the_heads():
    gpt = types.SimpleNamespace(num_heads=4)
    llama = types.SimpleNamespace(num_heads=6, num_kv_heads=2)
    loading.check_inference_tp(2, (2, 4), gpt, "--actor a")
    loading.check_inference_tp(2, (2, 4), llama, "--actor b")
    with pytest.raises(ValueError, match=re.escape(
            "--inference-tp-size 2 does not fit the 3 devices of --mesh 3x1 and the 4 attention "
            "heads of --actor a; accepted: 1")):
        loading.check_inference_tp(2, (3, 1), gpt, "--actor a")
    with pytest.raises(ValueError, match=r"--inference-tp-size 3 .* 8 devices .*; accepted: 1, 2, 4$"):
        loading.check_inference_tp(3, (2, 4), gpt, "--actor a")
    # 6 heads: 4 does not divide them although it divides the 8 devices.
    with pytest.raises(ValueError, match=r"the 6 attention heads \(2 KV heads\) of --actor b; "
                                         r"accepted: 1, 2$"):
        loading.check_inference_tp(4, (2, 4), llama, "--actor b")


def test_job_configs_check_the_batch_against_the_mesh():
    with pytest.raises(ValueError, match=r"--batch-size 16 .* --mesh 2x3; use 12"):
        reward_job.RewardJobConfig(init_from="b", data="d", sharding=ShardingSettings((2, 3)))
    with pytest.raises(ValueError, match=r"--per-iteration-prompts 12 .* --mesh 1x8; use 8"):
        ppo_job.PPOJobConfig(actor="a", reward="r", prompts="p",
                             ppo=PPOConfig(prompts_per_iteration=12),
                             sharding=ShardingSettings((1, 8)))
    with pytest.raises(ValueError, match=r"PPOJobConfig.inference_tp_size=0 is invalid"):
        ppo_job.PPOJobConfig(actor="a", reward="r", prompts="p", inference_tp_size=0)
