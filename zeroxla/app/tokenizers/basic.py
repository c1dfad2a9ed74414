"""Tokenizers for plain text: one id per character, or one id per UTF-8 byte.

Both are frozen dataclasses with the same three members, `vocab_size`, `encode(text) -> int32[N]`
and `decode(ids) -> str`, so the data pipeline and the sampler never ask which one they hold.
A character tokenizer's vocabulary is the sorted set of characters in a corpus (65 for
tiny-shakespeare, which is the `vocab_size` of the `gpt-tiny` preset); a byte tokenizer always has
256 ids and can encode any text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

TOKENIZERS = ("char", "byte")


class Tokenizer(Protocol):
    """What the pipeline and the sampler need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokenizer: id i is the i-th character of `chars` (sorted, distinct)."""

    chars: str

    def __post_init__(self) -> None:
        if not self.chars:
            raise ValueError("CharTokenizer.chars='' is invalid; accepted: a non-empty string of "
                             "distinct characters (build it with CharTokenizer.from_text)")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError(f"CharTokenizer.chars has repeated characters; accepted: distinct "
                             f"characters (got {len(self.chars)} characters, "
                             f"{len(set(self.chars))} distinct)")

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose vocabulary is every distinct character of `text`, sorted."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def unknown(self, text: str) -> list[str]:
        """The distinct characters of `text` outside the vocabulary, sorted."""
        return sorted(set(text) - set(self.chars))

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32[len(text)]. Raises a ValueError naming the first unknown character."""
        table = {c: i for i, c in enumerate(self.chars)}
        try:
            return np.fromiter((table[c] for c in text), dtype=np.int32, count=len(text))
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary of "
                             f"{self.vocab_size} characters (use --tokenizer byte for text the "
                             "training corpus does not cover)") from None

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """int ids -> text; raises a ValueError naming an id outside [0, vocab_size)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return "".join(self.chars[i] for i in ids)


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer: the ids are the UTF-8 bytes of the text (vocabulary 256)."""

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32[number of UTF-8 bytes]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Byte ids -> text. A sampled model can emit invalid UTF-8; those bytes become U+FFFD."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids > 255)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the byte vocabulary [0, 256)")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def make_tokenizer(kind: str, text: str) -> CharTokenizer | ByteTokenizer:
    """The tokenizer `kind` ("char" or "byte") fitted to the corpus `text`."""
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer={kind!r} is invalid; accepted: {', '.join(TOKENIZERS)}")
