"""Tokenizers as JSON records, stored in checkpoints so that a checkpoint is exported, sampled
and fine-tuned further with the vocabulary it was trained with."""

from __future__ import annotations

import json
from typing import Any

from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.tokenizers.basic import TOKENIZERS, ByteTokenizer, CharTokenizer, Tokenizer


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """A JSON-able description of `tokenizer`, stored in checkpoints so that a checkpoint can be
    exported with its vocabulary: {"kind": "char", "chars": ...}, {"kind": "byte"}, or a
    pretrained tokenizer's own record ({"kind": "hf", "files": {name: text}}: self-contained)."""
    if isinstance(tokenizer, PretrainedTokenizer):
        return tokenizer.record()
    if isinstance(tokenizer, CharTokenizer):
        return {"kind": "char", "chars": tokenizer.chars}
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte"}
    raise TypeError(f"tokenizer_record: {type(tokenizer).__name__} is not CharTokenizer or "
                    "ByteTokenizer")


def tokenizer_from_record(record: dict[str, Any]) -> Tokenizer:
    """Inverse of `tokenizer_record`."""
    kind = record.get("kind")
    if kind == "hf":
        return PretrainedTokenizer.from_record(record)
    if kind == "char":
        return CharTokenizer(record["chars"])
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer record kind={kind!r} is invalid; accepted: "
                     f"{', '.join(TOKENIZERS)}, hf")


def tokenizes_alike(tokenizer: Tokenizer, other: Tokenizer) -> bool:
    """Whether `other` turns every text into the ids `tokenizer` does, with the same EOS: the
    same record (wherever it was read), or for pretrained tokenizers the same tokenizer.json
    but for special tokens `other` adds beyond `tokenizer`'s ids (the pad token of a reward
    model `zeroxla export` wrote). Other files (tokenizer_config.json's model_max_length, ...)
    do not change the ids."""
    if not (isinstance(tokenizer, PretrainedTokenizer) and isinstance(other, PretrainedTokenizer)):
        return ({k: v for k, v in tokenizer_record(tokenizer).items() if k != "source"}
                == {k: v for k, v in tokenizer_record(other).items() if k != "source"})
    if tokenizer.eos_token != other.eos_token:
        return False
    # Both as this `tokenizers` version writes them (a file from another version may spell the
    # same merges differently).
    mine, theirs = (json.loads(t.tokenizer.to_str()) for t in (tokenizer, other))
    theirs["added_tokens"] = [t for t in theirs.get("added_tokens") or []
                              if not (t.get("special") and t["id"] >= tokenizer.vocab_size)]
    mine["added_tokens"] = mine.get("added_tokens") or []
    return mine == theirs


__all__ = ["tokenizer_from_record", "tokenizer_record", "tokenizes_alike"]
