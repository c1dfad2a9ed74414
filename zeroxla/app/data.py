"""Data files and text data for language-model training: load a corpus or a JSON data file,
tokenize, split, batch, place on the mesh.

The data flow, one way:

    load_text(path)            -> str           (None: the bundled tiny-shakespeare, offline)
    make_tokenizer(kind, text) -> Tokenizer     (zeroxla.tokenizer: "char" or "byte")
    split_tokens(ids, frac)    -> train, val    (the last `frac` of the stream is validation)
    BatchPlan(...).windows(k)  -> which windows of the stream form global batch k
    device_batch(...)          -> {"inputs", "targets"} as global jax.Arrays on the mesh
    split_examples / epoch_rows / to_devices   a job's examples: the validation split, step
                               k's rows in a seeded per-epoch shuffle, a host batch on the mesh

A token stream is cut into windows of `seq_len + 1` tokens at stride `seq_len` (inputs are a
window's first `seq_len` tokens, targets the last `seq_len`). Every epoch visits each window once
in an order drawn from `(seed, epoch)`, so batch k is a pure function of `(seed, k)`: the same
seed gives the same batches, a resumed run continues the same stream, and every process of a
multi-process run agrees on the global batch without communicating.

JSON data files (`read_records`: what `--data` gives SFT and reward jobs and `--prompts` PPO,
read into examples by `chat_data`) come in two layouts, told apart by the file's name and then
its first character:

    NAME.jsonl   JSON lines: one object a line, blank lines skipped
    NAME.json    a JSON array of the same objects (`[{...}, {...}]`), or JSON lines when its
                 first non-blank character is not `[` (Hugging Face `datasets`' `to_json`
                 writes JSON lines under a .json name)

either optionally gzipped (`.jsonl.gz`, `.json.gz`). The line of an array element is the line
its `{` is on, so every error names `file:line` as it does for JSON lines.

`device_batch` builds only the rows the *addressable* devices hold (from the sharding's
`addressable_devices_indices_map`) and assembles the global array with
`jax.make_array_from_single_device_arrays`; in a multi-process run each process therefore reads
only its own devices' slices, and the code is the same as on one host.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from zeroxla.app.tokenizers.basic import ByteTokenizer, CharTokenizer, make_tokenizer

# The bundled corpus (Karpathy's tiny-shakespeare, 1,115,394 characters), shipped gzipped inside
# the package so that `zeroxla train` runs offline.
BUNDLED_CORPUS = "assets/tinyshakespeare.txt.gz"


def load_text(path: str | os.PathLike | None = None) -> str:
    """The UTF-8 text of `path` (gunzipped if it ends in .gz); `None` is the bundled corpus."""
    if path is None:
        raw = importlib.resources.files("zeroxla.app").joinpath(BUNDLED_CORPUS).read_bytes()
        name = f"zeroxla/app/{BUNDLED_CORPUS}"
    else:
        name = os.fspath(path)
        if not os.path.isfile(name):
            raise FileNotFoundError(f"--data {name!r}: no such file; accepted: a UTF-8 text file "
                                    "(optionally .gz), or leave --data out for the bundled "
                                    "tiny-shakespeare")
        with open(name, "rb") as f:
            raw = f.read()
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name!r} is not UTF-8 text (byte {err.start}: {err.reason}); "
                         "accepted: a UTF-8 text file") from None
    if not text:
        raise ValueError(f"{name!r} is empty; accepted: a non-empty UTF-8 text file")
    return text


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last `val_fraction` of the stream is held out, contiguous (nanoGPT's
    split), so validation text is never seen in training, not even as a window overlap."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} is invalid; accepted: a number in (0, 1)")
    cut = int(round(len(tokens) * (1.0 - val_fraction)))
    return tokens[:cut], tokens[cut:]


# ----------------------------------------------------------------------------- JSON data files

JSON_LINES = ".jsonl"
JSON_ARRAY = ".json"
ACCEPTED_JSON = ("a .jsonl file of one JSON object per line, or a .json file holding a JSON "
                 "array of those objects (or JSON lines); either may be gzipped (.gz)")


class ChatDataError(ValueError):
    """A JSON data file (here) or a chat example (`chat_data`) that cannot be used, named by
    file:line or example index."""


def json_suffix(path: str | os.PathLike) -> str | None:
    """".jsonl" or ".json" when `path` names a JSON data file (a trailing .gz ignored), else
    None."""
    name = os.fspath(path).lower().removesuffix(".gz")
    return next((s for s in (JSON_LINES, JSON_ARRAY) if name.endswith(s)), None)


def _json_text(name: str) -> str:
    """The UTF-8 text of `name` (gunzipped when it ends in .gz)."""
    if not os.path.isfile(name):
        raise FileNotFoundError(f"{name}: no such file; accepted: {ACCEPTED_JSON}")
    with open(name, "rb") as f:
        raw = f.read()
    if name.lower().endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise ChatDataError(f"{name}: not a gzip file ({err}); accepted: "
                                f"{ACCEPTED_JSON}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ChatDataError(f"{name}:{line}: not UTF-8 ({err.reason})") from None


def _object(name: str, line: int, record: Any, accepted: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ChatDataError(f"{name}:{line}: a JSON {type(record).__name__}; accepted: {accepted}")
    return record


def _lines(name: str, text: str, accepted: str) -> list[tuple[int, dict[str, Any]]]:
    """JSON lines: one object a line, blank lines skipped. Lines end at "\n" only: a JSON
    string may hold U+2028 or a form feed unescaped (`json.dumps(ensure_ascii=False)`)."""
    records = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ChatDataError(f"{name}:{number}: invalid JSON ({err.msg}, column "
                                f"{err.colno}); accepted: {accepted}") from None
        records.append((number, _object(name, number, record, accepted)))
    return records


def _array(name: str, text: str) -> list[tuple[int, dict[str, Any]]]:
    """A JSON array of objects, each with the line its value starts on."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ChatDataError(f"{name}:{err.lineno}: invalid JSON ({err.msg}, column "
                            f"{err.colno})") from None
    if not isinstance(values, list):
        raise ChatDataError(f"{name}: a JSON {type(values).__name__}; accepted: {ACCEPTED_JSON}")
    # The text is valid JSON, so walking it element by element cannot fail.
    decoder, pos, records = json.JSONDecoder(), text.index("[") + 1, []
    for _ in values:
        while text[pos] in " \t\r\n,":
            pos += 1
        line = text.count("\n", 0, pos) + 1
        record, pos = decoder.raw_decode(text, pos)
        records.append((line, _object(name, line, record, "a JSON array of objects")))
    return records


def read_records(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """[(1-based line, JSON object)] of a JSON data file (see "JSON data files" in the module
    docstring); a file with no object is a ChatDataError."""
    name = os.fspath(path)
    text = _json_text(name)
    if json_suffix(name) != JSON_ARRAY:
        records = _lines(name, text, "one JSON object per line")
    elif text.lstrip().startswith("["):
        records = _array(name, text)
    else:
        records = _lines(name, text, "a JSON array of objects, or one JSON object per line")
    if not records:
        what = "an empty JSON array" if text.strip() else "the file is empty or blank"
        raise ChatDataError(f"{name}: no examples ({what}); accepted: {ACCEPTED_JSON}")
    return records


# ----------------------------------------------------------------------------- text

@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: the tokenizer and the train and validation token streams (int32)."""

    tokenizer: CharTokenizer | ByteTokenizer
    train: np.ndarray
    val: np.ndarray
    source: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_corpus(path: str | os.PathLike | None = None, *, tokenizer: str = "char",
                val_fraction: float = 0.1) -> Corpus:
    """Loads, tokenizes and splits a text file (`None`: the bundled tiny-shakespeare).

    The character vocabulary is fitted to the whole text, so validation characters are known.
    """
    text = load_text(path)
    tok = make_tokenizer(tokenizer, text)
    train, val = split_tokens(tok.encode(text), val_fraction)
    source = "tiny-shakespeare (bundled)" if path is None else os.fspath(path)
    return Corpus(tokenizer=tok, train=train, val=val, source=source)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Which windows of a token stream of `num_tokens` tokens form each global batch.

    Window w is tokens[w * seq_len : w * seq_len + seq_len + 1]. Epoch e visits all windows in the
    order `default_rng((seed, e)).permutation(num_windows)`; global batch k takes the next
    `batch_size` windows of that endless stream (an epoch boundary may fall inside a batch).
    """

    num_tokens: int
    batch_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"BatchPlan.{name}={value!r} is invalid; accepted: an "
                                 "integer >= 1")
        if self.num_windows < 1:
            raise ValueError(f"BatchPlan.seq_len={self.seq_len} is too long for a stream of "
                             f"{self.num_tokens} tokens; accepted: seq_len <= "
                             f"{max(self.num_tokens - 1, 0)}")

    @property
    def num_windows(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.batch_size

    def windows(self, step: int) -> np.ndarray:
        """int64[batch_size]: the window indices of global batch `step` (any step >= 0)."""
        if step < 0:
            raise ValueError(f"step={step} is invalid; accepted: an integer >= 0")
        n = self.num_windows
        flat = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        epochs, positions = np.divmod(flat, n)
        out = np.empty_like(flat)
        for epoch in np.unique(epochs):
            order = np.random.default_rng((self.seed, int(epoch))).permutation(n)
            mask = epochs == epoch
            out[mask] = order[positions[mask]]
        return out


def _window_tokens(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """int32[len(windows), seq_len + 1]: the tokens of each window."""
    starts = windows[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens, dtype=np.int32)[starts]


def host_batch(tokens: np.ndarray, plan: BatchPlan, step: int) -> dict[str, np.ndarray]:
    """Global batch `step` as numpy: {"inputs", "targets"} int32[B, T], targets shifted by one."""
    if len(tokens) != plan.num_tokens:
        raise ValueError(f"the plan is for {plan.num_tokens} tokens but the stream has "
                         f"{len(tokens)}")
    window = _window_tokens(tokens, plan.windows(step), plan.seq_len)     # [B, T + 1]
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def _full_index(index: tuple, ndim: int) -> tuple:
    """A sharding's per-device index, padded with full slices to `ndim` dims."""
    index = tuple(index)
    return index + (slice(None),) * (ndim - len(index))


def device_batch(tokens: np.ndarray, plan: BatchPlan, step: int,
                 sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Global batch `step` as jax.Arrays laid out by `sharding` (e.g. `step.layout.batch_sharding`).

    Builds each addressable device's piece from only the rows that device holds, so no process
    ever materialises the whole global batch.
    """
    if len(tokens) != plan.num_tokens:
        raise ValueError(f"the plan is for {plan.num_tokens} tokens but the stream has "
                         f"{len(tokens)}")
    shape = (plan.batch_size, plan.seq_len)
    windows = plan.windows(step)
    pieces: dict[str, list] = {"inputs": [], "targets": []}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        rows, cols = _full_index(index, 2)
        window = _window_tokens(tokens, windows[rows], plan.seq_len)     # [b, T + 1]
        pieces["inputs"].append(jax.device_put(window[:, :-1][:, cols], device))
        pieces["targets"].append(jax.device_put(window[:, 1:][:, cols], device))
    return {name: jax.make_array_from_single_device_arrays(shape, sharding, arrays)
            for name, arrays in pieces.items()}


def device_batches(tokens: np.ndarray, plan: BatchPlan, sharding: jax.sharding.Sharding, *,
                   start_step: int = 0) -> Iterator[dict[str, jax.Array]]:
    """The endless stream of global batches `start_step, start_step + 1, ...` on the mesh."""
    step = start_step
    while True:
        yield device_batch(tokens, plan, step, sharding)
        step += 1




# ---- rows of examples: splits, epochs, devices ----------------------------------------------

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


def split_examples(examples: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the last `val_fraction` (at least one) for validation."""
    order = np.random.default_rng(seed).permutation(len(examples))
    n_val = max(1, int(round(len(examples) * val_fraction)))
    if len(examples) - n_val < 1:
        raise ChatDataError(f"{len(examples)} example(s) leave none for training "
                             f"after a validation split of {n_val}; add examples")
    shuffled = [examples[i] for i in order]
    return shuffled[:-n_val], shuffled[-n_val:]


__all__ = ["ACCEPTED_JSON", "BUNDLED_CORPUS", "BatchPlan", "ByteTokenizer", "ChatDataError",
           "CharTokenizer", "Corpus", "JSON_ARRAY", "JSON_LINES", "device_batch", "device_batches",
           "epoch_rows", "host_batch", "json_suffix", "load_corpus", "load_text", "read_records",
           "split_examples", "split_tokens", "to_devices"]
