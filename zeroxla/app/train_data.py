"""What `zeroxla train` trains on: a text corpus, or DeepSpeed-Chat's supervised fine-tuning pairs.

    --data corpus.txt   next-token windows of a text stream (`TextData`)
    --data sft.jsonl    prompt/response examples (`SFTData`), one per row, right-padded, the loss
                        on the response tokens only (DeepSpeed-Chat's step 1)

Both have the same members, so the training loop never asks which it holds: `tokenizer`,
`source`, `vocab_size`, `describe()`, `train_batch(k, sharding)` (step k's global batch),
`eval_batches(split, n, sharding)` (fixed batches of "train" or "val") and `sample_prompt()`.

The tokenizer is the pretrained checkpoint's (`--init-from DIR`: its tokenizer.json), or one
fitted to the data (`char`: every character of the text; `byte`: the 256 bytes).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zeroxla.app import chat_data
from zeroxla.app.data import BatchPlan, device_batch, load_text, split_tokens
from zeroxla.app.hf_tokenizer import PretrainedTokenizer
from zeroxla.app.tokenizer import Tokenizer, make_tokenizer

SFT_SUFFIX = ".jsonl"
# Validation examples are drawn with this seed whatever the training seed (as text windows are).
VALIDATION_SEED = 1234


def to_devices(arrays: dict[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict:
    """A host batch (every row, on every process) as global arrays laid out by `sharding`: each
    device receives only its rows."""
    return {key: jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
            for key, value in arrays.items()}


def epoch_rows(arrays: dict[str, np.ndarray], batch_size: int, k: int,
               seed: int) -> dict[str, np.ndarray]:
    """Step k's `batch_size` rows of `arrays` (each [N, ...]): the examples are visited in a
    fresh seeded shuffle each epoch, and a batch may run on into the next epoch."""
    n = len(next(iter(arrays.values())))
    epoch, offset = divmod(k * batch_size, n)
    epochs = range(epoch, epoch + -(-(offset + batch_size) // n))
    order = np.concatenate([np.random.default_rng((seed, e)).permutation(n) for e in epochs])
    rows = order[offset:offset + batch_size]
    return {key: value[rows] for key, value in arrays.items()}


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

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        n_train, n_val = len(self.train["inputs"]), len(self.val["inputs"])
        answer = int(self.train["loss_mask"].sum())
        return (f"{n_train:,} train / {n_val:,} val prompt-response pairs, {answer:,} response "
                "tokens in train")

    def _rows(self, split: str, k: int, seed: int) -> dict[str, np.ndarray]:
        return epoch_rows(self.train if split == "train" else self.val, self.batch_size, k, seed)

    def train_batch(self, k: int, sharding: jax.sharding.Sharding) -> dict:
        return to_devices(self._rows("train", k, self.seed), sharding)

    def eval_batches(self, split: str, n: int, sharding: jax.sharding.Sharding) -> list[dict]:
        return [to_devices(self._rows(split, k, VALIDATION_SEED), sharding) for k in range(n)]

    def sample_prompt(self) -> np.ndarray:
        first = self.val["loss_mask"][0]
        start = int(np.argmax(first > 0)) + 1           # the prompt ends where the loss starts
        return self.val["inputs"][0, :start]


def split_examples(examples: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the last `val_fraction` (at least one) for validation."""
    order = np.random.default_rng(seed).permutation(len(examples))
    n_val = max(1, int(round(len(examples) * val_fraction)))
    if len(examples) - n_val < 1:
        raise chat_data.ChatDataError(f"{len(examples)} example(s) leave none for training "
                                      f"after a validation split of {n_val}; add examples")
    shuffled = [examples[i] for i in order]
    return shuffled[:-n_val], shuffled[-n_val:]


def load_train_data(data: str | None, *, tokenizer: str | None, init_from: str | None,
                    batch_size: int, seq_len: int, val_fraction: float,
                    seed: int) -> TextData | SFTData:
    """The job's data (see the module docstring). `tokenizer` is "char" or "byte" (default
    "char"), or None with `init_from` (the checkpoint's); every error comes before any compute."""
    if init_from is not None and tokenizer is not None:
        raise ValueError(f"--tokenizer {tokenizer} with --init-from {init_from}: a pretrained "
                         "model's vocabulary is its own tokenizer's; leave --tokenizer out")
    is_sft = data is not None and Path(data).suffix == SFT_SUFFIX
    if is_sft:
        examples = chat_data.read_sft_jsonl(data)
        text = "".join(e.prompt + e.response for e in examples)
    else:
        text = load_text(data)
    tok: Any = (PretrainedTokenizer.from_dir(init_from) if init_from is not None
                else make_tokenizer(tokenizer or "char", text))
    source = "tiny-shakespeare (bundled)" if data is None else os.fspath(data)
    if not is_sft:
        train, val = split_tokens(tok.encode(text), val_fraction)
        return TextData(tok, train, val, source, batch_size, seq_len, seed)
    train_examples, val_examples = split_examples(examples, val_fraction, seed)
    eos = getattr(tok, "eos_id", None)
    return SFTData(tok, chat_data.sft_arrays(train_examples, tok, seq_len, eos_id=eos),
                   chat_data.sft_arrays(val_examples, tok, seq_len, eos_id=eos),
                   source, batch_size, seed)


__all__ = ["SFTData", "SFT_SUFFIX", "TextData", "epoch_rows", "load_train_data", "split_examples",
           "to_devices"]
