"""DeepSpeed-Chat data: JSON-lines readers and their errors, SFT / pair / prompt arrays against
hand-computed ones, the pretrained (HF) tokenizer against transformers' own, generated examples."""

import json
import re
import stat

import numpy as np
import pytest

from zeroxla.app import tiny_checkpoints as hf_checkpoints
from zeroxla.app.chat_data import MAX_EXAMPLE_CHARS, ChatDataError, PairExample, SFTExample, \
    pair_arrays, prompt_arrays, read_pair_jsonl, read_prompt_jsonl, read_sft_jsonl, \
    shakespeare_pairs, shakespeare_prompts, shakespeare_sft, sft_arrays, write_jsonl
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer, save_tokenizer
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.app.tokenizers.records import tokenizer_from_record, tokenizer_record

# ids: $ 0 (our eos), : 1, a 2, b 3, c 4, _ 5 (our pad)
TOK = CharTokenizer("$:abc_")
EOS, PAD = 0, 5


def write_lines(path, *lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- token arrays

def test_sft_arrays_hand_computed():
    examples = [SFTExample("ab:", "ca"),          # seq 2 3 1 | 4 2 0
                SFTExample("a", "bcb"),           # seq 2 | 3 4 3 0
                SFTExample("abca", "bc:")]        # seq 2 3 4 2 | 3 4 1 0: exactly seq_len + 1
    got = sft_arrays(examples, TOK, 7, eos_id=EOS, pad_id=PAD)
    np.testing.assert_array_equal(got["inputs"], [[2, 3, 1, 4, 2, 5, 5],
                                                   [2, 3, 4, 3, 5, 5, 5],
                                                   [2, 3, 4, 2, 3, 4, 1]])
    np.testing.assert_array_equal(got["targets"], [[3, 1, 4, 2, 0, 5, 5],
                                                    [3, 4, 3, 0, 5, 5, 5],
                                                    [3, 4, 2, 3, 4, 1, 0]])
    np.testing.assert_array_equal(got["loss_mask"], [[0, 0, 1, 1, 1, 0, 0],
                                                      [1, 1, 1, 1, 0, 0, 0],
                                                      [0, 0, 0, 1, 1, 1, 1]])
    assert got["inputs"].dtype == got["targets"].dtype == np.int32
    assert got["loss_mask"].dtype == np.float32


def test_sft_arrays_without_eos_pads_with_the_tokenizers_pad_id():
    got = sft_arrays([SFTExample("ab:", "ca")], TOK, 7)        # CharTokenizer: pad 0
    np.testing.assert_array_equal(got["inputs"], [[2, 3, 1, 4, 0, 0, 0]])
    np.testing.assert_array_equal(got["targets"], [[3, 1, 4, 2, 0, 0, 0]])
    np.testing.assert_array_equal(got["loss_mask"], [[0, 0, 1, 1, 0, 0, 0]])


def test_pair_arrays_hand_computed():
    examples = [PairExample("ab", "c", "ca"), PairExample(":", "abcab", "b")]
    got = pair_arrays(examples, TOK, 6, pad_id=PAD)
    np.testing.assert_array_equal(got["chosen"], [[2, 3, 4, 5, 5, 5], [1, 2, 3, 4, 2, 3]])
    np.testing.assert_array_equal(got["rejected"], [[2, 3, 4, 2, 5, 5], [1, 3, 5, 5, 5, 5]])
    np.testing.assert_array_equal(got["chosen_end"], [2, 5])
    np.testing.assert_array_equal(got["rejected_end"], [3, 1])
    with_eos = pair_arrays(examples[:1], TOK, 6, eos_id=EOS, pad_id=PAD)
    np.testing.assert_array_equal(with_eos["chosen"], [[2, 3, 4, 0, 5, 5]])
    np.testing.assert_array_equal(with_eos["rejected_end"], [4])


def test_prompt_arrays_are_left_padded():
    got = prompt_arrays(["ab", "c", "abc"], TOK, 3, pad_id=PAD)
    np.testing.assert_array_equal(got["prompts"], [[5, 2, 3], [5, 5, 4], [2, 3, 4]])
    np.testing.assert_array_equal(got["prompt_mask"], [[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    np.testing.assert_array_equal(got["lengths"], [2, 1, 3])
    with pytest.raises(ValueError, match="prompt_length=0 is invalid; accepted: an integer >= 1"):
        prompt_arrays(["a"], TOK, 0)
    for bad in ("abca", ""):
        with pytest.raises(ChatDataError, match=r"prompt 1 .* accepted: 1 to prompt_length=3"):
            prompt_arrays(["a", bad], TOK, 3)


def test_too_long_examples_name_file_line_and_token_count(tmp_path):
    path = write_lines(tmp_path / "sft.jsonl", json.dumps({"prompt": "ab", "response": "c"}), "",
                       json.dumps({"prompt": "abcab", "response": "cab"}))
    examples = read_sft_jsonl(path)
    sft_arrays(examples[:1], TOK, 3, eos_id=EOS)                # 4 tokens fit seq_len + 1
    message = re.escape(str(path)) + r":3: prompt\+response is 9 tokens .* seq_len=7"
    with pytest.raises(ChatDataError, match=message):
        sft_arrays(examples, TOK, 7, eos_id=EOS)
    with pytest.raises(ChatDataError, match=r"example 0: prompt\+rejected is 4 tokens .* "
                                            r"seq_len=3"):
        pair_arrays([PairExample("ab", "c", "ca")], TOK, 3)


# ----------------------------------------------------------------------------- readers

def test_readers_skip_blank_lines_and_accept_chosen_for_response(tmp_path):
    path = write_lines(tmp_path / "d.jsonl",
                       json.dumps({"prompt": "Q1", "response": "A1", "extra": 1}), "   ",
                       json.dumps({"prompt": "Q2", "chosen": "A2", "rejected": "B2"}))
    sft = read_sft_jsonl(path)
    assert [(e.prompt, e.response, e.line) for e in sft] == [("Q1", "A1", 1), ("Q2", "A2", 3)]
    assert sft[1].path == str(path)
    assert read_prompt_jsonl(path) == ["Q1", "Q2"]
    with pytest.raises(ChatDataError, match=re.escape(str(path)) + r":1: missing field 'chosen'"):
        read_pair_jsonl(path)
    pairs = read_pair_jsonl(write_lines(tmp_path / "p.jsonl", json.dumps(
        {"prompt": "Q", "chosen": "A", "rejected": "B"})))
    assert [(p.prompt, p.chosen, p.rejected, p.line) for p in pairs] == [("Q", "A", "B", 1)]


GOOD = json.dumps({"prompt": "Q", "response": "A"})


@pytest.mark.parametrize("lines, message", [
    ([GOOD, "", '{"prompt": "Q", "response": '], r":3: invalid JSON"),
    ([GOOD, '["Q", "A"]'], r":2: a JSON list; accepted: one JSON object per line"),
    ([GOOD, '{"prompt": "Q", "answer": "A"}'],
     r":2: missing field 'response'; accepted: 'response' or 'chosen' \(found \['answer', "),
    (['{"response": "A"}'], r":1: missing field 'prompt'; accepted: 'prompt'"),
    ([GOOD, '{"prompt": ["Q"], "response": "A"}'], r":2: field 'prompt' is a JSON list; "
                                                    r"accepted: a string"),
    (["", "  "], r": no examples \(the file is empty or blank\)"),
], ids=["bad-json", "not-object", "missing-response", "missing-prompt", "not-string", "empty"])
def test_bad_files_name_file_and_line(tmp_path, lines, message):
    path = write_lines(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(ChatDataError, match=re.escape(str(path)) + message):
        read_sft_jsonl(path)


def test_missing_file_and_bad_bytes(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        read_prompt_jsonl(tmp_path / "nope.jsonl")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ChatDataError, match=re.escape(str(path)) + ":2: not UTF-8"):
        read_prompt_jsonl(path)


# ----------------------------------------------------------------------------- HF tokenizer

TEXTS = ["First Citizen:\nBefore we proceed any further, hear me speak.",
         "  two  spaces,\ttab and Über 😀 ",
         "end of one<|endoftext|>start of the next"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return hf_checkpoints.write_tokenizer(tmp_path_factory.mktemp("tok"))


def test_pretrained_tokenizer_matches_transformers(tok_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = PretrainedTokenizer.from_dir(tok_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert ours.vocab_size == len(theirs) == 512
    assert ours.eos_id == theirs.eos_token_id == 511 == ours.pad_id   # no pad token: eos
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids.dtype == np.int32
        assert ids.tolist() == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids.tolist()) == text
    files = ours.save(tmp_path / "out")
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert reloaded(TEXTS[0])["input_ids"] == ours.encode(TEXTS[0]).tolist()
    assert PretrainedTokenizer.from_dir(tmp_path / "out") == ours      # same files and tokens
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        ours.decode([1, 512])


def test_pretrained_tokenizer_record_round_trips_through_json(tok_dir, tmp_path):
    ours = PretrainedTokenizer.from_dir(tok_dir)
    record = json.loads(json.dumps(tokenizer_record(ours)))
    assert record["kind"] == "hf" and set(record["files"]) == {"tokenizer.json",
                                                               "tokenizer_config.json"}
    back = tokenizer_from_record(record)
    assert back == ours and back.encode(TEXTS[2]).tolist() == ours.encode(TEXTS[2]).tolist()
    files = save_tokenizer(back, tmp_path, model_max_length=64)
    assert [f.read_bytes() for f in files] == [(tok_dir / f.name).read_bytes() for f in files]


def test_special_tokens_map_wins_and_pad_falls_back(tok_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    plain = PretrainedTokenizer.from_dir(bare)
    assert (plain.eos_id, plain.pad_id) == (None, 0)
    (bare / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": "Ġthe"}))
    mapped = PretrainedTokenizer.from_dir(bare)
    assert (mapped.eos_id, mapped.pad_id) == (511, mapped.encode(" the")[0])
    mapped.save(tmp_path / "out")                       # writes a tokenizer_config.json
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (mapped.eos_id, mapped.pad_id)
    (bare / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"eos_token='<\|nope\|>' .* is not in the vocabulary"):
        PretrainedTokenizer.from_dir(bare)


def test_check_vocab_and_missing_tokenizer_file(tok_dir, tmp_path):
    tok = PretrainedTokenizer.from_dir(tok_dir)
    tok.check_vocab(512, "config.json")
    tok.check_vocab(520, "config.json")                 # padded embeddings are fine
    message = (rf"tokenizer in {re.escape(str(tok_dir))} has 512 ids but config.json "
               r"vocab_size=500: the checkpoint and its tokenizer do not match")
    with pytest.raises(ValueError, match=message):
        tok.check_vocab(500, "config.json")
    message = rf"no tokenizer.json in {re.escape(str(tmp_path))}; zeroxla reads HF fast-tokenizer"
    with pytest.raises(FileNotFoundError, match=message):
        PretrainedTokenizer.from_dir(tmp_path)


def test_sft_loss_mask_covers_the_response_under_bpe(tok_dir):
    tok = PretrainedTokenizer.from_dir(tok_dir)
    examples = shakespeare_sft(6, seed=3)
    got = sft_arrays(examples, tok, 128, eos_id=tok.eos_id)
    for row, example in enumerate(examples):
        learned = got["targets"][row][got["loss_mask"][row] == 1]
        assert tok.decode(learned) == example.response + "<|endoftext|>"
        used = len(tok.encode(example.prompt)) + len(tok.encode(example.response))   # + eos
        assert (got["inputs"][row, used:] == tok.pad_id).all()
        assert got["loss_mask"][row, used:].sum() == 0


def test_every_generated_example_fits_the_documented_lengths(tok_dir):
    tok = PretrainedTokenizer.from_dir(tok_dir)
    sft_arrays(shakespeare_sft(538, seed=0), tok, 47, eos_id=tok.eos_id)   # all 538, distinct
    pair_arrays(shakespeare_pairs(538, seed=0), tok, 52, eos_id=tok.eos_id)


def test_checkpoints_have_matching_tokenizers_and_supported_configs(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")        # transformers writes the checkpoints through torch
    from zeroxla.models.hf import from_hf_config

    for build, sharded in ((hf_checkpoints.gpt2_checkpoint, False),
                           (hf_checkpoints.llama_checkpoint, True)):
        path = build(tmp_path / build.__name__, sharded=sharded)
        config = json.loads((path / "config.json").read_text())
        assert from_hf_config(config).vocab_size == 512
        PretrainedTokenizer.from_dir(path).check_vocab(config["vocab_size"], "config.json")
        assert (path / "model.safetensors.index.json").exists() == sharded
        assert len(list(path.glob("*.safetensors"))) > (2 if sharded else 0)


# ----------------------------------------------------------------------------- generated data

def test_generated_examples_are_deterministic_and_short():
    sft = shakespeare_sft(20, seed=1)
    assert sft == shakespeare_sft(20, seed=1) != shakespeare_sft(20, seed=2)
    assert shakespeare_prompts(20, seed=1) == [e.prompt for e in sft]
    assert all(e.response and e.prompt.endswith(":\n") for e in sft)
    assert all(len(e.prompt) + len(e.response) <= MAX_EXAMPLE_CHARS for e in sft)
    pairs = shakespeare_pairs(50, seed=1)
    assert pairs == shakespeare_pairs(50, seed=1)
    for p in pairs:
        assert p.rejected != p.chosen and len(p.rejected) == len(p.chosen)
        assert sorted(p.rejected) == sorted(p.chosen)


def test_write_jsonl_round_trips(tmp_path):
    sft, pairs, prompts = shakespeare_sft(3, 0), shakespeare_pairs(3, 0), shakespeare_prompts(3)
    back = read_sft_jsonl(write_jsonl(sft, tmp_path / "sft.jsonl"))
    assert [(e.prompt, e.response) for e in back] == [(e.prompt, e.response) for e in sft]
    assert [e.line for e in back] == [1, 2, 3]
    back = read_pair_jsonl(write_jsonl(pairs, tmp_path / "pairs.jsonl"))
    assert [(e.prompt, e.chosen, e.rejected) for e in back] == \
        [(e.prompt, e.chosen, e.rejected) for e in pairs]
    assert read_prompt_jsonl(write_jsonl(prompts, tmp_path / "prompts.jsonl")) == prompts
