"""Hugging Face `config.json` <-> our model configs (GPTConfig, LlamaConfig), with the options
our models do not implement refused by key (the tensors: `models.hf`), and the head a checkpoint
carries (`hf_head`, from `architectures`).

Two heads are read and written: a causal LM (`GPT2LMHeadModel`, `LlamaForCausalLM`: our models
as they are) and a sequence classifier with one label (`GPT2ForSequenceClassification`,
`LlamaForSequenceClassification`, `num_labels=1`: a reward or value model, which TRL, OpenRLHF
and verl load as such; ours is `zeroxla.rlhf.RewardModel`). Any other head is refused by name.
"""

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

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
# head -> family -> the transformers class that config.json's `architectures` names.
ARCHITECTURES = {
    CAUSAL_LM: {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"},
    SEQUENCE_CLASSIFICATION: {"gpt2": "GPT2ForSequenceClassification",
                              "llama": "LlamaForSequenceClassification"},
}
# (class-name suffix, head kind), first match wins; the kinds after the first two are refused.
_HEAD_SUFFIXES = (("ForCausalLM", CAUSAL_LM), ("LMHeadModel", CAUSAL_LM),
                  ("ForSequenceClassification", SEQUENCE_CLASSIFICATION),
                  ("ForTokenClassification", "token_classification"),
                  ("ForQuestionAnswering", "question_answering"),
                  ("DoubleHeadsModel", "double_heads"))
HEAD_NAMES = {CAUSAL_LM: "a causal LM", SEQUENCE_CLASSIFICATION:
              "a sequence-classification (reward) model",
              "token_classification": "a token-classification model",
              "question_answering": "a question-answering model",
              "double_heads": "a double-heads (LM + multiple choice) model",
              "base": "a base model whose checkpoint holds no LM head (untied)",
              "other": "a model whose head zeroxla does not read"}

_GPT_LN_EPS = 1e-5            # models.layers.LayerNorm's eps, which GPT uses
_GPT_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")   # all the tanh approximation


def to_hf_config(config: Config, *, dtype: Any = "float32", head: str = CAUSAL_LM,
                 **overrides) -> dict[str, Any]:
    """`config.json` contents for `config` (read by transformers 4.x and 5.x) with `head`
    (CAUSAL_LM, or SEQUENCE_CLASSIFICATION with one label); `overrides` add or replace keys
    (e.g. `bos_token_id=...`, a classifier's `pad_token_id`)."""
    if head not in ARCHITECTURES:
        raise ValueError(f"head={head!r} is invalid; accepted: {', '.join(ARCHITECTURES)}")
    dtype_name = np.dtype(_np_dtype(dtype)).name
    if config.family == "gpt2":
        hf = {
            "model_type": "gpt2",
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
            "model_type": "llama",
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
    hf["architectures"] = [ARCHITECTURES[head][config.family]]
    if head == SEQUENCE_CLASSIFICATION:            # num_labels=1, as transformers spells it
        hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
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


def architecture(hf: Mapping[str, Any]) -> str | None:
    """The class config.json's `architectures` names (its first entry), or None."""
    names = hf.get("architectures") or [None]
    return names[0]


def hf_head(hf: Mapping[str, Any]) -> str:
    """The head of a HF config: CAUSAL_LM, SEQUENCE_CLASSIFICATION, or another kind of
    HEAD_NAMES, read from the suffix of its `architectures` class. A config without
    `architectures` counts as a causal LM (our configs always write it; the tensors decide), and
    so does a bare base model (`GPT2Model`) whose LM head is its tied embedding."""
    name = architecture(hf)
    if name is None:
        return CAUSAL_LM
    kind = next((kind for suffix, kind in _HEAD_SUFFIXES if name.endswith(suffix)), "other")
    if kind == "other" and name.endswith("Model"):
        tied = hf.get("tie_word_embeddings", hf.get("model_type") == "gpt2")   # their defaults
        return CAUSAL_LM if tied else "base"
    return kind


def num_labels(hf: Mapping[str, Any]) -> int:
    """A classifier's label count: `id2label`'s size, else `num_labels`, else transformers'
    default of 2."""
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def check_head(hf: Mapping[str, Any], accepted: tuple[str, ...], *, user: str,
               instead: str) -> str:
    """`hf_head(hf)` when it is one of `accepted` (a sequence classifier only with one label);
    otherwise a ValueError naming the `architectures` class, what it is, what `user` (e.g.
    "`zeroxla train`") needs and what to use `instead`. Reads nothing but the config."""
    head, name = hf_head(hf), architecture(hf)
    needs = " or ".join(f"{HEAD_NAMES[h]} ({', '.join(sorted(ARCHITECTURES[h].values()))})"
                        for h in accepted)
    if head not in accepted:
        raise ValueError(f"config.json architectures={hf.get('architectures')!r}: {name} is "
                         f"{HEAD_NAMES[head]}; {user} needs {needs}; {instead}")
    if head == SEQUENCE_CLASSIFICATION and num_labels(hf) != 1:
        raise ValueError(f"config.json of {name} has num_labels={num_labels(hf)} (id2label="
                         f"{hf.get('id2label')!r}); {user} needs num_labels=1: a reward model's "
                         "one score per sequence")
    return head


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


__all__ = ["ARCHITECTURES", "CAUSAL_LM", "HEAD_NAMES", "SEQUENCE_CLASSIFICATION", "architecture",
           "check_head", "from_hf_config", "hf_head", "num_labels", "read_hf_config",
           "to_hf_config"]
