"""Tokenizers as JSON records, stored in checkpoints so that a checkpoint is exported, sampled
and fine-tuned further with the vocabulary it was trained with."""

from __future__ import annotations

from typing import Any

from zeroxla.app.hf_tokenizer import PretrainedTokenizer
from zeroxla.app.tokenizer import TOKENIZERS, ByteTokenizer, CharTokenizer, Tokenizer


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


__all__ = ["tokenizer_from_record", "tokenizer_record"]
