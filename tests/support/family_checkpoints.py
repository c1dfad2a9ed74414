"""Tiny random transformers checkpoints for the family tests, written by transformers itself (no
network).

    torch.manual_seed(0); model = AutoModelForCausalLM.from_config(config)
    save_random(model, directory)    # every tensor drawn at random, then save_pretrained
    edit_config(directory, **keys)   # rewrite config.json keys after the save (None deletes)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save_random(model: Any, directory: str | Path) -> Path:
    """Draws every tensor of the transformers `model` from torch's generator, as the caller
    seeded it (norm weights ~1, every other tensor std 0.1, biases nonzero, so no mapping
    hides), saves it to `directory` and returns the path."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = p.ndim == 1 and "norm" in name
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm else 0.0))
    model.save_pretrained(directory)
    return Path(directory)


def edit_config(directory: str | Path, **keys: Any) -> dict[str, Any]:
    """Sets `keys` in `directory`'s config.json (a None value deletes the key), as a hand-edited
    or older config.json would hold them; returns the new contents."""
    path = Path(directory) / "config.json"
    hf = json.loads(path.read_text())
    for key, value in keys.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    path.write_text(json.dumps(hf))
    return hf
