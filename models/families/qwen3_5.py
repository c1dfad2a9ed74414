"""Qwen3.5 dense (`model_type: qwen3_5`, or `qwen3_5_text` as transformers' `Qwen3_5ForCausalLM`
saves it): `models.qwen3_5.Qwen3_5`.

transformers 5.23 `models/qwen3_5/`: the published checkpoints nest the language model's keys
under `text_config` (beside a `vision_config`, not read: the text model alone is built);
`layer_types` is `full_attention_interval` - 1 `linear_attention` layers then one
`full_attention`, repeated; nn.Linear projections without bias; (1 + w) norms, but the DeltaNet
output norm's plain `w`. Our stack's block i is the HF layers P*i .. P*i + P - 1 (P the
interval: `{unit[j]}` in the names). Fused tensors are cut by the map: `q_proj` [H * 2K, D] is
each head's query then its output gate; `in_proj_qkv` [2 Hk K + H V, D] and `conv1d`
[2 Hk K + H V, 1, W] are q | k | v. The multi-token-prediction weights (`mtp.*`) and a vision
tower's are never read. Refused by key: another layer pattern, a layer count not a multiple of
the interval, attention biases, another activation, scaled RoPE.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..hf_rules import LM_HEAD, as_is, as_is_inv, linear
from ..qwen3_5 import Qwen3_5, Qwen3_5Config
from .spec import CAUSAL_LM, Family, Row, require

TEXT_MODEL_TYPE = "qwen3_5_text"     # what Qwen3_5ForCausalLM writes, flat (no text_config)


def layer_types(num_hidden_layers: int, interval: int) -> list[str]:
    """transformers' Qwen3.5 layer_types: every `interval`-th layer full attention."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)]


def text_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's keys: `text_config`'s when nested (the outer config's
    tie_word_embeddings decides, as transformers' composite model ties by it), else `hf`."""
    if not hf.get("text_config"):
        return dict(hf)
    text = dict(hf["text_config"])
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def rope_keys(text: Mapping[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` (or the top-level keys);
    a rope_type other than default is refused. mrope_section / mrope_interleaved are read as
    plain RoPE: text positions are the same on mRoPE's three rows (`models.qwen3_5`)."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    require(kind == "default", "rope_parameters.rope_type", kind,
            "Qwen3.5 is built with plain (partial, text-position mRoPE) RoPE")
    theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def from_hf(hf: Mapping[str, Any]) -> Qwen3_5Config:
    text = text_keys(hf)
    return Qwen3_5Config(mlp_dim=text["intermediate_size"], **text_fields(text))


def text_fields(text: Mapping[str, Any]) -> dict[str, Any]:
    """The `Qwen3_5Config` fields of the text model's keys `text` but its MLP's (the dense
    family's `intermediate_size`, the MoE variant's experts); refuses what is not built."""
    n = text["num_hidden_layers"]
    types = list(text.get("layer_types") or [])
    interval = (types.index("full_attention") + 1 if "full_attention" in types
                else text.get("full_attention_interval", 4))
    require(n % interval == 0, "num_hidden_layers", n,
            f"a multiple of the attention interval {interval} (whole periods of "
            f"{interval - 1} linear_attention layers and one full_attention layer)")
    require(not types or types == layer_types(n, interval), "layer_types", types,
            f"{interval - 1} linear_attention layers then one full_attention, repeated")
    for key, accepted in (("hidden_act", "silu"), ("attention_bias", False),
                          ("use_sliding_window", False)):
        value = text.get(key, accepted)
        require(value == accepted, key, value, f"Qwen3.5 is built with {key}={accepted!r}")
    theta, factor = rope_keys(text)
    return dict(
        vocab_size=text["vocab_size"], max_seq_len=text["max_position_embeddings"],
        d_model=text["hidden_size"], num_heads=text["num_attention_heads"],
        num_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
        num_layers=n // interval,
        explicit_head_dim=text.get("head_dim", 256), rope_theta=theta,
        partial_rotary_factor=factor, norm_eps=text.get("rms_norm_eps", 1e-6),
        init_std=text.get("initializer_range", 0.02),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        attention_interval=interval,
        linear_num_key_heads=text.get("linear_num_key_heads", 16),
        linear_num_value_heads=text.get("linear_num_value_heads", 32),
        linear_key_head_dim=text.get("linear_key_head_dim", 128),
        linear_value_head_dim=text.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4))


def to_hf(config: Qwen3_5Config) -> dict[str, Any]:
    """Flat `qwen3_5_text` keys: what `Qwen3_5ForCausalLM` (AutoModelForCausalLM) loads."""
    return {"model_type": TEXT_MODEL_TYPE, "intermediate_size": config.mlp_dim,
            **text_hf(config)}


def text_hf(config: Qwen3_5Config) -> dict[str, Any]:
    """The text model's keys but its MLP's and the model_type (`text_fields`' inverse)."""
    n = config.num_layers * config.attention_interval
    return {"vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "num_hidden_layers": n, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "hidden_act": "silu", "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps, "initializer_range": config.init_std,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False,
            "layer_types": layer_types(n, config.attention_interval),
            "full_attention_interval": config.attention_interval,
            "linear_num_key_heads": config.linear_num_key_heads,
            "linear_num_value_heads": config.linear_num_value_heads,
            "linear_key_head_dim": config.linear_key_head_dim,
            "linear_value_head_dim": config.linear_value_head_dim,
            "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                                "partial_rotary_factor": config.partial_rotary_factor}}


def fused_linear(shapes: tuple[tuple[int, ...], ...]):
    """Our weights [D, *out_i] <-> one nn.Linear [sum out_i, D], the parts' rows in order."""
    sizes = [int(np.prod(s[1:])) for s in shapes]

    def to_hf(*ours):
        return np.concatenate([w.reshape(w.shape[0], -1) for w in ours], axis=1).T

    def from_hf(t):
        parts = np.split(t.T, np.cumsum(sizes)[:-1], axis=1)
        return tuple(p.reshape(s) for p, s in zip(parts, shapes))

    return to_hf, from_hf


def fused_conv(shapes: tuple[tuple[int, ...], ...]):
    """Our depthwise filters [W, *channels_i] <-> one nn.Conv1d weight [sum channels_i, 1, W]."""
    sizes = [int(np.prod(s[1:])) for s in shapes]

    def to_hf(*ours):
        return np.concatenate([w.reshape(w.shape[0], -1) for w in ours], axis=1).T[:, None]

    def from_hf(t):
        parts = np.split(t[:, 0].T, np.cumsum(sizes)[:-1], axis=1)
        return tuple(p.reshape(s) for p, s in zip(parts, shapes))

    return to_hf, from_hf


def gated_query(d: int, h: int, k: int):
    """Our wq, wg [D, H, K] <-> q_proj [H * 2K, D], each head's K query rows then K gate rows."""

    def to_hf(wq, wg):
        return np.stack([wq, wg], axis=2).reshape(d, h * 2 * k).T

    def from_hf(t):
        both = t.T.reshape(d, h, 2, k)
        return both[:, :, 0], both[:, :, 1]

    return to_hf, from_hf


def _norm_rows(layer: str, ours: str) -> list[Row]:
    """The two norms of one HF layer (`layer`: its name prefix; `ours`: our path)."""
    same = (as_is, as_is_inv)
    return [(layer + "input_layernorm.weight", (ours + "attn_norm/scale",), same),
            (layer + "post_attention_layernorm.weight", (ours + "mlp_norm/scale",), same)]


def _mlp_rows(c: Qwen3_5Config, layer: str, ours: str) -> list[Row]:
    """The SwiGLU MLP of one HF layer (`layer`: its name prefix; `ours`: our path)."""
    d, f = c.d_model, c.mlp_dim
    return [(layer + "mlp.gate_proj.weight", (ours + "w_gate",), linear((d, f), 1)),
            (layer + "mlp.up_proj.weight", (ours + "w_up",), linear((d, f), 1)),
            (layer + "mlp.down_proj.weight", (ours + "w_down",), linear((f, d), 1))]


def _deltanet_rows(c: Qwen3_5Config, layer: str, ours: str) -> list[Row]:
    d, w, same = c.d_model, c.linear_conv_kernel_dim, (as_is, as_is_inv)
    hk, k = c.linear_num_key_heads, c.linear_key_head_dim
    h, v = c.linear_num_value_heads, c.linear_value_head_dim
    at, mixer = layer + "linear_attn.", ours + "mixer/"
    return [
        (at + "in_proj_qkv.weight", tuple(mixer + p for p in ("wq", "wk", "wv")),
         fused_linear(((d, hk, k), (d, hk, k), (d, h, v)))),
        (at + "conv1d.weight", tuple(mixer + p for p in ("conv_q", "conv_k", "conv_v")),
         fused_conv(((w, hk, k), (w, hk, k), (w, h, v)))),
        (at + "in_proj_z.weight", (mixer + "wz",), linear((d, h, v), 1)),
        (at + "in_proj_b.weight", (mixer + "wb",), linear((d, h), 1)),
        (at + "in_proj_a.weight", (mixer + "wa",), linear((d, h), 1)),
        (at + "dt_bias", (mixer + "dt_bias",), same),
        (at + "A_log", (mixer + "a_log",), same),
        (at + "norm.weight", (mixer + "norm/scale",), same),
        (at + "out_proj.weight", (mixer + "wo",), linear((h, v, d), 2)),
    ]


def _attention_rows(c: Qwen3_5Config, layer: str, ours: str) -> list[Row]:
    d, h, g, k, same = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, (as_is, as_is_inv)
    at, mixer = layer + "self_attn.", ours + "mixer/"
    return [(at + "q_proj.weight", (mixer + "wq", mixer + "wg"), gated_query(d, h, k)),
            (at + "k_proj.weight", (mixer + "wk",), linear((d, g, k), 1)),
            (at + "v_proj.weight", (mixer + "wv",), linear((d, g, k), 1)),
            (at + "o_proj.weight", (mixer + "wo",), linear((h, k, d), 2)),
            (at + "q_norm.weight", (mixer + "q_norm/scale",), same),
            (at + "k_norm.weight", (mixer + "k_norm/scale",), same)]


def tensor_map(c: Qwen3_5Config) -> list[Row]:
    return period_map(c, _mlp_rows)


def period_map(c: Qwen3_5Config, mlp_rows: Callable[[Any, str, str], list[Row]]) -> list[Row]:
    """The rows of the embedding, the final norm, the head and every layer of a period, each
    layer's MLP by `mlp_rows(c, HF layer prefix, our layer path)`."""
    same = (as_is, as_is_inv)
    rows: list[Row] = [("model.embed_tokens.weight", ("embed/weight",), same),   # [V, D]
                       ("model.norm.weight", ("head/norm/scale",), same)]
    last = c.attention_interval - 1
    for j in range(last):
        layer, ours = f"model.layers.{{unit[{j}]}}.", f"linear/{j}/"
        rows += _norm_rows(layer, ours) + mlp_rows(c, layer, ours)
        rows += _deltanet_rows(c, layer, ours)
    layer = f"model.layers.{{unit[{last}]}}."
    rows += _norm_rows(layer, "full/") + mlp_rows(c, layer, "full/")
    rows += _attention_rows(c, layer, "full/")
    if not c.tie_word_embeddings:
        rows.append((LM_HEAD, ("head/weight",), linear((c.d_model, c.vocab_size), 1)))
    return rows


SPEC = Family("qwen3_5", Qwen3_5Config, Qwen3_5, {CAUSAL_LM: "Qwen3_5ForCausalLM"},
              from_hf, to_hf, tensor_map, aliases=(TEXT_MODEL_TYPE,))
