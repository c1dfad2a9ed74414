"""`zeroxla train --data`: the one rule that tells text from SFT examples, and SFT data with no
loss token. References: the records the tests write, counted by hand; the CLI's exit status and
the run directory it must not leave."""

import gzip
import json
import re

import numpy as np
import pytest

from zeroxla.app import cli
from zeroxla.app.chat_data import ChatDataError, SFTExample
from zeroxla.app.jobs.train.data import SFTData, TextData, load_train_data, read_data

RECORDS = [{"prompt": f"Q{i}: ", "response": f"answer {i}."} for i in range(20)]


def load(path, **kwargs):
    return load_train_data(str(path), **{"tokenizer": "char", "init_from": None, "batch_size": 8,
                                         "seq_len": 24, "val_fraction": 0.1, "seed": 0,
                                         **kwargs})


def test_a_json_array_is_read_as_the_sft_examples_it_holds(tmp_path):
    path = tmp_path / "sft.json"
    path.write_text(json.dumps(RECORDS, indent=1))
    examples = read_data(str(path))
    assert [(e.prompt, e.response) for e in examples] == [(r["prompt"], r["response"])
                                                          for r in RECORDS]
    assert all(isinstance(e, SFTExample) and e.path == str(path) for e in examples)
    data = load(path)
    assert isinstance(data, SFTData)
    assert len(data.train["inputs"]) + len(data.val["inputs"]) == len(RECORDS)


def test_sft_records_under_a_text_name_are_refused_not_read_as_text(tmp_path):
    lines = "".join(json.dumps(r) + "\n" for r in RECORDS)
    for name, content in (("sft.txt", lines), ("sft", json.dumps(RECORDS, indent=1)),
                          ("sft.txt.gz", None)):
        path = tmp_path / name
        if content is None:
            path.write_bytes(gzip.compress(lines.encode()))
        else:
            path.write_text(content)
        with pytest.raises(ChatDataError, match=re.escape(f"--data {path} holds JSON records "
                                                          "with a \"prompt\" field")):
            read_data(str(path))
    # JSON without a "prompt" field, or prose, is text.
    other = tmp_path / "log.txt"
    other.write_text('{"event": "start"}\nthen some prose\n')
    assert read_data(str(other)) == '{"event": "start"}\nthen some prose\n'
    assert isinstance(load(other, seq_len=4), TextData)


def write_sft(path, responses):
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: ", "response": r}) + "\n"
                            for i, r in enumerate(responses)))
    return path


def test_sft_data_with_no_loss_token_is_refused_naming_the_file(tmp_path, capsys):
    # The char tokenizer has no EOS token: an empty response leaves a row with nothing to learn.
    path = write_sft(tmp_path / "empty.jsonl", ["", "", ""])
    with pytest.raises(ChatDataError, match=re.escape(
            f"--data {path}: every one of its 3 examples has no loss token (an empty response, "
            "and the tokenizer has no EOS token to learn in its place), so training would learn "
            "nothing")):
        load(path)
    out = tmp_path / "run"
    assert cli.main(["train", "--data", str(path), "--steps", "2", "--batch-size", "8",
                     "--seq-len", "16", "--out", str(out), "--no-progress"]) == 2
    assert f"--data {path}: every one of its 3 examples has no loss token" in capsys.readouterr().err
    assert not out.exists()


def test_rows_with_no_loss_token_are_counted_and_reported(tmp_path):
    responses = ["" if i % 4 == 0 else f"answer {i}." for i in range(40)]    # 10 empty
    data = load(write_sft(tmp_path / "mixed.jsonl", responses))
    assert data.rows_without_loss == 10
    masks = np.concatenate([data.train["loss_mask"], data.val["loss_mask"]])
    assert int(np.sum(masks.sum(axis=1) == 0)) == 10
    assert "10 with no loss token" in data.describe()
    # The end-of-run sample starts from a prompt that has a response (never an empty row's).
    answered = {f"Q{i}: " for i, r in enumerate(responses) if r}
    assert data.tokenizer.decode(data.sample_prompt()) in answered


def test_a_split_with_no_loss_token_is_refused(tmp_path):
    # One non-empty example of 10: the validation split (1 example) draws an empty one.
    responses = [""] * 10
    responses[3] = "yes."
    path = write_sft(tmp_path / "rare.jsonl", responses)
    with pytest.raises(ChatDataError, match=re.escape(
            f"--data {path}: every one of the 1 examples of its validation split has no loss "
            "token") + r".*none of the file's 1 others there\); accepted: .*another --seed"):
        load(path)
