"""Our tokenizers as Hugging Face tokenizer files, so an exported model comes with its vocabulary.

    save_hf_tokenizer(CharTokenizer("abc..."), "hf_out", model_max_length=128)
    transformers.AutoTokenizer.from_pretrained("hf_out")        # decode(encode(t)) == t

Both are written as a `tokenizers` JSON (tokenizer.json) plus a tokenizer_config.json naming the
generic fast tokenizer class, with ids identical to ours:

    char   WordLevel over the characters (id i = chars[i]); a Split pre-tokenizer isolates every
           character (`[\\s\\S]`: newlines too); the Fuse decoder joins them with nothing between
    byte   GPT-2's byte-level scheme with an empty merge list: ByteLevel maps each UTF-8 byte to a
           printable stand-in character, BPE looks the characters up (id = the byte value), and
           the ByteLevel decoder maps them back to bytes

No normalizer, no added tokens, and `clean_up_tokenization_spaces` off, so decoding returns the
text exactly. A character outside a char vocabulary is an encoding error, as in `CharTokenizer`.
`tokenizers` (a dependency in pyproject.toml) is imported lazily, here and in `tiny_checkpoints`.

The other direction, `PretrainedTokenizer.from_dir(checkpoint_dir)`, reads a pretrained model's
fast-tokenizer files (tokenizer.json, plus the special tokens of tokenizer_config.json and
special_tokens_map.json) so that fine-tuning a Hugging Face checkpoint tokenizes as it was trained;
it keeps those files' text, which `record()` carries inside our checkpoints and `save` writes back
next to an exported model (`save_tokenizer` writes any of our tokenizers).

An exported reward model needs one thing more: transformers scores a row at its last token that
is not `config.pad_token_id`, so that id must be one no real sequence holds, and the tokenizer
must pad with it. Our reward data ends every answer with EOS and pads with EOS when the
tokenizer has no pad token (GPT-2's), so EOS cannot be it (transformers would score the token
before it). `reward_pad_id` picks the id (`add_pad_token` writes a new one):

    the tokenizer's own pad token, when it has one that is not EOS or BOS;
    else a new special token PAD_TOKEN at the first id the tokenizer does not produce: a spare
    embedding row when the model's vocabulary is larger, else a new zero row (the exported
    vocabulary grows by one; every real token's output is unchanged).

Then a batch without padding is scored at its true last token, and `tokenizer(..., padding=True)`
pads with `pad_token_id`, so a padded batch is scored at each row's last real token: our score.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zeroxla.app.tokenizers.basic import ByteTokenizer, CharTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"     # transformers 5 writes the chat template here
FILE_MODE = 0o644
PAD_TOKEN = "<|pad|>"          # the pad token an exported reward model gets when it needs one


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (openai/gpt-2 `encoder.py`), the
    alphabet of the `tokenizers` ByteLevel pre-tokenizer: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def hf_tokenizer(tokenizer: CharTokenizer | ByteTokenizer) -> Any:
    """The `tokenizers.Tokenizer` that encodes and decodes exactly as `tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if isinstance(tokenizer, CharTokenizer):
        vocab = {c: i for i, c in enumerate(tokenizer.chars)}
        hf = Tokenizer(models.WordLevel(vocab, unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()
        return hf
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        hf = Tokenizer(models.BPE(vocab, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
        return hf
    raise TypeError(f"hf_tokenizer: {type(tokenizer).__name__} is not CharTokenizer or "
                    "ByteTokenizer")


def save_hf_tokenizer(tokenizer: CharTokenizer | ByteTokenizer, out_dir: str | os.PathLike, *,
                      model_max_length: int) -> list[Path]:
    """Writes tokenizer.json and tokenizer_config.json (mode 0644) into `out_dir`; returns them.

    `model_max_length` is the model's context length (transformers warns beyond it).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / TOKENIZER_FILE, out_dir / TOKENIZER_CONFIG_FILE]
    hf_tokenizer(tokenizer).save(str(files[0]))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False,
              "add_eos_token": False}
    files[1].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for path in files:
        path.chmod(FILE_MODE)
    return files


# ----------------------------------------------------------------------------- reading theirs

# The special tokens we read, by their key in tokenizer_config.json / special_tokens_map.json.
SPECIAL_TOKEN_KEYS = ("eos_token", "pad_token", "bos_token")
# The tokenizer files we read, in reading order (the map is read second and wins, as in
# transformers); only tokenizer.json is required.
PRETRAINED_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE,
                    CHAT_TEMPLATE_FILE)
# The tokenizer class we name when the source had no tokenizer_config.json.
GENERIC_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
RECORD_KIND = "hf"


def _json_object(text: str, where: str) -> dict[str, Any]:
    """The JSON object `text` (the file `where`); ValueError naming the file when it is not one."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} holds a JSON {type(record).__name__}; accepted: an object")
    return record


def _token_content(value: Any, where: str) -> str:
    """A special token as transformers writes it: a string, or an AddedToken record
    `{"content": "<|endoftext|>", "special": true, ...}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}={value!r} is invalid; accepted: a string or an object with a "
                     "string 'content'")


def _special_tokens(files: dict[str, str], source: str) -> dict[str, str]:
    """{key: token string} for the SPECIAL_TOKEN_KEYS in the config files among `files`
    (name -> text); a null value counts as absent."""
    tokens: dict[str, str] = {}
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        if name in files:
            record = _json_object(files[name], f"{source}/{name}")
            for key in SPECIAL_TOKEN_KEYS:
                if record.get(key) is not None:
                    tokens[key] = _token_content(record[key], f"{source}/{name} {key}")
    return tokens


def _parse_tokenizer(text: str, where: str) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json text, truncation and padding off."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:    # the Rust library raises plain Exception on a bad file
        raise ValueError(f"{where} is not a tokenizers JSON file: {err}") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@dataclasses.dataclass(frozen=True)
class PretrainedTokenizer:
    """A pretrained checkpoint's fast tokenizer (`tokenizers.Tokenizer`), with the members of
    the `zeroxla.app.tokenizers.basic.Tokenizer` protocol plus its special-token ids.

    Build it with `from_dir(checkpoint_dir)`. It keeps the text of the files it was read from,
    so `save` writes them back unchanged and `record()` (stored in our checkpoints) is
    self-contained. `encode` adds no special tokens (no BOS a post-processor would insert: the
    data pipeline places EOS itself) and `decode` returns the tokens' text exactly (special tokens
    kept, no `clean_up_tokenization_spaces`, transformers 5's default). Truncation and padding
    stored in tokenizer.json are switched off: the data pipeline checks lengths and pads itself.
    """

    tokenizer: Any = dataclasses.field(compare=False, repr=False)   # tokenizers.Tokenizer
    files: tuple[tuple[str, str], ...] = dataclasses.field(repr=False)  # ((name, text), ...)
    # Where it was read from (a directory), for messages; not part of equality: the same files
    # read from two places are the same tokenizer.
    source: str = dataclasses.field(default="", compare=False)
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token: str | None = None

    def __post_init__(self) -> None:
        for key in SPECIAL_TOKEN_KEYS:
            token = getattr(self, key)
            if token is not None and self.tokenizer.token_to_id(token) is None:
                raise ValueError(f"{key}={token!r} (from {self.source}) is not in the "
                                 f"vocabulary of its {TOKENIZER_FILE}; accepted: a token of "
                                 "tokenizer.json (or no such key)")

    @classmethod
    def from_files(cls, files: dict[str, str], source: str) -> "PretrainedTokenizer":
        """The tokenizer of the file texts `files` (name -> text; tokenizer.json required,
        tokenizer_config.json and special_tokens_map.json read for special tokens)."""
        if TOKENIZER_FILE not in files:
            raise ValueError(f"no {TOKENIZER_FILE} in {source}; accepted: HF fast-tokenizer files")
        tokenizer = _parse_tokenizer(files[TOKENIZER_FILE], f"{source}/{TOKENIZER_FILE}")
        kept = tuple((name, files[name]) for name in PRETRAINED_FILES if name in files)
        return cls(tokenizer=tokenizer, files=kept, source=source,
                   **_special_tokens(files, source))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "PretrainedTokenizer":
        """The tokenizer of the checkpoint directory `path` (its tokenizer.json, and the special
        tokens of tokenizer_config.json / special_tokens_map.json when present)."""
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {directory} does not exist; accepted: a "
                                    "Hugging Face checkpoint directory with a tokenizer.json")
        if not (directory / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {directory}; zeroxla reads HF fast-tokenizer files (a "
                "slow tokenizer's vocab.json/merges.txt or tokenizer.model can be converted with "
                "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
        files = {}
        for name in PRETRAINED_FILES:
            if (directory / name).is_file():
                try:        # bytes, not read_text: keep the file's line endings exactly
                    files[name] = (directory / name).read_bytes().decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{directory / name} is not UTF-8 ({err.reason})") from None
        return cls.from_files(files, str(directory))

    def record(self) -> dict[str, Any]:
        """A JSON-able, self-contained description stored in checkpoints:
        {"kind": "hf", "source": ..., "files": {name: text}}. Inverse: `from_record`."""
        return {"kind": RECORD_KIND, "source": self.source, "files": dict(self.files)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "PretrainedTokenizer":
        """The tokenizer a `record()` describes."""
        if record.get("kind") != RECORD_KIND or not isinstance(record.get("files"), dict):
            raise ValueError(f"tokenizer record kind={record.get('kind')!r} with files of type "
                             f"{type(record.get('files')).__name__} is invalid; accepted: "
                             f"kind={RECORD_KIND!r} with files {{name: text}}")
        return cls.from_files(record["files"], record.get("source") or "a checkpoint record")

    @functools.cached_property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer can produce: its largest id + 1, added tokens
        included (the token count when ids are dense, as they are in practice)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def eos_id(self) -> int | None:
        """The id of the end-of-sequence token, or None when the checkpoint names none."""
        return self._id(self.eos_token)

    @property
    def bos_id(self) -> int | None:
        """The id of the beginning-of-sequence token, or None when the checkpoint names none."""
        return self._id(self.bos_token)

    @property
    def pad_id(self) -> int:
        """The id that fills padding: the pad token's, else the eos token's (GPT-2 has no pad
        token; DeepSpeed-Chat pads with eos), else 0. Padding is always masked out of losses
        and attention, so the choice changes no result."""
        for token in (self.pad_token, self.eos_token):
            if token is not None:
                return self.tokenizer.token_to_id(token)
        return 0

    def encode(self, text: str) -> np.ndarray:
        """`text` -> int32[N], no special tokens added."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32).reshape(-1)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """int ids -> text (special tokens kept); raises a ValueError naming an id outside
        [0, vocab_size), which `tokenizers` would silently drop."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary "
                             f"[0, {self.vocab_size}) of the tokenizer in {self.source}")
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def check_vocab(self, model_vocab_size: int, where: str) -> None:
        """Raises a ValueError when the tokenizer can produce an id the model has no embedding
        row for (`model_vocab_size` read from `where`, e.g. "config.json"). A model vocabulary
        larger than the tokenizer's is fine: checkpoints often pad it to a round number."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"tokenizer in {self.source} has {self.vocab_size} ids but {where} "
                             f"vocab_size={model_vocab_size}: the checkpoint and its tokenizer "
                             "do not match")

    def save(self, out_dir: str | os.PathLike) -> list[Path]:
        """Writes the tokenizer files it was read from, unchanged, into `out_dir` (mode 0644),
        so that `transformers.AutoTokenizer.from_pretrained(out_dir)` loads the same tokenizer;
        writes a minimal tokenizer_config.json naming the special tokens when the source had
        none. Returns the files written."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        texts = dict(self.files)
        if TOKENIZER_CONFIG_FILE not in texts:
            config = {"tokenizer_class": GENERIC_TOKENIZER_CLASS,
                      "clean_up_tokenization_spaces": False}
            config.update({key: getattr(self, key) for key in SPECIAL_TOKEN_KEYS
                           if getattr(self, key) is not None})
            texts[TOKENIZER_CONFIG_FILE] = json.dumps(config, indent=2) + "\n"
        written = []
        for name, text in texts.items():
            written.append(out_dir / name)
            written[-1].write_bytes(text.encode("utf-8"))
            written[-1].chmod(FILE_MODE)
        return written


def save_tokenizer(tokenizer: CharTokenizer | ByteTokenizer | PretrainedTokenizer,
                   out_dir: str | os.PathLike, *, model_max_length: int) -> list[Path]:
    """Writes any of our tokenizers as HF tokenizer files into `out_dir`; returns them. A
    pretrained tokenizer's own files are written back unchanged (their `model_max_length`
    stands); ours are generated (`save_hf_tokenizer`)."""
    if isinstance(tokenizer, PretrainedTokenizer):
        return tokenizer.save(out_dir)
    return save_hf_tokenizer(tokenizer, out_dir, model_max_length=model_max_length)


def reward_pad_id(tokenizer: Any, vocab_size: int) -> tuple[int, bool]:
    """(pad id, whether PAD_TOKEN must be added to the tokenizer as that id) for a reward model
    of `vocab_size` ids whose data `tokenizer` (or None: no tokenizer recorded) produces; see
    the module docstring. The id is `vocab_size` when a new embedding row is needed."""
    if tokenizer is None:
        return vocab_size, False
    special = {getattr(tokenizer, "eos_token", None), getattr(tokenizer, "bos_token", None)}
    if isinstance(tokenizer, PretrainedTokenizer) and tokenizer.pad_token not in special | {None}:
        return tokenizer.pad_id, False
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the checkpoint's tokenizer has {tokenizer.vocab_size} ids, its model "
                         f"vocab_size={vocab_size}: they do not match")
    return tokenizer.vocab_size, True


def add_pad_token(out_dir: str | os.PathLike, pad_id: int) -> list[Path]:
    """Adds the special token PAD_TOKEN to the tokenizer files in `out_dir` as id `pad_id` (the
    next id it has) and names it the pad token (tokenizer_config.json, and
    special_tokens_map.json when present); returns the files rewritten (mode 0644)."""
    from tokenizers import AddedToken, Tokenizer

    out_dir = Path(out_dir)
    file = out_dir / TOKENIZER_FILE
    tokenizer = Tokenizer.from_str(file.read_text(encoding="utf-8"))
    if tokenizer.token_to_id(PAD_TOKEN) is not None:
        raise ValueError(f"{file} already holds {PAD_TOKEN!r} (id "
                         f"{tokenizer.token_to_id(PAD_TOKEN)}) but does not pad with it")
    tokenizer.add_special_tokens([AddedToken(PAD_TOKEN, special=True, normalized=False)])
    if tokenizer.token_to_id(PAD_TOKEN) != pad_id:
        raise ValueError(f"{file}: {PAD_TOKEN!r} gets id {tokenizer.token_to_id(PAD_TOKEN)}, not "
                         f"the model's pad_token_id {pad_id}: the tokenizer's ids have a gap")
    file.write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    written = [file]
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        path = out_dir / name
        if path.is_file():
            record = json.loads(path.read_text(encoding="utf-8"))
            record["pad_token"] = PAD_TOKEN
            if isinstance(record.get("added_tokens_decoder"), dict):     # transformers' own
                record["added_tokens_decoder"][str(pad_id)] = {
                    "content": PAD_TOKEN, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": True}
            path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            written.append(path)
    for path in written:
        path.chmod(FILE_MODE)
    return written


__all__ = ["CHAT_TEMPLATE_FILE", "FILE_MODE", "GENERIC_TOKENIZER_CLASS", "PAD_TOKEN",
           "PRETRAINED_FILES", "PretrainedTokenizer", "SPECIAL_TOKENS_MAP_FILE", "SPECIAL_TOKEN_KEYS",
           "TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE", "add_pad_token", "bytes_to_unicode",
           "hf_tokenizer", "reward_pad_id", "save_hf_tokenizer", "save_tokenizer"]
