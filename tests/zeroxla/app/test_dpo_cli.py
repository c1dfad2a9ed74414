"""`zeroxla dpo` refuses bad input before any compute: exit 2, one line naming the option, its
value and what is accepted, and no run directory. The pretrained base is a config.json and
tokenizer with no weights: every refusal comes before the weights would be read."""

import dataclasses
import json

import numpy as np
import pytest

from weightless import weightless_gpt2
from zeroxla.app import chat_data, cli
from zeroxla.app.jobs import dpo as dpo_job
from zeroxla.app.run.job import RunSettings, ShardingSettings
from zeroxla.app.tiny_checkpoints import MAX_POSITIONS
from zeroxla.rlhf.dpo.losses import DPOConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return weightless_gpt2(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    same = [chat_data.PairExample("p", "same", "same")] * 20
    broken = tmp / "broken.jsonl"
    broken.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a"}\n')
    return {"SAME": chat_data.write_jsonl(same, tmp / "same.jsonl"), "BROKEN": broken}


@pytest.mark.parametrize("argv, message", [
    ([], "--init-from is required"),
    (["--init-from", "BASE", "--batch-size", "12"],
     "--batch-size 12 is not a multiple of the 8 data-parallel devices of --mesh 2x4"),
    (["--init-from", "BASE", "--seq-len", "4096"],
     f"--seq-len 4096 exceeds the max_seq_len={MAX_POSITIONS} of --init-from"),
    (["--init-from", "NOWHERE"], "--init-from NOWHERE is neither; accepted: a Hugging Face"),
    (["--init-from", "BASE", "--data", "SAME"],
     "every one of its 20 examples has the same tokens for \"chosen\" and \"rejected\""),
    (["--init-from", "BASE", "--data", "BROKEN"], "broken.jsonl:2: missing field 'chosen'"),
    (["--init-from", "BASE", "--resume", "NOWHERE"], "--resume NOWHERE: no such directory"),
    (["--resume", "BASE"], "holds no checkpoints"),
], ids=["no-init", "batch", "seq-len", "init-from", "no-preference", "file-line", "resume",
        "resume-no-checkpoint"])
def test_refused_before_any_compute(argv, message, base, files, tmp_path, capsys):
    swap = {"BASE": str(base), **{k: str(v) for k, v in files.items()}}
    argv = [swap.get(a, a) for a in argv]
    out = tmp_path / "run"
    if "--resume" in argv:        # a resumed run writes into its own directory, from its model
        if "--init-from" in argv:
            at = argv.index("--init-from")
            del argv[at:at + 2]
    else:
        argv += ["--out", str(out)]
    assert cli.main(["dpo", *argv, "--no-progress"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert message in err, err


def test_a_pair_too_long_is_named_by_its_line_in_the_file(base, tmp_path, capsys):
    """The job shuffles the pairs into its splits before tokenizing them: the refusal names
    the pair's line in the file, and no index of the shuffled order beside it."""
    pairs = chat_data.shakespeare_pairs(20, seed=1)
    pairs[12] = chat_data.PairExample(pairs[12].prompt, "so long " * 40, pairs[12].rejected)
    data = chat_data.write_jsonl(pairs, tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    assert cli.main(["dpo", "--init-from", str(base), "--data", str(data), "--out", str(out),
                     "--no-progress"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert f"{data}:13: prompt+chosen is " in err and "(example" not in err, err


def test_pairs_without_preference_are_kept_and_counted_as_reward_does(base, files, tmp_path):
    """Pairs whose chosen and rejected are the same text (so the same tokens) stay in the
    splits and are counted, by `zeroxla reward`'s rule: the same count as its `_pairs`, and
    the same refusal when they are all of the file."""
    from zeroxla.app.jobs import reward as reward_job
    from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer

    pairs = chat_data.shakespeare_pairs(20, seed=1)
    for i in (3, 7, 11):
        pairs[i] = chat_data.PairExample(pairs[i].prompt, pairs[i].chosen, pairs[i].chosen)
    data = str(chat_data.write_jsonl(pairs, tmp_path / "pairs.jsonl"))
    tokenizer = PretrainedTokenizer.from_dir(base)
    job = dpo_job.DPOJobConfig(init_from=str(base), data=data, dpo=DPOConfig(batch_size=8))
    train, val, same = dpo_job.pair_rows(job, tokenizer)
    assert same == 3
    assert len(train["chosen"]) + len(val["chosen"]) == 20                 # kept, not skipped
    identical = sum(int(np.all(rows["chosen"] == rows["rejected"], axis=1).sum())
                    for rows in (train, val))
    assert identical == 3
    reward = reward_job.RewardJobConfig(init_from=str(base), data=data, batch_size=8)
    assert reward_job.pair_rows(reward, tokenizer)[2] == same
    refusals = []
    for run in (lambda: dpo_job.pair_rows(dataclasses.replace(job, data=str(files["SAME"])),
                                          tokenizer),
                lambda: reward_job.pair_rows(dataclasses.replace(reward, data=str(files["SAME"])),
                                             tokenizer)):
        with pytest.raises(chat_data.ChatDataError) as refused:
            run()
        refusals.append(str(refused.value))
    for message in refusals:
        assert message.startswith(f"--data {files['SAME']}: every one of its 20 examples has "
                                  "the same tokens for \"chosen\" and \"rejected\" (")
        assert message.endswith("training would learn nothing; accepted: pairs whose "
                                "\"chosen\" and \"rejected\" differ"), message


@pytest.mark.parametrize("owner, field, value", [
    (dpo_job.DPOJobConfig, "steps", 0), (ShardingSettings, "stage", 4),
    (dpo_job.DPOJobConfig, "val_fraction", 1.0), (RunSettings, "save_every", -1),
    (ShardingSettings, "mesh", (2,))])
def test_job_config_refuses_bad_values_by_name(owner, field, value):
    with pytest.raises(ValueError, match=rf"{owner.__name__}\.{field}="):
        if owner is dpo_job.DPOJobConfig:
            dpo_job.DPOJobConfig(init_from="x", dpo=DPOConfig(batch_size=8), **{field: value})
        else:
            owner(**{field: value})


def test_conversational_pairs_are_summed_after_their_shared_prefix(tmp_path):
    """TRL's conversational pairs (lists of messages, rendered by the checkpoint's chat
    template) through `pair_rows`: each row's summed tokens are transformers' assistant tokens
    of its conversation (`assistant_masks`), then the rest of the rendered turn to the row's
    end. The two answers differ at their first token, so a sum that starts one token early
    or late is caught (a shared first token would cancel in every DPO quantity)."""
    from chat_checkpoints import write_chat_tokenizer
    from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer

    transformers = pytest.importorskip("transformers")
    directory = write_chat_tokenizer(tmp_path / "chat")
    answers = {"chosen": "The king.", "rejected": "Gone, my lord."}
    prompts = [[{"role": "user", "content": f"Who speaks {i}?"}] for i in range(10)]
    rows = [{"prompt": prompt, **{key: [{"role": "assistant", "content": answer}]
                                  for key, answer in answers.items()}} for prompt in prompts]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    reference = {key: [hf.apply_chat_template(prompt + [{"role": "assistant", "content": answer}],
                                              return_dict=True, return_assistant_tokens_mask=True)
                       for prompt in prompts] for key, answer in answers.items()}
    tokenizer = PretrainedTokenizer.from_dir(directory)
    job = dpo_job.DPOJobConfig(init_from="x", data=str(data), dpo=DPOConfig(batch_size=8),
                               val_fraction=0.2)
    train, _, _ = dpo_job.pair_rows(job, tokenizer)
    for b in range(len(train["chosen"])):
        first_tokens = []
        for key in ("chosen", "rejected"):
            row = train[key][b]
            match = [out for out in reference[key]
                     if np.array_equal(row[:len(out["input_ids"])], out["input_ids"])]
            assert len(match) == 1
            ids, assistant = match[0]["input_ids"], np.asarray(match[0]["assistant_masks"], bool)
            start = int(np.argmax(assistant))                 # the answer's first token
            assert assistant.any()
            first_tokens.append(ids[start])
            summed = np.flatnonzero(train[f"{key}_mask"][b]) + 1     # target positions
            np.testing.assert_array_equal(summed, np.arange(start, len(ids)))
            assert tokenizer.decode(row[summed]).startswith(answers[key] + "<|im_end|>")
        assert first_tokens[0] != first_tokens[1]          # the fixture's point
