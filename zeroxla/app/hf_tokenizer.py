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
`tokenizers` comes with `transformers`; it is imported only here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zeroxla.app.tokenizer import ByteTokenizer, CharTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
FILE_MODE = 0o644


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


__all__ = ["FILE_MODE", "TOKENIZER_CONFIG_FILE", "TOKENIZER_FILE", "bytes_to_unicode",
           "hf_tokenizer", "save_hf_tokenizer"]
