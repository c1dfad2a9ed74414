"""Tiny random Hugging Face checkpoints, built with `transformers` itself, for the tests and the
notebooks, which run without network access: stand-ins for a pretrained model directory
(with network, `AutoModelForCausalLM.from_pretrained("gpt2").save_pretrained(dir)` and its
tokenizer's `save_pretrained(dir)` give a real one). Each is a directory with `config.json`,
float32 safetensors (one file, or an index plus shards) and a real byte-level BPE tokenizer
that `transformers.AutoTokenizer.from_pretrained(dir)` loads. Needs torch and transformers
(the `dev` extra).

    gpt2_checkpoint(tmp_path / "gpt2")                  # GPT2LMHeadModel, 2 layers, d=64
    llama_checkpoint(tmp_path / "llama", sharded=True)  # LlamaForCausalLM, GQA 4 q / 2 kv heads
    gpt2_checkpoint(tmp_path / "rm", reward=True)       # GPT2ForSequenceClassification, 1 label
    write_tokenizer(tmp_path / "tok")                   # the tokenizer files alone

A reward model (`reward=True`: `*ForSequenceClassification`, num_labels=1) is what TRL and
OpenRLHF save: the same base, a bias-free `score` head, and `pad_token_id` = EOS, as a GPT-2
tokenizer without a pad token is padded.

The tokenizer is GPT-2's scheme, trained here: a ByteLevel BPE of 511 tokens on the first 200 KB
of the bundled tiny-shakespeare, plus `<|endoftext|>` as an added special token (id 511), so the
vocabulary is 512. Training is deterministic and takes about a second; it runs once per process.
The weights are drawn under a fixed `torch.manual_seed`, so every call writes the same tensors:
std 0.1 around 0 (norm scales around 1), not transformers' init of std 0.02 (`_randomize`).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from zeroxla.app.data import load_text

EOS_TOKEN = "<|endoftext|>"
BPE_TOKENS = 511                       # + EOS_TOKEN = a vocabulary of 512
CORPUS_CHARS = 200_000
MAX_POSITIONS = 128
SEED = 0
WEIGHT_STD = 0.1                       # every parameter's spread (`_randomize`)
SHARD_SIZE = "100KB"                   # a 2-layer d=64 model is ~0.5 MB: several shards


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """The trained tokenizer as `tokenizers` JSON (cached: training is the slow part)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([load_text()[:CORPUS_CHARS]], trainer)
    tok.add_special_tokens([EOS_TOKEN])
    return tok.to_str()


def tokenizer_vocab_size() -> int:
    """The fixture tokenizer's size, added tokens included (512)."""
    return len(json.loads(_tokenizer_json())["model"]["vocab"]) + 1


def eos_id() -> int:
    """The id of `<|endoftext|>` (the last id)."""
    return tokenizer_vocab_size() - 1


def write_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Writes tokenizer.json and tokenizer_config.json (eos = bos = `<|endoftext|>`, no pad
    token, as GPT-2's) into `out_dir`; returns it. The config names the generic fast tokenizer
    class, which transformers 4.x and 5.x both load."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_POSITIONS,
              "eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
              "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                   encoding="utf-8")
    return out_dir


def _randomize(model) -> None:
    """Draws every parameter afresh: norm scales from N(1, 0.1^2), everything else (biases
    included) from N(0, 0.1^2). At std 0.1 (five times transformers' init) every tensor moves
    the logits far beyond the tests' 1e-4 tolerance, so a wrong mapping (two projections
    swapped, a transpose missed, a bias or norm scale dropped) cannot hide behind small weights
    or an initial zero or one."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_scale = p.ndim == 1 and name.endswith("weight")   # LayerNorm / RMSNorm
            p.copy_(WEIGHT_STD * torch.randn_like(p) + (1.0 if norm_scale else 0.0))


def _save(model, out_dir: Path, sharded: bool) -> Path:
    """Saves `model` in float32 safetensors (sharded: an index plus several files) with the
    tokenizer beside it."""
    _randomize(model)
    model.save_pretrained(out_dir, max_shard_size=SHARD_SIZE if sharded else "1GB")
    write_tokenizer(out_dir)
    return out_dir


def _reward_fields(reward: bool) -> dict:
    """The config fields of a one-label sequence classifier padded with EOS (module docstring)."""
    return {"num_labels": 1, "pad_token_id": eos_id()} if reward else {}


def gpt2_checkpoint(out_dir: str | os.PathLike, *, sharded: bool = False, num_layers: int = 2,
                    reward: bool = False) -> Path:
    """A random GPT2LMHeadModel (n_embd 64, 2 layers, 4 heads, 128 positions, no dropout) with
    the fixture tokenizer, saved in `out_dir`; returns the directory. Its config.json is one
    `models.hf.from_hf_config` accepts (tanh GELU, LayerNorm eps 1e-5, tied head). With
    `reward`, a GPT2ForSequenceClassification reward model of the same shape."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    config = GPT2Config(vocab_size=tokenizer_vocab_size(), n_positions=MAX_POSITIONS, n_embd=64,
                        n_layer=num_layers, n_head=4, activation_function="gelu_new",
                        layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=eos_id(), eos_token_id=eos_id(), tie_word_embeddings=True,
                        **_reward_fields(reward))
    torch.manual_seed(SEED)
    cls = GPT2ForSequenceClassification if reward else GPT2LMHeadModel
    model = cls(config).to(torch.float32).eval()
    return _save(model, Path(out_dir), sharded)


def llama_checkpoint(out_dir: str | os.PathLike, *, sharded: bool = False, num_layers: int = 2,
                     reward: bool = False, max_positions: int = MAX_POSITIONS) -> Path:
    """A random LlamaForCausalLM (hidden 64, 2 layers, 4 query / 2 key-value heads,
    intermediate 128, `max_positions` positions (128), untied head) with the fixture tokenizer,
    saved in `out_dir`; returns the directory. With `reward`, a LlamaForSequenceClassification
    reward model of the same shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=tokenizer_vocab_size(), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, bos_token_id=eos_id(),
                         eos_token_id=eos_id(), **_reward_fields(reward))
    torch.manual_seed(SEED)
    cls = LlamaForSequenceClassification if reward else LlamaForCausalLM
    model = cls(config).to(torch.float32).eval()
    return _save(model, Path(out_dir), sharded)


__all__ = ["EOS_TOKEN", "eos_id", "gpt2_checkpoint", "llama_checkpoint", "tokenizer_vocab_size",
           "write_tokenizer"]
