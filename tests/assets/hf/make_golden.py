"""Writes the golden tiny Hugging Face checkpoints: transformers' own files and logits, committed
so that the tests of HF load and export run without torch (Python 3.12) against transformers.

    python tests/assets/hf/make_golden.py            # rewrites tests/assets/hf/{gpt2,llama}/
    python tests/assets/hf/make_golden.py OUT        # writes OUT/gpt2/ and OUT/llama/

Needs the `dev` extra's torch 2.13.0 (CPU) and transformers 5.23.0: the files are theirs byte for
byte (config.json records the transformers version), and tests/models/test_hf_golden.py
regenerates them and compares whenever torch is installed.

Each directory is a checkpoint as `save_pretrained` writes it, in bfloat16 as real checkpoints are:

    gpt2/   GPT2LMHeadModel: d 32, 2 layers, 4 heads, 128 positions, tied head;
            model.safetensors (one file)
    llama/  LlamaForCausalLM: d 32, 2 layers, 4 query / 2 key-value heads (GQA), SwiGLU 64,
            untied head; model.safetensors.index.json + 3 shards (partial reads)

plus config.json, generation_config.json, the tokenizer as transformers saves it (the byte-level
BPE of zeroxla.app.tiny_checkpoints, 512 ids with `<|endoftext|>` = 511), and

    golden.json   {"texts": [2 strings], "ids": transformers' ids of each text (no special
                  tokens added), "inputs": [2, T] the first T ids of each}
    logits.npy    float32 [2, T, 512]: transformers' logits of `inputs`, the checkpoint loaded
                  as saved (bf16 weights) and computed in float32

Every weight is drawn at std 0.1 (norm scales around 1; tiny_checkpoints says why) under a fixed
seed, then rounded to bfloat16 once, by the save.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FAMILIES = ("gpt2", "llama")
SEED = 0
WEIGHT_STD = 0.1
LLAMA_SHARD_SIZE = "40KB"      # ~100 KB of bfloat16 weights: an index and 3 shards
INPUT_TOKENS = 12              # T
TEXTS = ("ROMEO:\nBut, soft! what light through yonder window breaks?",
         "First Citizen:\nWe are accounted poor citizens.<|endoftext|>KING RICHARD III:")
GOLDEN_FILE = "golden.json"
LOGITS_FILE = "logits.npy"


def _model(family: str):
    """The random float32 transformers model of `family` (module docstring)."""
    import torch
    import transformers
    from zeroxla.app.tiny_checkpoints import MAX_POSITIONS, eos_id, tokenizer_vocab_size

    common = dict(vocab_size=tokenizer_vocab_size(), bos_token_id=eos_id(),
                  eos_token_id=eos_id())
    if family == "gpt2":
        config = transformers.GPT2Config(n_positions=MAX_POSITIONS, n_embd=32, n_layer=2,
                                         n_head=4, activation_function="gelu_new",
                                         layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0,
                                         tie_word_embeddings=True, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2,
                                          max_position_embeddings=MAX_POSITIONS,
                                          tie_word_embeddings=False, **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_scale = p.ndim == 1 and name.endswith("weight")   # LayerNorm / RMSNorm
            p.copy_(WEIGHT_STD * torch.randn_like(p) + (1.0 if norm_scale else 0.0))
    return model


def write_golden(out_dir: str | Path, family: str) -> Path:
    """Writes the golden checkpoint of `family` into `out_dir` (module docstring); returns it."""
    import torch
    import transformers
    from zeroxla.app.tiny_checkpoints import write_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _model(family)
    model.to(torch.bfloat16).save_pretrained(
        out_dir, max_shard_size=LLAMA_SHARD_SIZE if family == "llama" else "1GB")
    with tempfile.TemporaryDirectory() as trained:          # then saved as transformers saves it
        tokenizer = transformers.AutoTokenizer.from_pretrained(write_tokenizer(trained))
    tokenizer.save_pretrained(out_dir)

    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    inputs = [row[:INPUT_TOKENS] for row in ids]
    record = {"texts": list(TEXTS), "ids": ids, "inputs": inputs}
    lines = ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}" for key, value in record.items())
    (out_dir / GOLDEN_FILE).write_text("{\n" + lines + "\n}\n", encoding="utf-8")

    reference = transformers.AutoModelForCausalLM.from_pretrained(out_dir,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor(inputs, dtype=torch.long)).logits.numpy()
    np.save(out_dir / LOGITS_FILE, logits.astype(np.float32))
    return out_dir


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else HERE
    for family in FAMILIES:
        out = write_golden(root / family, family)
        files = sorted(out.iterdir())
        print(f"{out}: {len(files)} files, {sum(f.stat().st_size for f in files)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
