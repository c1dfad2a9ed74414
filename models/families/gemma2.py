"""Gemma 2 (`model_type: gemma2`, `Gemma2ForCausalLM`): `models.gemma2.Gemma2`.

transformers 5.23 `models/gemma2/`: nn.Linear projections without bias, norms stored as `w` of
`(1 + w)`, `layer_types` alternating with the even layers sliding, the head tied. Our stack's
block `i` is the HF layers 2i (`local`) and 2i + 1 (`glob`). What the module does not build is
refused by key: another layer pattern, an odd layer count, biases, an untied head, another
activation, scaled RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..gemma2 import Gemma2, Gemma2Config
from ..hf_rules import as_is, as_is_inv, linear
from .llama import rope_fields
from .spec import CAUSAL_LM, SEQUENCE_CLASSIFICATION, Family, Row, require

GELU = "gelu_pytorch_tanh"


def alternating(num_hidden_layers: int) -> list[str]:
    """transformers' Gemma 2 layer_types: even layers sliding, odd ones global."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(num_hidden_layers)]


def from_hf(hf: Mapping[str, Any]) -> Gemma2Config:
    n = hf["num_hidden_layers"]
    require(n % 2 == 0, "num_hidden_layers", n, "layers come in (sliding, global) pairs")
    types = hf.get("layer_types") or alternating(n)
    require(list(types) == alternating(n), "layer_types", types,
            "sliding and global layers alternating, even layers sliding")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU
    require(act == GELU, "hidden_activation", act, f"the MLP is GeGLU with {GELU}")
    for key, accepted in (("attention_bias", (False,)), ("tie_word_embeddings", (True,)),
                          ("use_bidirectional_attention", (None, False))):
        value = hf.get(key, accepted[0])
        require(value in accepted, key, value, f"Gemma 2 is built with {key}={accepted[0]}")
    window = hf.get("sliding_window", 4096)
    require(isinstance(window, int) and window >= 1, "sliding_window", window, "an integer >= 1")
    rope = rope_fields(hf)
    require(rope["rope_type"] == "default", "rope_parameters.rope_type", rope["rope_type"],
            "Gemma 2 uses plain RoPE")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // h
    return Gemma2Config(
        vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"], d_model=d,
        num_heads=h, num_kv_heads=hf.get("num_key_value_heads") or h, num_layers=n // 2,
        mlp_dim=hf["intermediate_size"],
        explicit_head_dim=None if d % h == 0 and head_dim == d // h else head_dim,
        rope_theta=rope["rope_theta"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        init_std=hf.get("initializer_range", 0.02),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_softcap=hf.get("attn_logit_softcapping", 50.0),
        final_softcap=hf.get("final_logit_softcapping", 30.0), sliding_window=window)


def shared_hf_keys(config: Gemma2Config) -> dict[str, Any]:
    """The config.json keys Gemma 2 and Gemma 3 (a `Gemma2Config` subclass) write alike: sizes,
    norms, the tied head, the soft-capping and the window."""
    return {"vocab_size": config.vocab_size,
            "hidden_size": config.d_model, "intermediate_size": config.mlp_dim,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "hidden_activation": GELU, "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps, "initializer_range": config.init_std,
            "tie_word_embeddings": True, "attention_bias": False,
            "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "attn_logit_softcapping": config.attn_softcap,
            "final_logit_softcapping": config.final_softcap,
            "sliding_window": config.sliding_window}


def to_hf(config: Gemma2Config) -> dict[str, Any]:
    n = 2 * config.num_layers
    return {"model_type": "gemma2", **shared_hf_keys(config), "num_hidden_layers": n,
            "layer_types": alternating(n),
            "rope_theta": config.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}


def layer_rows(layer: str, ours: str, d: int, h: int, g: int, k: int, f: int, *,
               qk_norm: bool = False, with_v: bool = True) -> list[Row]:
    """One Gemma decoder layer's tensors (Gemma 2, 3 and 4 share it: four norms around the
    attention and the MLP): `layer` the HF name prefix, `ours` our path; d model, h query heads,
    g key/value heads of head dim k, f the MLP's width; `qk_norm` adds the per-head q/k norms
    (Gemma 3, 4), `with_v` False leaves out the value projection (Gemma 4's k = v layers)."""
    same = (as_is, as_is_inv)
    rows = [
        (layer + "input_layernorm.weight", (ours + "attn_norm/scale",), same),
        (layer + "post_attention_layernorm.weight", (ours + "attn_post_norm/scale",), same),
        (layer + "pre_feedforward_layernorm.weight", (ours + "mlp_norm/scale",), same),
        (layer + "post_feedforward_layernorm.weight", (ours + "mlp_post_norm/scale",), same),
        (layer + "self_attn.q_proj.weight", (ours + "wq",), linear((d, h, k), 1)),
        (layer + "self_attn.k_proj.weight", (ours + "wk",), linear((d, g, k), 1)),
    ]
    if with_v:
        rows.append((layer + "self_attn.v_proj.weight", (ours + "wv",), linear((d, g, k), 1)))
    rows.append((layer + "self_attn.o_proj.weight", (ours + "wo",), linear((h, k, d), 2)))
    if qk_norm:
        rows += [(layer + "self_attn.q_norm.weight", (ours + "q_norm/scale",), same),
                 (layer + "self_attn.k_norm.weight", (ours + "k_norm/scale",), same)]
    return rows + [
        (layer + "mlp.gate_proj.weight", (ours + "w_gate",), linear((d, f), 1)),
        (layer + "mlp.up_proj.weight", (ours + "w_up",), linear((d, f), 1)),
        (layer + "mlp.down_proj.weight", (ours + "w_down",), linear((f, d), 1)),
    ]


def tensor_map(c: Gemma2Config) -> list[Row]:
    same = (as_is, as_is_inv)
    rows: list[Row] = [("model.embed_tokens.weight", ("embed/weight",), same),   # [V, D]
                       ("model.norm.weight", ("norm/scale",), same)]
    for half, ours in ((0, "local/"), (1, "glob/")):
        rows += layer_rows(f"model.layers.{{pair[{half}]}}.", ours, c.d_model, c.num_heads,
                           c.num_kv_heads, c.head_dim, c.mlp_dim)
    return rows


SPEC = Family("gemma2", Gemma2Config, Gemma2,
              {CAUSAL_LM: "Gemma2ForCausalLM",
               SEQUENCE_CLASSIFICATION: "Gemma2ForSequenceClassification"},
              from_hf, to_hf, tensor_map)
