"""A Hugging Face GPT-2 directory with config.json and the tiny tokenizer, and no weights: for
tests of refusals that must come before any weight is read (a refusal that read them would fail
on the missing files instead)."""

import json
from pathlib import Path

from zeroxla.app.tiny_checkpoints import MAX_POSITIONS, tokenizer_vocab_size, write_tokenizer
from zeroxla.models import GPTConfig
from zeroxla.models.hf_config import to_hf_config


def weightless_gpt2(directory: Path) -> Path:
    """Writes the tokenizer and a 2-layer GPT-2 config.json into `directory`; returns it."""
    write_tokenizer(directory)
    config = GPTConfig(vocab_size=tokenizer_vocab_size(), max_seq_len=MAX_POSITIONS,
                       num_layers=2, d_model=64, num_heads=4, mlp_dim=256)
    (directory / "config.json").write_text(json.dumps(to_hf_config(config)))
    return directory
