"""The golden tiny Hugging Face checkpoints of tests/assets/hf, read without torch.

transformers wrote them (tests/assets/hf/make_golden.py: a GPT-2 in one bfloat16 file, a GQA
Llama sharded with an index) with its own logits for a fixed input and its own token ids for two
texts, so tests of HF load and export run on any interpreter and still compare against
transformers. Tensors are read here with `safetensors` directly, not through the code under test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "hf"
FAMILIES = ("gpt2", "llama")
GOLDEN_FILE = "golden.json"          # make_golden.py's names
LOGITS_FILE = "logits.npy"
ATOL = 1e-4                          # float32 logits, ours vs transformers (tests/models/test_hf)


@dataclasses.dataclass(frozen=True)
class Golden:
    """One golden checkpoint: its directory and what transformers computed from it."""

    family: str
    directory: Path
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]       # transformers' ids of each text, no special tokens added
    inputs: np.ndarray                     # int32 [B, T]: the first T ids of each text
    logits: np.ndarray                     # float32 [B, T, V]: transformers' logits of `inputs`


def golden(family: str) -> Golden:
    """The golden checkpoint of `family` ("gpt2" or "llama")."""
    directory = ASSETS / family
    record = json.loads((directory / GOLDEN_FILE).read_text(encoding="utf-8"))
    return Golden(family=family, directory=directory, texts=tuple(record["texts"]),
                  ids=tuple(tuple(row) for row in record["ids"]),
                  inputs=np.asarray(record["inputs"], np.int32),
                  logits=np.load(directory / LOGITS_FILE))


def safetensors_of(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor in the safetensors files of a HF directory, as stored (name -> array)."""
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} is in two files of {directory}"
                tensors[name] = f.get_tensor(name)
    return tensors
