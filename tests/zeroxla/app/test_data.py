"""Data pipeline: corpus, tokenizers, splits, deterministic batches, placement on the mesh; JSON
data files (JSON lines and JSON arrays, optionally gzipped, give the same records, each with the
line it starts on; every bad file is a ChatDataError naming file:line)."""

import gzip
import json
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.app import data
from zeroxla.app.chat_data import read_pair_jsonl, read_prompt_jsonl, read_sft_jsonl
from zeroxla.app.data import BatchPlan, device_batch, host_batch, load_corpus, load_text, split_tokens
from zeroxla.app.data import ChatDataError, json_suffix, read_records
from zeroxla.sharding.mesh import DATA_AXES, LOCAL_AXIS, NODE_AXIS, make_mesh
from zeroxla.app.tokenizers.basic import ByteTokenizer, CharTokenizer, make_tokenizer


@pytest.fixture(scope="module")
def shakespeare():
    return load_text()


# ---- corpus ------------------------------------------------------------------------------------

def test_bundled_corpus_is_tiny_shakespeare(shakespeare):
    assert len(shakespeare) == 1_115_394
    assert len(set(shakespeare)) == 65
    assert shakespeare.startswith("First Citizen:")


def test_load_text_reads_plain_and_gzipped_files(tmp_path):
    text = "héllo\nwörld\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    assert load_text(tmp_path / "a.txt") == text
    assert load_text(str(tmp_path / "a.txt.gz")) == text


def test_load_text_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text(tmp_path / "nope.txt")
    (tmp_path / "bin.txt").write_bytes(b"ok\xff\xfe")
    with pytest.raises(ValueError, match="bin.txt.*not UTF-8"):
        load_text(tmp_path / "bin.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_text(tmp_path / "empty.txt")


def test_split_is_contiguous_with_the_tail_held_out():
    tokens = np.arange(1000, dtype=np.int32)
    train, val = split_tokens(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
    with pytest.raises(ValueError, match="val_fraction=1.5.*accepted"):
        split_tokens(tokens, 1.5)


def test_load_corpus_char_and_byte(tmp_path):
    corpus = load_corpus(None)
    assert corpus.vocab_size == 65                # = GPTConfig.tiny().vocab_size
    assert len(corpus.train) + len(corpus.val) == 1_115_394
    path = tmp_path / "t.txt"
    path.write_text("ab€" * 50, encoding="utf-8")
    by_byte = load_corpus(path, tokenizer="byte", val_fraction=0.2)
    assert by_byte.vocab_size == 256
    assert len(by_byte.train) + len(by_byte.val) == len(("ab€" * 50).encode("utf-8"))


# ---- tokenizers --------------------------------------------------------------------------------

def test_char_tokenizer_round_trips_the_corpus(shakespeare):
    tok = CharTokenizer.from_text(shakespeare)
    ids = tok.encode(shakespeare)
    assert ids.dtype == np.int32 and ids.min() == 0 and ids.max() == 64
    assert tok.decode(ids) == shakespeare


def test_char_tokenizer_vocabulary_is_sorted_and_unknown_chars_are_named():
    tok = CharTokenizer.from_text("banana!")
    assert tok.chars == "!abn"
    np.testing.assert_array_equal(tok.encode("nab"), [3, 1, 2])
    with pytest.raises(ValueError, match="'z' is not in the tokenizer's vocabulary"):
        tok.encode("zebra")
    with pytest.raises(ValueError, match="token id 4 is outside"):
        tok.decode([4])
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aa")


@pytest.mark.parametrize("text", ["", "plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🚀✨\n\t"])
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_decodes_invalid_utf8_with_replacement():
    assert ByteTokenizer().decode([104, 0xFF, 105]) == "h\ufffdi"


def test_make_tokenizer_names_the_accepted_kinds():
    with pytest.raises(ValueError, match="tokenizer='bpe'.*char, byte"):
        make_tokenizer("bpe", "x")


# ---- batches -----------------------------------------------------------------------------------

TOKENS = np.random.default_rng(0).integers(0, 65, size=10_001).astype(np.int32)


def test_same_seed_same_batches_different_seed_different_batches():
    a, b, c = (BatchPlan(len(TOKENS), 16, 32, seed=s) for s in (7, 7, 8))
    for step in (0, 1, 50):
        np.testing.assert_array_equal(host_batch(TOKENS, a, step)["inputs"],
                                      host_batch(TOKENS, b, step)["inputs"])
    assert not np.array_equal(host_batch(TOKENS, a, 0)["inputs"],
                              host_batch(TOKENS, c, 0)["inputs"])
    assert not np.array_equal(a.windows(0), a.windows(1))


def test_each_epoch_visits_every_window_once():
    plan = BatchPlan(len(TOKENS), 10, 32, seed=3)           # 312 windows: epochs end mid-batch
    n = plan.num_windows
    seen = np.concatenate([plan.windows(k) for k in range(3 * n // 10 + 1)])
    for epoch in range(3):
        assert sorted(seen[epoch * n:(epoch + 1) * n]) == list(range(n))
    # epochs are shuffled differently
    assert not np.array_equal(seen[:n], seen[n:2 * n])


def test_batch_rows_are_windows_and_targets_are_shifted_inputs():
    plan = BatchPlan(len(TOKENS), 8, 32, seed=0)
    batch = host_batch(TOKENS, plan, 5)
    assert batch["inputs"].shape == batch["targets"].shape == (8, 32)
    assert batch["inputs"].dtype == np.int32
    for row, w in zip(range(8), plan.windows(5)):
        np.testing.assert_array_equal(batch["inputs"][row], TOKENS[w * 32:w * 32 + 32])
        np.testing.assert_array_equal(batch["targets"][row], TOKENS[w * 32 + 1:w * 32 + 33])


def test_batch_plan_errors_name_the_field():
    with pytest.raises(ValueError, match="seq_len=200.*accepted: seq_len <= 99"):
        BatchPlan(100, 4, 200)
    with pytest.raises(ValueError, match="batch_size=0.*accepted"):
        BatchPlan(100, 0, 8)


# ---- placement on the mesh ---------------------------------------------------------------------

def _assert_matches(global_array, expected, sharding):
    assert global_array.sharding == sharding
    np.testing.assert_array_equal(np.asarray(global_array), expected)
    for shard in global_array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


def test_device_batch_gives_each_device_its_own_rows(devices):
    mesh = make_mesh(2, 4)
    sharding = NamedSharding(mesh, P(DATA_AXES))
    plan = BatchPlan(len(TOKENS), 16, 32, seed=1)
    expected = host_batch(TOKENS, plan, 3)
    batch = device_batch(TOKENS, plan, 3, sharding)
    for name in ("inputs", "targets"):
        _assert_matches(batch[name], expected[name], sharding)
        rows = [shard.index[0] for shard in batch[name].addressable_shards]
        # 8 devices, 8 distinct blocks of 2 rows each
        assert sorted((r.start, r.stop) for r in rows) == [(2 * d, 2 * d + 2) for d in range(8)]


def test_device_batch_handles_two_dim_and_replicated_layouts(devices):
    mesh = make_mesh(2, 4)
    plan = BatchPlan(len(TOKENS), 4, 32, seed=2)
    expected = host_batch(TOKENS, plan, 0)
    for spec in (P(NODE_AXIS, LOCAL_AXIS), P(NODE_AXIS), P()):
        sharding = NamedSharding(mesh, spec)
        batch = device_batch(TOKENS, plan, 0, sharding)
        _assert_matches(batch["inputs"], expected["inputs"], sharding)
        _assert_matches(batch["targets"], expected["targets"], sharding)


def test_device_batch_builds_only_per_device_pieces(devices, monkeypatch):
    """No call materialises the global batch: each builds one device's rows (multi-process safe)."""
    built = []
    original = data._window_tokens

    def spy(tokens, windows, seq_len):
        built.append(len(windows))
        return original(tokens, windows, seq_len)

    monkeypatch.setattr(data, "_window_tokens", spy)
    sharding = NamedSharding(make_mesh(2, 4), P(DATA_AXES))
    device_batch(TOKENS, BatchPlan(len(TOKENS), 16, 32), 0, sharding)
    assert built == [2] * 8


def test_device_batches_stream_continues_from_start_step(devices):
    sharding = NamedSharding(make_mesh(2, 4), P(DATA_AXES))
    plan = BatchPlan(len(TOKENS), 8, 16, seed=4)
    stream = data.device_batches(TOKENS, plan, sharding, start_step=10)
    first, second = next(stream), next(stream)
    np.testing.assert_array_equal(np.asarray(first["inputs"]),
                                  host_batch(TOKENS, plan, 10)["inputs"])
    np.testing.assert_array_equal(np.asarray(second["inputs"]),
                                  host_batch(TOKENS, plan, 11)["inputs"])
    assert isinstance(first["inputs"], jax.Array)


# ---- JSON data files ---------------------------------------------------------------------------

JSON_RECORDS = [{"prompt": "Q1", "response": "A1"}, {"prompt": "Q2", "response": ""},
           {"prompt": "Q3\u2028x", "response": "A3", "extra": [1, {"a": 2}]}]


def test_an_array_gives_the_records_of_the_same_lines_and_the_line_each_starts_on(tmp_path):
    lines = tmp_path / "d.jsonl"
    lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in JSON_RECORDS),
                     encoding="utf-8")
    array = tmp_path / "d.json"
    array.write_text(json.dumps(JSON_RECORDS, indent=2, ensure_ascii=False), encoding="utf-8")
    assert read_records(lines) == [(1, JSON_RECORDS[0]), (2, JSON_RECORDS[1]), (3, JSON_RECORDS[2])]
    # indent=2: "[" on line 1, then each object over 4, 4 and 9 lines.
    assert read_records(array) == [(2, JSON_RECORDS[0]), (6, JSON_RECORDS[1]),
                                   (10, JSON_RECORDS[2])]
    one_line = tmp_path / "one.json"
    one_line.write_text(json.dumps(JSON_RECORDS), encoding="utf-8")
    assert [r for _, r in read_records(one_line)] == JSON_RECORDS
    # JSON lines under a .json name (Hugging Face datasets' to_json writes those).
    hf_style = tmp_path / "hf.json"
    hf_style.write_bytes(lines.read_bytes())
    assert read_records(hf_style) == read_records(lines)


def test_gzipped_files_and_the_three_readers(tmp_path):
    array = tmp_path / "d.json.gz"
    array.write_bytes(gzip.compress(json.dumps(JSON_RECORDS).encode()))
    assert [r for _, r in read_records(array)] == JSON_RECORDS
    examples = read_sft_jsonl(array)
    assert [(e.prompt, e.response, e.line, e.path) for e in examples] == [
        ("Q1", "A1", 1, str(array)), ("Q2", "", 1, str(array)), ("Q3\u2028x", "A3", 1, str(array))]
    assert read_prompt_jsonl(array) == ["Q1", "Q2", "Q3\u2028x"]
    pairs = tmp_path / "p.json"
    pairs.write_text(json.dumps([{"prompt": "P", "chosen": "C", "rejected": "R"}]))
    assert [(p.prompt, p.chosen, p.rejected) for p in read_pair_jsonl(pairs)] == [("P", "C", "R")]
    assert [json_suffix(n) for n in ("a.jsonl", "a.JSON", "a.json.gz", "a.txt", "a.gz")] == [
        ".jsonl", ".json", ".json", None, None]


@pytest.mark.parametrize("name, content, message", [
    ("d.json", '{\n  "prompt": "Q"\n}', r":1: invalid JSON \(.*\); accepted: a JSON array of "
                                      r"objects, or one JSON object per line"),
    ("d.json", '"Q"\n', r":1: a JSON str; accepted: a JSON array of objects, or one JSON "
                       r"object per line"),
    ("d.json", '[\n  {"prompt": "Q"},\n  ["Q"]\n]', r":3: a JSON list; accepted: a JSON array of "
                                                    r"objects"),
    ("d.json", '[\n  {"prompt": "Q"},\n  {"prompt": }\n]', r":3: invalid JSON"),
    ("d.json", "[]", r": no examples \(an empty JSON array\)"),
    ("d.jsonl", '[{"prompt": "Q"}]', r":1: a JSON list; accepted: one JSON object per line"),
    ("d.json.gz", "not gzip", r": not a gzip file"),
], ids=["one-object-over-lines", "string", "element-not-object", "bad-json", "empty-array",
         "array-in-jsonl",
        "not-gzip"])
def test_bad_json_files_name_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ChatDataError, match=re.escape(str(path)) + message):
        read_records(path)
