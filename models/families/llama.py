"""Llama (`model_type: llama`, `LlamaForCausalLM`), Llama 2 and 3.x: `models.llama.Llama`.

Also the shared part of the families that are Llama plus options (`qwen2`, `qwen3`, `mistral`):
`llama_fields` reads the config.json keys they share (refusing what is not built, by key),
`llama_hf` writes them, and `tensor_map` names the tensors of every option the config turns on.
Conventions (transformers 5.23 `models/llama/modeling_llama.py`): projections are `nn.Linear`,
weight [out, in], so ours are transposed; checkpoints are in RoPE's rotate-half layout, which
`models.rope.rope` uses, so q/k need no row permutation; a tied head stores no `lm_head`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..hf_rules import LM_HEAD, as_is, as_is_inv, concat, linear
from ..llama import Llama, LlamaConfig
from ..rope import ROPE_TYPES, yarn_attention_factor
from .spec import CAUSAL_LM, SEQUENCE_CLASSIFICATION, Family, Row, require

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's keys besides `factor` (transformers' `_validate_yarn_rope_parameters`), all optional here
# as there: original_max_position_embeddings defaults to max_position_embeddings, beta_fast /
# beta_slow to 32 / 1, truncate to true; attention_factor or mscale / mscale_all_dim to YaRN's.
YARN_KEYS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
             "attention_factor", "mscale", "mscale_all_dim")


def rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE fields from `rope_parameters` (transformers 5.x) or `rope_scaling` + `rope_theta`
    (4.x); a rope_type other than ROPE_TYPES is refused by name.

    Both present: transformers (4.x and 5.x, `convert_rope_params_to_dict`) reads `rope_scaling`
    alone, its rope_theta from the top-level key (else 10000), while other readers take
    `rope_parameters`; they load only when both give the same RoPE, else both are named."""
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    if scaling and parameters:
        read, other = _rope_of("rope_scaling", scaling, hf), _rope_of("rope_parameters",
                                                                        parameters, hf)
        require(read == other, "rope_scaling", scaling,
                f"it disagrees with rope_parameters={parameters!r} (transformers reads "
                f"rope_scaling, with rope_theta={read['rope_theta']}, and ignores rope_parameters;"
                " others read rope_parameters); delete the stale one")
        return read
    return _rope_of("rope_scaling" if scaling else "rope_parameters", scaling or parameters, hf)


def _rope_of(key: str, rope: Mapping[str, Any] | None, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE fields config.json's `key` (holding `rope`) says, as transformers reads it:
    rope_theta and partial_rotary_factor from inside it, else from the top level."""
    rope = dict(rope or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    require(rope_type in ROPE_TYPES, f"{key}.rope_type", rope_type,
            f"accepted: {', '.join(ROPE_TYPES)}")
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    require(factor == 1.0, "partial_rotary_factor", factor, "RoPE rotates the whole head")
    fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
              "rope_type": rope_type}
    if rope_type in ("linear", "llama3", "yarn"):
        require("factor" in rope, f"{key}.factor", None, f"{rope_type} RoPE needs a factor")
        fields["rope_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        for name in LLAMA3_KEYS[1:]:
            require(name in rope, f"{key}.{name}", None, "llama3 RoPE needs " + ", ".join(LLAMA3_KEYS))
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]))
    if rope_type == "yarn":
        fields.update(_yarn_fields(rope, hf, fields["rope_factor"]))
    return fields


def _yarn_fields(rope: Mapping[str, Any], hf: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """The YaRN fields of a `rope_type: yarn` entry, read as transformers 5.23 reads them
    (`standardize_rope_params`: a top-level original_max_position_embeddings wins, else the
    entry's, else max_position_embeddings; `_compute_yarn_parameters`: `or` defaults for the
    betas). mscale / mscale_all_dim are resolved into the attention factor here."""
    original = hf.get("original_max_position_embeddings",
                      rope.get("original_max_position_embeddings", hf["max_position_embeddings"]))
    attention_factor = rope.get("attention_factor")
    if attention_factor is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        attention_factor = yarn_attention_factor(factor, None, rope["mscale"],
                                                 rope["mscale_all_dim"])
    return {"rope_original_max_len": int(original),
            "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
            "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
            "rope_truncate": bool(rope.get("truncate", True)),
            "rope_attention_factor": None if attention_factor is None else float(attention_factor)}


def _yarn_hf(config: LlamaConfig) -> dict[str, Any]:
    """A yarn config's keys of its `rope_parameters` entry besides the type, theta and factor."""
    keys = {"original_max_position_embeddings": config.rope_original_max_len,
            "beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow,
            "truncate": config.rope_truncate}
    if config.rope_attention_factor is not None:
        keys["attention_factor"] = config.rope_attention_factor
    return keys


def llama_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`LlamaConfig` fields of the keys every Llama-like family shares: sizes, SwiGLU, RoPE (with
    scaling), an explicit head_dim and tied embeddings."""
    act = hf.get("hidden_act", "silu")
    require(act == "silu", "hidden_act", act, "the MLP is SwiGLU (silu)")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // h
    return dict(vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
                d_model=d, num_heads=h, num_kv_heads=hf.get("num_key_value_heads") or h,
                num_layers=hf["num_hidden_layers"], mlp_dim=hf["intermediate_size"],
                norm_eps=hf.get("rms_norm_eps", 1e-6), init_std=hf.get("initializer_range", 0.02),
                explicit_head_dim=None if d % h == 0 and head_dim == d // h else head_dim,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                **rope_fields(hf))


QWEN2_SLIDING_RULE = "layer i slides when i >= max_window_layers"


def qwen2_sliding_layers(hf: Mapping[str, Any]) -> list[int]:
    """The layers that slide by Qwen2's and Qwen3's rule (transformers 5.23
    `Qwen2Config.__post_init__`, Qwen3's alike, when `layer_types` is not given): layer i when
    `use_sliding_window`, `sliding_window` is not null and i >= `max_window_layers` (default
    28); so `max_window_layers` >= `num_hidden_layers` slides none."""
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window", 4096) is None:
        return []
    return list(range(hf.get("max_window_layers", 28), hf["num_hidden_layers"]))


def no_sliding_layers(hf: Mapping[str, Any], sliding=qwen2_sliding_layers,
                      rule: str = QWEN2_SLIDING_RULE) -> None:
    """Refuses Qwen's sliding-window layers, not built (the stack has one window for every
    layer). Which layers slide is transformers' rule: `layer_types` when given, else the
    family's `sliding(hf)` (Qwen2's by default; Qwen2-MoE passes its own), stated as `rule` in
    the error."""
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    require(not kinds, "layer_types", hf.get("layer_types"), "only full_attention layers")
    layers = [] if hf.get("layer_types") else sliding(hf)
    if not layers:
        return
    n = hf["num_hidden_layers"]
    if len(layers) == 1:
        which = f"layer {layers[0]} of {n} slides"
    elif layers == list(range(layers[0], layers[-1] + 1)):
        which = f"layers {layers[0]}-{layers[-1]} of {n} slide"
    else:
        which = f"layers {', '.join(map(str, layers))} of {n} slide"
    require(False, "use_sliding_window", hf.get("use_sliding_window"),
            f"with sliding_window={hf.get('sliding_window', 4096)} and max_window_layers="
            f"{hf.get('max_window_layers', 28)}, {which} (transformers: {rule}); Qwen's "
            "sliding-window layers are not built")


def llama_hf(config: LlamaConfig) -> dict[str, Any]:
    """The config.json keys every Llama-like family shares (transformers 4.x reads rope_theta /
    rope_scaling, 5.x reads rope_parameters)."""
    rope = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type != "default":
        rope["factor"] = config.rope_factor
    if config.rope_type == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor,
                    high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_max_len)
    if config.rope_type == "yarn":
        rope.update(_yarn_hf(config))
    scaling = None if config.rope_type == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"}
    return {"model_type": config.family, "vocab_size": config.vocab_size,
            "hidden_size": config.d_model, "intermediate_size": config.mlp_dim,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "hidden_act": "silu", "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps, "initializer_range": config.init_std,
            "tie_word_embeddings": config.tie_word_embeddings, "rope_theta": config.rope_theta,
            "rope_scaling": scaling, "rope_parameters": rope}


def from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    return LlamaConfig(qkv_bias=attention, o_bias=attention, mlp_bias=mlp, **llama_fields(hf))


def to_hf(config: LlamaConfig) -> dict[str, Any]:
    return {**llama_hf(config), "attention_bias": config.o_bias, "mlp_bias": config.mlp_bias}


def tensor_map(c: LlamaConfig) -> list[Row]:
    """Every tensor of a Llama-like checkpoint whose option `c` turns on."""
    d, h, g, k, f, v = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.vocab_size
    same = (as_is, as_is_inv)
    att, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    rows = [
        ("model.embed_tokens.weight", ("embed/weight",), same),           # [V, D]
        ("model.layers.{i}.input_layernorm.weight", ("attn_norm/scale",), same),
        (att + "q_proj.weight", ("wq",), linear((d, h, k), 1)),           # [H*K, D]
        (att + "k_proj.weight", ("wk",), linear((d, g, k), 1)),           # [G*K, D]
        (att + "v_proj.weight", ("wv",), linear((d, g, k), 1)),           # [G*K, D]
        (att + "o_proj.weight", ("wo",), linear((h, k, d), 2)),           # [D, H*K]
        ("model.layers.{i}.post_attention_layernorm.weight", ("mlp_norm/scale",), same),
        (mlp + "gate_proj.weight", ("w_gate",), linear((d, f), 1)),       # [F, D]
        (mlp + "up_proj.weight", ("w_up",), linear((d, f), 1)),           # [F, D]
        (mlp + "down_proj.weight", ("w_down",), linear((f, d), 1)),       # [D, F]
        ("model.norm.weight", ("head/norm/scale",), same),
    ]
    if c.qkv_bias:
        rows += [(att + "q_proj.bias", ("bq",), concat(((h, k),), ((h * k,),))),   # [H*K]
                 (att + "k_proj.bias", ("bk",), concat(((g, k),), ((g * k,),))),   # [G*K]
                 (att + "v_proj.bias", ("bv",), concat(((g, k),), ((g * k,),)))]
    if c.o_bias:
        rows.append((att + "o_proj.bias", ("bo",), same))                 # [D]
    if c.qk_norm:
        rows += [(att + "q_norm.weight", ("q_norm/scale",), same),        # [K]
                 (att + "k_norm.weight", ("k_norm/scale",), same)]
    if c.mlp_bias:
        rows += [(mlp + "gate_proj.bias", ("b_gate",), same), (mlp + "up_proj.bias", ("b_up",), same),
                 (mlp + "down_proj.bias", ("b_down",), same)]
    if not c.tie_word_embeddings:
        rows.append((LM_HEAD, ("head/weight",), linear((d, v), 1)))       # [V, D]
    return rows


def architectures(prefix: str) -> dict[str, str]:
    """The transformers classes of a Llama-like family named `prefix` (e.g. "Qwen2")."""
    return {CAUSAL_LM: f"{prefix}ForCausalLM",
            SEQUENCE_CLASSIFICATION: f"{prefix}ForSequenceClassification"}


SPEC = Family("llama", LlamaConfig, Llama, architectures("Llama"), from_hf, to_hf, tensor_map,
              {"llama-tiny": LlamaConfig.tiny, "llama-small": LlamaConfig.small,
               "llama-1b": LlamaConfig.llama_1b, "llama-7b": LlamaConfig.llama_7b})
