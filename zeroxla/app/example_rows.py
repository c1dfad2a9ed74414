"""A data file's rows as a job's examples: SFT examples, preference pairs, prompts.

    read_sft_jsonl(path, split)      -> [SFTExample | ChatExample]
    read_pair_jsonl(path, split)     -> [PairExample | ChatPairExample]
    read_prompt_jsonl(path, split, tokenizer) -> [prompt text]

The rows come from `data_files.rows` (JSON, Parquet, a `datasets` directory); the layouts are
`chat_data`'s (its module docstring). Each example keeps where it was read (`path`, `line`: the
row), so an error about it, however late, names the file and the row (`example_where`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from zeroxla.app import chat_messages, data_files, prompt_files
from zeroxla.app.chat_messages import ChatExample, ChatPairExample
from zeroxla.app.data import ChatDataError
from zeroxla.app.data_files import where
from zeroxla.app.tokenizers.basic import Tokenizer


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """A prompt and the response the model should learn to give. `path`/`line` (1-based) say
    where it was read; None for generated examples."""

    prompt: str
    response: str
    path: str | None = None
    line: int | None = None


@dataclasses.dataclass(frozen=True)
class PairExample:
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) answer."""

    prompt: str
    chosen: str
    rejected: str
    path: str | None = None
    line: int | None = None


def example_where(example: Any, index: int) -> str:
    """'file:line' of an example read from a file, else 'example i' (its index in the list
    given). A file's example is named by its line alone: the jobs shuffle the examples into
    splits before tokenizing them, so an index would not name its place in the file."""
    if example.path is not None and example.line is not None:
        return where(example.path, example.line)
    return f"example {index}"


def _field(record: dict[str, Any], names: tuple[str, ...], name: str, number: int) -> str:
    """The string under the first of `names` present in `record` (names[1:] are aliases)."""
    for key in names:
        if key in record:
            value = record[key]
            if not isinstance(value, str):
                raise ChatDataError(f"{where(name, number)}: field {key!r} is "
                                    f"{data_files.type_name(name, value)}; accepted: a string")
            return value
    accepted = " or ".join(repr(k) for k in names)
    raise ChatDataError(f"{where(name, number)}: missing field {names[0]!r}; accepted: "
                        f"{accepted} (found {sorted(record)})")


def read_sft_jsonl(path: str | os.PathLike, split: str | None = None
                   ) -> list[SFTExample | ChatExample]:
    """SFT examples from the rows of a data file (`data_files.rows`: JSON, Parquet, a
    `datasets` directory and its `split`): `{"prompt", "response"}` (TRL's `"completion"` and
    DeepSpeed-Chat's `"chosen"` are accepted for `"response"`), `{"messages": [...]}`
    conversations, or TRL's conversational `{"prompt": [...], "completion": [...]}`."""
    return [_sft_example(row) for row in data_files.rows(path, split)]


def _sft_example(row: data_files.Row) -> SFTExample | ChatExample:
    r, name, n = row.record, row.source, row.number
    if "messages" in r:
        return chat_messages.sft_row(r, row.where, name, n)
    if isinstance(r.get("prompt"), list) and "completion" in r:
        return chat_messages.prompt_completion_row(r, row.where, name, n)
    answer = ("completion",) if "completion" in r else ("response", "chosen")   # TRL's, DS's
    return SFTExample(_field(r, ("prompt",), name, n), _field(r, answer, name, n),
                      path=name, line=n)


def read_pair_jsonl(path: str | os.PathLike, split: str | None = None
                    ) -> list[PairExample | ChatPairExample]:
    """Preference pairs from `{"prompt", "chosen", "rejected"}` rows (`data_files.rows`),
    string fields or TRL's lists of messages (`chat_messages.pair_row`)."""
    return [chat_messages.pair_row(row.record, row.where, row.source, row.number)
            if chat_messages.is_chat_pair(row.record)
            else PairExample(*(_field(row.record, (key,), row.source, row.number)
                               for key in ("prompt", "chosen", "rejected")),
                             path=row.source, line=row.number)
            for row in data_files.rows(path, split)]


def read_prompt_jsonl(path: str | os.PathLike, split: str | None = None,
                      tokenizer: Tokenizer | None = None) -> list[str]:
    """PPO prompts from `{"prompt"}` rows: text, or chat messages rendered with `tokenizer`'s
    chat template and its generation prompt (`prompt_files.prompt_records`)."""
    return [r["prompt"] for r in prompt_files.prompt_records(path, split, tokenizer)]


__all__ = ["PairExample", "SFTExample", "example_where", "read_pair_jsonl", "read_prompt_jsonl",
           "read_sft_jsonl"]
