"""Hugging Face `config.json` <-> our model configs (GPTConfig, LlamaConfig), with the options
our models do not implement refused by key (the tensors: `models.hf`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .gpt import GPTConfig
from .llama import LlamaConfig
from .safetensors_io import _np_dtype

Config = GPTConfig | LlamaConfig

_GPT_LN_EPS = 1e-5            # models.layers.LayerNorm's eps, which GPT uses
_GPT_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")   # all the tanh approximation


def to_hf_config(config: Config, *, dtype: Any = "float32", **overrides) -> dict[str, Any]:
    """`config.json` contents for `config` (read by transformers 4.x and 5.x); `overrides`
    add or replace keys (e.g. `bos_token_id=...`)."""
    dtype_name = np.dtype(_np_dtype(dtype)).name
    if config.family == "gpt2":
        hf = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": config.vocab_size, "n_positions": config.max_seq_len,
            "n_embd": config.d_model, "n_layer": config.num_layers, "n_head": config.num_heads,
            "n_inner": config.mlp_dim, "activation_function": "gelu_new",
            "layer_norm_epsilon": _GPT_LN_EPS, "initializer_range": config.init_std,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": True,
            # Our model has no dropout; HF's 0.1 defaults would change fine-tuning there.
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            # GPT-2's BPE <|endoftext|>; only meaningful with that vocabulary.
            "bos_token_id": 50256 if config.vocab_size > 50256 else None,
            "eos_token_id": 50256 if config.vocab_size > 50256 else None,
        }
    elif config.family == "llama":
        hf = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
            "initializer_range": config.init_std, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False,
            # transformers 4.x reads rope_theta / rope_scaling, 5.x reads rope_parameters.
            "rope_theta": config.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        }
    else:
        raise ValueError(f"no Hugging Face config for family {config.family!r}")
    hf["torch_dtype"] = hf["dtype"] = dtype_name     # 4.x and 5.x spellings
    hf.update(overrides)
    return hf


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"config.json {key}={value!r} is not supported: {why}")


def from_hf_config(hf: Mapping[str, Any]) -> Config:
    """Our GPTConfig / LlamaConfig from a HF `config.json` dict; raises ValueError on options our
    models do not implement. A tied Llama (`tie_word_embeddings=true`) is accepted: its head is
    loaded as a copy of the embedding and trains untied from then on."""
    model_type = hf.get("model_type")
    if model_type == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        _require(act in _GPT_GELUS, "activation_function", act, f"GPT uses tanh GELU {_GPT_GELUS}")
        eps = hf.get("layer_norm_epsilon", 1e-5)
        _require(eps == _GPT_LN_EPS, "layer_norm_epsilon", eps,
                 f"GPT's LayerNorm uses {_GPT_LN_EPS}")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False), ("tie_word_embeddings", True)):
            _require(hf.get(key, want) == want, key, hf.get(key), f"GPT needs {key}={want}")
        d = hf["n_embd"]
        return GPTConfig(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], d_model=d,
                         num_heads=hf["n_head"], num_layers=hf["n_layer"],
                         mlp_dim=hf.get("n_inner") or 4 * d,
                         init_std=hf.get("initializer_range", 0.02))
    if model_type == "llama":
        act = hf.get("hidden_act", "silu")
        _require(act == "silu", "hidden_act", act, "Llama's MLP is SwiGLU (silu)")
        for key in ("attention_bias", "mlp_bias"):
            _require(not hf.get(key, False), key, hf.get(key), "our Llama has no biases")
        d, h = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d // h
        _require(head_dim == d // h, "head_dim", head_dim,
                 f"our Llama's head_dim is hidden_size // num_attention_heads = {d // h}")
        rope = dict(hf.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        _require(rope_type == "default", "rope_parameters.rope_type", rope_type,
                 "only plain RoPE is implemented (no scaling)")
        scaling = hf.get("rope_scaling")
        _require(not scaling or scaling.get("rope_type", scaling.get("type")) == "default",
                 "rope_scaling", scaling, "only plain RoPE is implemented (no scaling)")
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        _require(factor == 1.0, "partial_rotary_factor", factor, "RoPE rotates the whole head")
        return LlamaConfig(vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
                           d_model=d, num_heads=h,
                           num_kv_heads=hf.get("num_key_value_heads") or h,
                           num_layers=hf["num_hidden_layers"], mlp_dim=hf["intermediate_size"],
                           rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                           norm_eps=hf.get("rms_norm_eps", 1e-6),
                           init_std=hf.get("initializer_range", 0.02))
    raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                     "zeroxla reads 'gpt2' and 'llama'")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` dict of a HF checkpoint directory (or of the directory holding a
    `.safetensors` file), with a FileNotFoundError naming what is missing."""
    path = Path(path)
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.exists():
        what = "directory" if path.is_dir() else "path"
        raise FileNotFoundError(f"{what} {path} has no config.json: a Hugging Face checkpoint "
                                "directory holds config.json and model.safetensors (or "
                                "model.safetensors.index.json and its shards)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e


__all__ = ["from_hf_config", "read_hf_config", "to_hf_config"]
