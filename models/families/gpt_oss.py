"""gpt-oss (`model_type: gpt_oss`, `GptOssForCausalLM`; gpt-oss-20b, gpt-oss-120b):
`models.gpt_oss.GptOss`.

transformers 5.23 `models/gpt_oss/`: `layer_types` (default: even layers `sliding_attention`,
odd ones `full_attention`) over `num_hidden_layers`; `sliding_window` (128); q/k/v/o biases
(`attention_bias`, true); `self_attn.sinks` [H]; the router `mlp.router.weight` [E, D] and
`.bias` [E]; the experts fused, `mlp.experts.gate_up_proj` [E, D, 2F] with the gate and up
columns interleaved (gate = [..., ::2], up = [..., 1::2]) and `gate_up_proj_bias` [E, 2F]
alike, `down_proj` [E, F, D] and `down_proj_bias` [E, D] (inputs first: no transpose); RoPE
from `rope_parameters`, YaRN (factor 32, beta_fast 32, beta_slow 1, truncate false, original
4096, theta 150000) when config.json gives none, as `GptOssConfig.__post_init__` does. Our
stack's block i is the HF layers 2i (`local/`) and 2i + 1 (`glob/`) (`{unit[j]}`).

The released checkpoints store the experts' two weights as MXFP4 (`quantization_config`
`{"quant_method": "mxfp4"}`; `*_blocks`, `*_scales`): read through `models.hf_names`, decoded
exactly (`models.mxfp4`); a save writes them unquantized, without `quantization_config`.

Refused by key: another layer pattern (or an odd layer count), no sliding window, another
activation, another quantization method, a router that is not top-k with the k renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..gpt_oss import GptOss, GptOssConfig
from ..hf_rules import LM_HEAD, as_is, as_is_inv, concat, linear
from .llama import architectures
from .moe import moe_fields, moe_hf
from .spec import Family, Row, require

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' `GptOssConfig.__post_init__` RoPE when config.json gives none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0
QUANT_METHODS = ("mxfp4",)


def layer_types(num_hidden_layers: int) -> list[str]:
    """transformers' gpt-oss layer_types: even layers slide, odd ones are full."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(num_hidden_layers)]


def _rope_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`hf` with gpt-oss' RoPE defaults where config.json gives none (the YaRN of
    `DEFAULT_ROPE`, theta 150000), for `llama.rope_fields`."""
    hf = dict(hf)
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_parameters"] = dict(DEFAULT_ROPE)
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if "rope_theta" not in hf[key] and "rope_theta" not in hf:
        hf[key] = {**hf[key], "rope_theta": DEFAULT_THETA}
    return hf


def _checks(hf: Mapping[str, Any]) -> None:
    """Refuses by key what the model does not build (module docstring)."""
    n = hf["num_hidden_layers"]
    require(n % 2 == 0, "num_hidden_layers", n, "an even count: (sliding, full) layer pairs")
    types = list(hf.get("layer_types") or layer_types(n))
    require(types == layer_types(n), "layer_types", types,
            f"{SLIDING} and {FULL} alternating, starting with {SLIDING}")
    window = hf.get("sliding_window", 128)
    require(isinstance(window, int) and window >= 1, "sliding_window", window,
            "the sliding layers' window, an integer >= 1")
    quant = hf.get("quantization_config")
    method = (quant or {}).get("quant_method")
    require(quant is None or method in QUANT_METHODS, "quantization_config.quant_method", method,
            f"accepted: {', '.join(QUANT_METHODS)} (the experts dequantized while reading)")
    require(hf.get("norm_topk_prob", True) is True, "norm_topk_prob", hf.get("norm_topk_prob"),
            "gpt-oss' router is a softmax over the k largest logits (true)")


def from_hf(hf: Mapping[str, Any]) -> GptOssConfig:
    _checks(hf)
    fields = moe_fields(_rope_keys(hf), "num_local_experts", "intermediate_size")
    bias = bool(hf.get("attention_bias", True))
    return GptOssConfig(**{**fields, "num_layers": hf["num_hidden_layers"] // 2},
                        sliding_window=hf.get("sliding_window", 128), qkv_bias=bias,
                        o_bias=bias, swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def to_hf(config: GptOssConfig) -> dict[str, Any]:
    hf = moe_hf(config, "num_local_experts", "intermediate_size")
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rope_scaling",
                "rope_theta"):
        del hf[key]
    n = 2 * config.num_layers
    return {**hf, "num_hidden_layers": n, "layer_types": layer_types(n),
            "sliding_window": config.sliding_window, "attention_bias": config.o_bias,
            "swiglu_alpha": config.swiglu_alpha, "swiglu_limit": config.swiglu_limit}


def interleaved():
    """Our gate and up [.., F] <-> transformers' fused [.., 2F], gate = [..., ::2],
    up = [..., 1::2] (`GptOssExperts._apply_gate`)."""

    def to_hf(gate, up):
        return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)

    def from_hf(t):
        return np.ascontiguousarray(t[..., ::2]), np.ascontiguousarray(t[..., 1::2])

    return to_hf, from_hf


def _layer_rows(c: GptOssConfig, layer: str, ours: str) -> list[Row]:
    """One HF layer's tensors (`layer`: its name prefix; `ours`: our path)."""
    d, h, g, k, e = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.num_experts
    same = (as_is, as_is_inv)
    att, moe = layer + "self_attn.", layer + "mlp."
    rows = [
        (layer + "input_layernorm.weight", (ours + "attn_norm/scale",), same),
        (layer + "post_attention_layernorm.weight", (ours + "mlp_norm/scale",), same),
        (att + "q_proj.weight", (ours + "wq",), linear((d, h, k), 1)),            # [H*K, D]
        (att + "k_proj.weight", (ours + "wk",), linear((d, g, k), 1)),            # [G*K, D]
        (att + "v_proj.weight", (ours + "wv",), linear((d, g, k), 1)),            # [G*K, D]
        (att + "o_proj.weight", (ours + "wo",), linear((h, k, d), 2)),            # [D, H*K]
        (att + "sinks", (ours + "sinks",), same),                                 # [H]
        (moe + "router.weight", (ours + "moe/router",), linear((d, e), 1)),       # [E, D]
        (moe + "router.bias", (ours + "moe/b_router",), same),                    # [E]
        (moe + "experts.gate_up_proj", (ours + "moe/w_gate", ours + "moe/w_up"),
         interleaved()),                                                          # [E, D, 2F]
        (moe + "experts.gate_up_proj_bias", (ours + "moe/b_gate", ours + "moe/b_up"),
         interleaved()),                                                          # [E, 2F]
        (moe + "experts.down_proj", (ours + "moe/w_down",), same),                # [E, F, D]
        (moe + "experts.down_proj_bias", (ours + "moe/b_down",), same),           # [E, D]
    ]
    if c.qkv_bias:
        rows += [(att + "q_proj.bias", (ours + "bq",), concat(((h, k),), ((h * k,),))),
                 (att + "k_proj.bias", (ours + "bk",), concat(((g, k),), ((g * k,),))),
                 (att + "v_proj.bias", (ours + "bv",), concat(((g, k),), ((g * k,),)))]
    if c.o_bias:
        rows.append((att + "o_proj.bias", (ours + "bo",), same))                  # [D]
    return rows


def tensor_map(c: GptOssConfig) -> list[Row]:
    same = (as_is, as_is_inv)
    rows: list[Row] = [("model.embed_tokens.weight", ("embed/weight",), same),   # [V, D]
                       ("model.norm.weight", ("head/norm/scale",), same)]
    if not c.tie_word_embeddings:
        rows.append((LM_HEAD, ("head/weight",), linear((c.d_model, c.vocab_size), 1)))
    return (rows + _layer_rows(c, "model.layers.{unit[0]}.", "local/")
            + _layer_rows(c, "model.layers.{unit[1]}.", "glob/"))


SPEC = Family("gpt_oss", GptOssConfig, GptOss, architectures("GptOss"), from_hf, to_hf,
              tensor_map, {"gpt-oss-tiny": GptOssConfig})
