"""Gemma 4 text (`model_type: gemma4_text`, `Gemma4ForCausalLM`; or `gemma4`, the text model of
`Gemma4ForConditionalGeneration`, nested under `text_config`, its tensors under
`model.language_model.`, the vision and audio towers never read): `models.gemma4.Gemma4`.

transformers 5.23 `models/gemma4/`: `layer_types` (else five `sliding_attention` layers to one
`full_attention`) as whole periods, our block i the HF layers P*i .. P*i + P - 1
(`{unit[j]}`); the global layers' head dim and key-value heads from `per_layer_config` (what
transformers writes: {layer index: {"head_dim", "num_key_value_heads"}} for every full-attention
layer) or else `global_head_dim` (512) and `num_global_key_value_heads` (read only with
`attention_k_eq_v`, as `Gemma4TextConfig` does); RoPE per layer type, `rope_parameters`
{"sliding_attention": default, "full_attention": default or proportional (its
`partial_rotary_factor`, `factor`)}; `final_logit_softcapping` (both heads apply it); the MoE
block (`enable_moe_block`: `num_experts`, `top_k_experts`, `moe_intermediate_size`; the
experts fused as transformers writes them, `experts.gate_up_proj` [E, 2F, D] gate rows first,
`experts.down_proj` [E, D, F]); `layer_scalar` [1] per layer.

Refused by key: the per-layer input embeddings of the "E" models (`hidden_size_per_layer_input`
> 0), shared key-value layers (`num_kv_shared_layers` > 0; `use_double_wide_mlp` widens only
those, so it loads as a no-op without them), bidirectional attention (`"all"`; `"vision"` is
causal on text), another layer pattern, a layer count not a multiple of it, per-layer overrides
other than the global layers' head dim and key-value heads, biases, an untied head, another
activation, attention soft-capping, a RoPE type other than default (sliding) or default /
proportional (global).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..gemma4 import Gemma4, Gemma4Config
from ..hf_rules import as_is, as_is_inv, linear
from .gemma2 import GELU, layer_rows
from .gemma3 import FULL, SLIDING, layer_types
from .moe import expert_linear
from .qwen3_5 import text_keys
from .spec import CAUSAL_LM, Family, Row, require

TEXT_MODEL_TYPE = "gemma4_text"     # what Gemma4ForCausalLM writes, flat (no text_config)
PATTERN = 6                         # transformers' default: five sliding layers, one global


def _pattern(text: Mapping[str, Any]) -> int:
    """The period P of `layer_types` (default: `PATTERN`), checked to be whole periods."""
    n = text["num_hidden_layers"]
    types = list(text.get("layer_types") or layer_types(n, PATTERN))
    pattern = types.index(FULL) + 1 if FULL in types else 0
    require(pattern >= 2 and n % pattern == 0 and types == layer_types(n, pattern),
            "layer_types", types, f"whole periods of {SLIDING} layers (at least one) then one "
            f"{FULL} layer, num_hidden_layers={n} a multiple of the period")
    return pattern


def _global_shape(text: Mapping[str, Any], types: list[str]) -> tuple[int, int | None]:
    """(global_head_dim, num_global_kv_heads or None) from `per_layer_config`, else from
    `global_head_dim` / `num_global_key_value_heads` as `Gemma4TextConfig` reads them."""
    if text.get("per_layer_config") is None:
        kv = text.get("num_global_key_value_heads") if text.get("attention_k_eq_v") else None
        return text.get("global_head_dim", 512), kv
    # present, even empty ({}: what transformers writes when the global layers keep the
    # sliding layers' shape), it is the whole story
    per_layer = {int(i): dict(v) for i, v in text["per_layer_config"].items()}
    full = [i for i, kind in enumerate(types) if kind == FULL]
    first = per_layer.get(full[0], {})
    require(set(per_layer) <= set(full) and all(per_layer.get(i, {}) == first for i in full)
            and set(first) <= {"head_dim", "num_key_value_heads"}, "per_layer_config",
            text["per_layer_config"], f"one override of head_dim (and num_key_value_heads) for "
            f"every {FULL} layer, none for the {SLIDING} layers")
    return first.get("head_dim", text.get("head_dim")), first.get("num_key_value_heads")


def rope_fields(text: Mapping[str, Any]) -> dict[str, float]:
    """The Gemma4Config RoPE fields from `rope_parameters` keyed by layer type (transformers'
    defaults: sliding default 1e4, full proportional 1e6 with partial_rotary_factor 0.25)."""
    params = text.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
               "rope_theta": 1_000_000.0}}
    require(set(params) == {SLIDING, FULL}, "rope_parameters", params,
            f"a dict keyed by layer type ({SLIDING}, {FULL})")
    local, full = params[SLIDING], params[FULL]
    kind = local.get("rope_type", "default")
    require(kind == "default", f"rope_parameters.{SLIDING}.rope_type", kind,
            "the sliding layers are built with plain RoPE")
    kind = full.get("rope_type", "default")
    require(kind in ("default", "proportional"), f"rope_parameters.{FULL}.rope_type", kind,
            "accepted: default, proportional")
    proportional = kind == "proportional"
    return {"rope_local_theta": float(local.get("rope_theta", 10_000.0)),
            "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
            "rope_partial": float(full.get("partial_rotary_factor", 1.0) if proportional else 1),
            "rope_factor": float(full.get("factor", 1.0) if proportional else 1)}


def _refusals(text: Mapping[str, Any]) -> None:
    """What Gemma 4 has and this module does not build, refused by key."""
    ple = text.get("hidden_size_per_layer_input")
    require(not ple, "hidden_size_per_layer_input", ple, "the per-layer input embeddings of "
            "the Gemma 4 E models are not built; accepted: 0 or null")
    shared = text.get("num_kv_shared_layers", 0)
    require(not shared, "num_kv_shared_layers", shared, "layers reusing earlier layers' keys "
            "and values are not built; accepted: 0")
    act = text.get("hidden_activation") or text.get("hidden_act") or GELU
    require(act == GELU, "hidden_activation", act, f"the MLP is GeGLU with {GELU}")
    for key, accepted in (("attention_bias", (False,)), ("tie_word_embeddings", (True,)),
                          ("use_bidirectional_attention", (None, False, "vision")),
                          ("attn_logit_softcapping", (None,))):
        value = text.get(key, accepted[0])
        require(value in accepted, key, value,
                f"Gemma 4 text is built with {key} in {list(accepted)}")


def from_hf(hf: Mapping[str, Any]) -> Gemma4Config:
    text = text_keys(hf)
    _refusals(text)
    pattern = _pattern(text)
    n = text["num_hidden_layers"]
    global_dim, global_kv = _global_shape(text, layer_types(n, pattern))
    d, h = text["hidden_size"], text["num_attention_heads"]
    head_dim, kv = text.get("head_dim") or d // h, text.get("num_key_value_heads") or h
    return Gemma4Config(
        vocab_size=text["vocab_size"], max_seq_len=text["max_position_embeddings"], d_model=d,
        num_heads=h, num_kv_heads=kv, num_layers=n // pattern,
        mlp_dim=text["intermediate_size"],
        explicit_head_dim=None if d % h == 0 and head_dim == d // h else head_dim,
        global_head_dim=global_dim, num_global_kv_heads=None if global_kv == kv else global_kv,
        attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
        norm_eps=text.get("rms_norm_eps", 1e-6), init_std=text.get("initializer_range", 0.02),
        final_softcap=text.get("final_logit_softcapping"),
        sliding_window=text.get("sliding_window", 512), sliding_window_pattern=pattern,
        **moe_fields(text), **rope_fields(text))


def moe_fields(text: Mapping[str, Any]) -> dict[str, int]:
    """The MoE block's Gemma4Config fields (none without `enable_moe_block`)."""
    if not text.get("enable_moe_block"):
        return {"num_experts": 0}
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        value = text.get(key)
        require(isinstance(value, int) and value >= 1, key, value,
                "enable_moe_block needs it: an integer >= 1")
    return {"num_experts": text["num_experts"], "experts_per_token": text["top_k_experts"],
            "expert_mlp_dim": text["moe_intermediate_size"]}


def to_hf(c: Gemma4Config) -> dict[str, Any]:
    """Flat `gemma4_text` keys: what `Gemma4ForCausalLM` (AutoModelForCausalLM) loads."""
    n = c.num_layers * c.sliding_window_pattern
    types = layer_types(n, c.sliding_window_pattern)
    override = {"head_dim": c.global_head_dim, "num_key_value_heads": c.global_kv_heads}
    moe = {"num_experts": c.num_experts, "top_k_experts": c.experts_per_token,
           "moe_intermediate_size": c.expert_mlp_dim} if c.num_experts else {}
    return {"model_type": TEXT_MODEL_TYPE, "vocab_size": c.vocab_size, "hidden_size": c.d_model,
            "intermediate_size": c.mlp_dim, "num_hidden_layers": n,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "hidden_activation": GELU,
            "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "initializer_range": c.init_std, "tie_word_embeddings": True,
            "attention_bias": False, "final_logit_softcapping": c.final_softcap,
            "sliding_window": c.sliding_window, "layer_types": types,
            "per_layer_config": {str(i): override for i, t in enumerate(types) if t == FULL},
            "attention_k_eq_v": c.attention_k_eq_v, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
            "enable_moe_block": bool(c.num_experts), **moe,
            "rope_parameters": {SLIDING: {"rope_type": "default",
                                          "rope_theta": c.rope_local_theta},
                                FULL: {"rope_type": "proportional", "rope_theta": c.rope_theta,
                                       "partial_rotary_factor": c.rope_partial,
                                       "factor": c.rope_factor}}}


def fused_gate_up(shape: tuple[int, int, int]):
    """Our w_gate, w_up [E, D, F] <-> transformers' `experts.gate_up_proj` [E, 2F, D] (the
    gate's F rows first)."""

    def to_hf(gate, up):
        return np.swapaxes(np.concatenate([gate, up], axis=2), 1, 2)

    def from_hf(t):
        gate, up = np.split(np.swapaxes(t, 1, 2), 2, axis=2)
        return gate.reshape(shape), up.reshape(shape)

    return to_hf, from_hf


def _moe_rows(c: Gemma4Config, layer: str, ours: str) -> list[Row]:
    """One layer's MoE block tensors."""
    same, e, d = (as_is, as_is_inv), c.num_experts, c.d_model
    return [
        (layer + "router.proj.weight", (ours + "router",), linear((d, e), 1)),
        (layer + "router.scale", (ours + "router_scale",), same),
        (layer + "router.per_expert_scale", (ours + "per_expert_scale",), same),
        (layer + "experts.gate_up_proj", (ours + "w_gate", ours + "w_up"),
         fused_gate_up((e, d, c.expert_mlp_dim))),
        (layer + "experts.down_proj", (ours + "w_down",), expert_linear()),
        (layer + "post_feedforward_layernorm_1.weight", (ours + "dense_norm/scale",), same),
        (layer + "pre_feedforward_layernorm_2.weight", (ours + "pre_norm/scale",), same),
        (layer + "post_feedforward_layernorm_2.weight", (ours + "post_norm/scale",), same),
    ]


def _layer_rows(c: Gemma4Config, layer: str, ours: str, glob: bool) -> list[Row]:
    """One HF layer's tensors (`layer`: its name prefix; `ours`: our path): Gemma's layer
    (`gemma2.layer_rows`) with the global layer's own KV heads and head dim, no value projection
    where keys are values, the layer scalar, and the MoE block's rows when it has one."""
    g, k = (c.global_kv_heads, c.global_head_dim) if glob else (c.num_kv_heads, c.head_dim)
    rows = layer_rows(layer, ours, c.d_model, c.num_heads, g, k, c.mlp_dim, qk_norm=True,
                      with_v=not (glob and c.attention_k_eq_v))
    rows.append((layer + "layer_scalar", (ours + "layer_scalar",), (as_is, as_is_inv)))
    return rows + (_moe_rows(c, layer, ours + "moe/") if c.num_experts else [])


def tensor_map(c: Gemma4Config) -> list[Row]:
    same = (as_is, as_is_inv)
    rows: list[Row] = [("model.embed_tokens.weight", ("embed/weight",), same),   # [V, D]
                       ("model.norm.weight", ("norm/scale",), same)]
    last = c.sliding_window_pattern - 1
    for j in range(last):
        rows += _layer_rows(c, f"model.layers.{{unit[{j}]}}.", f"local/{j}/", False)
    return rows + _layer_rows(c, f"model.layers.{{unit[{last}]}}.", "glob/", True)


SPEC = Family("gemma4", Gemma4Config, Gemma4, {CAUSAL_LM: "Gemma4ForCausalLM"},
              from_hf, to_hf, tensor_map, aliases=(TEXT_MODEL_TYPE,))
