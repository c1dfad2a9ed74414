"""What `zeroxla train` trains on: a text corpus, or DeepSpeed-Chat's supervised fine-tuning pairs.

    --data corpus.txt   next-token windows of a text stream (`TextData`)
    --data sft.jsonl    prompt/response examples (`SFTData`), one per row, right-padded, the loss
    --data sft.json     on the response tokens only (DeepSpeed-Chat's step 1); .json holds a JSON
    --data sft.parquet  array of the same objects (or JSON lines); either may end in .gz; a
    --data DIR          Parquet file, a directory of Parquet shards or one saved by `datasets`
                        (`--split train` for a DatasetDict's) hold the same rows
                        (`zeroxla.app.data_files`); rows may be `{"messages": [...]}`
                        conversations instead, rendered with the --init-from checkpoint's chat
                        template, the loss on the assistant's tokens (`chat_data`,
                        `chat_messages`)

`read_data` is the one place that decides which, from the name and then the content: a file
named otherwise that holds `{"prompt": ...}` or `{"messages": ...}` records (its first line
one, or a JSON array of them) is refused, not trained as text.
SFT rows with no loss token (an empty response and no EOS token) are counted and reported by
`describe()`; a file, or a train or validation split, of nothing else is refused.

Both have the same members, so the training loop never asks which it holds: `tokenizer`,
`source`, `vocab_size`, `describe()`, `train_batch(k, sharding)` (step k's global batch),
`eval_batches(split, n, sharding)` (fixed batches of "train" or "val") and `sample_prompt()`.

The tokenizer is the pretrained checkpoint's (`pretrained`, with `--init-from DIR`: its
tokenizer.json), or one fitted to the data (`char`: every character of the text; `byte`: the 256
bytes); a resumed run's is the one its checkpoint records, whatever `--data` it resumes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np

from zeroxla.app import chat_data, chat_messages, data_files, packing
from zeroxla.app.data import (ACCEPTED_JSON, BatchPlan, device_batch, epoch_rows,
                              load_text, split_examples, split_tokens, to_devices)
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.tokenizers.basic import CharTokenizer, Tokenizer, make_tokenizer
from zeroxla.app.tokenizers.records import tokenizer_from_record
from zeroxla.app.jobs.train.config import PRETRAINED

# Validation examples are drawn with this seed whatever the training seed (as text windows are).
VALIDATION_SEED = 1234


@dataclasses.dataclass(frozen=True)
class TextData:
    """A tokenized text stream, split into train and validation, cut into windows."""

    tokenizer: Tokenizer
    train: np.ndarray              # int32[N_train]
    val: np.ndarray                # int32[N_val]
    source: str
    batch_size: int
    seq_len: int
    seed: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        return f"{len(self.train):,} train / {len(self.val):,} val tokens"

    def _plan(self, split: str, seed: int) -> tuple[np.ndarray, BatchPlan]:
        tokens = self.train if split == "train" else self.val
        return tokens, BatchPlan(len(tokens), self.batch_size, self.seq_len, seed=seed)

    def train_batch(self, k: int, sharding: jax.sharding.Sharding) -> dict:
        tokens, plan = self._plan("train", self.seed)
        return device_batch(tokens, plan, k, sharding)

    def eval_batches(self, split: str, n: int, sharding: jax.sharding.Sharding) -> list[dict]:
        tokens, plan = self._plan(split, VALIDATION_SEED)
        return [device_batch(tokens, plan, k, sharding) for k in range(n)]

    def sample_prompt(self) -> np.ndarray:
        try:
            return self.tokenizer.encode("\n")
        except ValueError:
            return self.val[:1]


@dataclasses.dataclass(frozen=True)
class SFTData:
    """Prompt/response examples as padded rows (`chat_data.sft_arrays`): each step takes
    `batch_size` rows of a per-epoch shuffle of the training examples."""

    tokenizer: Tokenizer
    train: dict[str, np.ndarray]   # inputs/targets int32[N, T], loss_mask float32[N, T]
    val: dict[str, np.ndarray]
    source: str
    batch_size: int
    seed: int
    rows_without_loss: int = 0     # examples of either split with no loss token
    conversations: bool = False    # `messages` rows among the examples (the loss: assistant's)
    padded_rows: int | None = None  # packed: the rows the training examples padded would take

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        n_train, n_val = len(self.train["inputs"]), len(self.val["inputs"])
        answer = int(self.train["loss_mask"].sum())
        empty = (f"; {self.rows_without_loss:,} with no loss token (an empty response, no EOS "
                 "token) fill batch rows but add nothing to the loss"
                 if self.rows_without_loss else "")
        kinds, learned = (("SFT examples (conversations)", "assistant")
                          if self.conversations else ("prompt-response pairs", "response"))
        packed = ""
        if self.padded_rows is not None:
            n_train = self.padded_rows
            packed = (f", packed into {len(self.train['inputs']):,} rows (padded: {n_train:,}; "
                      f"{self._filled():.0%} of the packed rows' tokens are examples')")
        return (f"{n_train:,} train / {n_val:,} val {kinds}, {answer:,} {learned} tokens in "
                f"train{empty}{packed}")

    def _filled(self) -> float:
        segments = self.train["segment_ids"]
        return float(np.mean(segments != packing.PAD_SEGMENT))

    def _rows(self, split: str, k: int, seed: int) -> dict[str, np.ndarray]:
        return epoch_rows(self.train if split == "train" else self.val, self.batch_size, k, seed)

    def train_batch(self, k: int, sharding: jax.sharding.Sharding) -> dict:
        return to_devices(self._rows("train", k, self.seed), sharding)

    def eval_batches(self, split: str, n: int, sharding: jax.sharding.Sharding) -> list[dict]:
        return [to_devices(self._rows(split, k, VALIDATION_SEED), sharding) for k in range(n)]

    def sample_prompt(self) -> np.ndarray:
        row = int(np.argmax(self.val["loss_mask"].any(axis=-1)))     # the first with a loss
        start = int(np.argmax(self.val["loss_mask"][row] > 0)) + 1   # the prompt ends there
        return self.val["inputs"][row, :start]


def _record_field(text: str) -> str | None:
    """The SFT field ("prompt" or "messages") that shows `text` is records rather than prose:
    its first non-blank line is a JSON object with it, or the whole text a JSON array starting
    with one; None for prose."""
    head = text.lstrip()
    candidates = [head.split("\n", 1)[0]] + ([head] if head.startswith("[") else [])
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        first = value[0] if isinstance(value, list) and value else value
        for field in ("prompt", "messages"):
            if isinstance(first, dict) and field in first:
                return field
    return None


def read_data(data: str | None, split: str | None = None) -> str | list[chat_data.SFTExample]:
    """`--data`, read by the one rule (module docstring): the text to train on, or the SFT
    examples (`split`: a DatasetDict's). Every error names the file and the accepted forms."""
    data_files.check_split(split, data, "--data")
    if data is not None and (data_files.kind(data) is not None or split is not None):
        return chat_data.read_sft_jsonl(data, split)
    text = load_text(data)
    field = _record_field(text) if data is not None else None
    if field is not None:
        raise chat_data.ChatDataError(
            f"--data {data} holds JSON records with a \"{field}\" field, but its name does not "
            "end in .jsonl or .json, so it would train as plain text; accepted: "
            f"for supervised fine-tuning {ACCEPTED_JSON} (rename it); for text, a file that is not "
            "JSON records")
    return text


def _sft_data(examples: list[chat_data.SFTExample], tok: Any, source: str, batch_size: int,
              seq_len: int, val_fraction: float, seed: int, packed: bool) -> SFTData:
    """The examples split and tokenized (the training split `packed` into rows when asked;
    validation stays padded, so its loss is the same figure either way); a file or split with
    no loss token is refused."""
    train_examples, val_examples = split_examples(examples, val_fraction, seed)
    eos = getattr(tok, "eos_id", None)
    train, val = (chat_data.sft_arrays(part, tok, seq_len, eos_id=eos)
                  for part in (train_examples, val_examples))
    why = ("an empty response, and the tokenizer has no EOS token to learn in its place"
           if eos is None else "an empty prompt and response: one EOS token, nothing to predict")
    empty = chat_data.check_learnable(
        f"--data {source}",
        {"training": (len(train_examples), chat_data.rows_without_loss(train)),
         "validation": (len(val_examples), chat_data.rows_without_loss(val))},
        f"no loss token ({why})", 'examples with a non-empty "response"')
    chat = any(isinstance(e, chat_messages.ChatExample) for e in examples)
    padded_rows = None
    if packed:
        padded_rows = len(train["inputs"])
        train = chat_data.sft_arrays(train_examples, tok, seq_len, eos_id=eos, packed=True)
    return SFTData(tok, train, val, source, batch_size, seed, rows_without_loss=empty,
                   conversations=chat, padded_rows=padded_rows)


def _recorded_tokenizer(recorded: dict, tokenizer: str, text: str, source: str) -> Any:
    """A resumed run's own tokenizer (its checkpoint's record), checked against the job's kind
    (`--tokenizer`) and against the data, which it must encode as it is: a character vocabulary
    is never re-derived from other data (its ids would stand for other characters)."""
    tok = tokenizer_from_record(recorded)
    if {PRETRAINED: "hf"}.get(tokenizer, tokenizer) != recorded.get("kind"):
        raise ValueError(f"--tokenizer {tokenizer}: the run being resumed tokenizes with its "
                         f"{recorded.get('kind')} tokenizer (recorded in its checkpoint), and "
                         "a resumed run keeps it; leave --tokenizer out, or start a new run")
    unknown = tok.unknown(text) if isinstance(tok, CharTokenizer) else []
    if unknown:
        shown = ", ".join(repr(c) for c in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        raise ValueError(f"--data {source} has {len(unknown)} character(s) the resumed run's "
                         f"tokenizer does not know: {shown}. A resumed run tokenizes with its "
                         f"own vocabulary (the {tok.vocab_size} characters of the data it "
                         "started on, recorded in its checkpoint); accepted: data of those "
                         "characters (e.g. the run's own --data), or a new run for this data")
    return tok


def load_train_data(data: str | None, *, tokenizer: str, init_from: str | None,
                    split: str | None = None,
                    batch_size: int, seq_len: int, val_fraction: float,
                    seed: int, recorded: dict | None = None,
                    packing: bool = False) -> TextData | SFTData:
    """The job's data (see the module docstring). `tokenizer` is "char", "byte", or
    "pretrained" with `init_from` (the checkpoint's own); `recorded`, a resumed run's tokenizer
    record, is used instead once checked against both (`_recorded_tokenizer`); `split`: a
    DatasetDict's of a `datasets` directory. Every error comes
    before any compute. `packing`: SFT training rows packed (`zeroxla.app.packing`)."""
    if (tokenizer == PRETRAINED) != (init_from is not None):
        raise ValueError(f"tokenizer {tokenizer!r} with init_from={init_from!r}: a pretrained "
                         "model's vocabulary is its own tokenizer's ('pretrained'), and only a "
                         "pretrained model has one")
    content = read_data(data, split)
    text = content if isinstance(content, str) else "".join(
        chat_messages.example_text(e) if isinstance(e, chat_messages.ChatExample)
        else e.prompt + e.response for e in content)
    source = "tiny-shakespeare (bundled)" if data is None else os.fspath(data)
    tok: Any
    if recorded is not None:
        tok = _recorded_tokenizer(recorded, tokenizer, text, source)
    elif init_from is not None:
        tok = PretrainedTokenizer.from_dir(init_from)
    else:
        tok = make_tokenizer(tokenizer, text)
    if isinstance(content, str):
        train, val = split_tokens(tok.encode(text), val_fraction)
        return TextData(tok, train, val, source, batch_size, seq_len, seed)
    return _sft_data(content, tok, source, batch_size, seq_len, val_fraction, seed, packing)


__all__ = ["SFTData", "TextData", "load_train_data", "read_data"]
