"""`zeroxla dpo` refuses bad input before any compute: exit 2, one line naming the option, its
value and what is accepted, and no run directory. The pretrained base is a config.json and
tokenizer with no weights: every refusal comes before the weights would be read."""

import json

import numpy as np
import pytest

from weightless import weightless_gpt2
from zeroxla.app import chat_data, cli, dpo_job
from zeroxla.app.tiny_checkpoints import MAX_POSITIONS
from zeroxla.rlhf.dpo import DPOConfig


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
    (["--resume", "NOWHERE", "--out", "elsewhere"], "--out cannot change them"),
], ids=["no-init", "batch", "seq-len", "init-from", "no-preference", "file-line", "resume",
        "resume-out"])
def test_refused_before_any_compute(argv, message, base, files, tmp_path, capsys):
    swap = {"BASE": str(base), **{k: str(v) for k, v in files.items()}}
    argv = [swap.get(a, a) for a in argv]
    out = tmp_path / "run"
    if "--resume" in argv:                 # a resumed run writes into its own directory
        argv = [a for a in argv if a not in ("--init-from", str(base))]
    else:
        argv += ["--out", str(out)]
    assert cli.main(["dpo", *argv, "--no-progress"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize("field, value", [("steps", 0), ("zero_stage", 4), ("val_fraction", 1.0),
                                          ("save_every", -1), ("mesh", (2,))])
def test_job_config_refuses_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=rf"DPOJobConfig\.{field}="):
        dpo_job.DPOJobConfig(init_from="x", dpo=DPOConfig(batch_size=8), **{field: value})


def test_conversational_pairs_are_summed_after_their_shared_prefix(tmp_path):
    """TRL's conversational pairs (lists of messages, rendered by the checkpoint's chat
    template) through `pair_rows`: each row's summed tokens start where chosen and rejected
    first differ, after the whole rendered prompt (and the first token both answers share),
    and run on to the row's end-of-turn token."""
    from chat_checkpoints import write_chat_tokenizer
    from zeroxla.app.hf_tokenizer import PretrainedTokenizer

    directory = write_chat_tokenizer(tmp_path / "chat")
    rows = [{"prompt": [{"role": "user", "content": f"Who speaks {i}?"}],
             "chosen": [{"role": "assistant", "content": "The king."}],
             "rejected": [{"role": "assistant", "content": "Teh gink."}]} for i in range(10)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = PretrainedTokenizer.from_dir(directory)
    job = dpo_job.DPOJobConfig(init_from="x", data=str(data), dpo=DPOConfig(batch_size=8),
                               val_fraction=0.2)
    train, _ = dpo_job.pair_rows(job, tokenizer)
    for b in range(len(train["chosen"])):
        chosen, rejected = train["chosen"][b], train["rejected"][b]
        first = int(np.argmax(chosen != rejected))
        # The whole prompt, and here the answers' shared first token "T", come first.
        assert tokenizer.decode(chosen[:first]).endswith("<|im_start|>assistant\nT")
        for key, row in (("chosen", chosen), ("rejected", rejected)):
            summed = np.flatnonzero(train[f"{key}_mask"][b]) + 1     # target positions
            assert summed[0] == first and np.all(np.diff(summed) == 1)
            assert "<|im_end|>" in tokenizer.decode(row[summed])
