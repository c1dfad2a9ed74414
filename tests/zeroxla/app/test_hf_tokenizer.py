"""Our tokenizers as Hugging Face tokenizer files: same ids, exact round trips, readable files."""

import stat

import numpy as np
import pytest

from hf_golden import FAMILIES, golden
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer, bytes_to_unicode, save_hf_tokenizer
from zeroxla.app.tokenizers.basic import ByteTokenizer, CharTokenizer
from zeroxla.app.tokenizers.records import tokenizer_from_record, tokenizer_record

TEXT = ("First Citizen:\nBefore we proceed,  hear me speak.\r\n"
        "\tÜber allen Gipfeln — ist Ruh 😀 ")


def test_byte_alphabet_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


@pytest.mark.parametrize("ours", [CharTokenizer.from_text(TEXT), ByteTokenizer()],
                         ids=["char", "byte"])
def test_transformers_tokenizer_gives_our_ids_and_exact_text(ours, tmp_path):
    transformers = pytest.importorskip("transformers")
    files = save_hf_tokenizer(ours, tmp_path, model_max_length=128)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = theirs(TEXT)["input_ids"]
    assert ids == ours.encode(TEXT).tolist()
    assert theirs.decode(ids) == TEXT
    assert theirs.model_max_length == 128
    assert tokenizer_from_record(tokenizer_record(ours)) == ours
    np.testing.assert_array_equal(ours.encode(theirs.decode(ids)), ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_tokenizer_files_give_transformers_ids(family):
    """The tokenizer files transformers saved beside the golden checkpoints (tests/assets/hf),
    read with `tokenizers` alone (no transformers): transformers' ids for each text, the special
    `<|endoftext|>` as its one id 511, decoded back to the text exactly; eos and bos from
    tokenizer_config.json."""
    g = golden(family)
    ours = PretrainedTokenizer.from_dir(g.directory)
    assert (ours.vocab_size, ours.eos_id, ours.bos_id, ours.pad_id) == (512, 511, 511, 511)
    assert 511 in g.ids[1]
    for text, ids in zip(g.texts, g.ids):
        assert ours.encode(text).tolist() == list(ids)
        assert ours.decode(ids) == text
    assert tokenizer_from_record(tokenizer_record(ours)) == ours
