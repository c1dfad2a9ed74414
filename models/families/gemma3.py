"""Gemma 3 text (`model_type: gemma3_text`, `Gemma3ForCausalLM`; or `gemma3`, the text model
of `Gemma3ForConditionalGeneration`): `models.gemma3.Gemma3`.

transformers 5.23 `models/gemma3/`: Gemma 2's layer (`families.gemma2`'s names) plus
`self_attn.q_norm` / `k_norm`; `layer_types` (else `sliding_window_pattern`, 6) is
pattern - 1 `sliding_attention` layers then one `full_attention`, repeated; RoPE per layer
type, `rope_parameters` {"sliding_attention": ..., "full_attention": ...} (transformers 5.x) or
`rope_local_base_freq` / `rope_theta` / `rope_scaling` (4.x, the scaling the global layers'),
read as `Gemma3TextConfig.convert_rope_params_to_dict` does. The published checkpoints nest the
text model under `text_config` beside a `vision_config` (`families.qwen3_5.text_keys`) and
keep its tensors under `model.language_model.` (`models.hf_names`); the vision tower and the
projector are never read. Our stack's block i is the HF layers P*i .. P*i + P - 1 (`{unit[j]}`);
a layer count that is not whole periods (transformers' Gemma 3 1B, 4B and 27B have 26, 34 and
62 layers of a pattern of 6) ends in the tail's sliding layers, HF layers P L + j (`{tail[j]}`).

Refused by key: another layer pattern, fewer layers than one period, biases, an untied
head, another activation, bidirectional attention, a RoPE type other than plain (sliding) or
plain / linear (global), attention soft-capping (transformers' Gemma 3 never applies it) and a
final soft-capping nested under `text_config` (its `Gemma3ForConditionalGeneration` does not
apply it; `Gemma3ForCausalLM` does, and so do we, flat).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..gemma3 import GLOBAL_ROPE_TYPES, Gemma3, Gemma3Config
from ..hf_rules import as_is, as_is_inv
from .gemma2 import GELU, layer_rows, shared_hf_keys
from .qwen3_5 import text_keys
from .spec import CAUSAL_LM, Family, Row, require

TEXT_MODEL_TYPE = "gemma3_text"     # what Gemma3ForCausalLM writes, flat (no text_config)
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(num_hidden_layers: int, pattern: int) -> list[str]:
    """transformers' Gemma 3 layer_types: every `pattern`-th layer global."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_hidden_layers)]


def rope_keys(text: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma3Config RoPE fields, as `Gemma3TextConfig.convert_rope_params_to_dict` reads
    config.json: `rope_parameters` keyed by layer type, `rope_scaling` updating the global
    layers' entry, thetas defaulting to `rope_theta` (1e6) and `rope_local_base_freq` (1e4)."""
    params = text.get("rope_parameters") or {SLIDING: {}, FULL: {}}
    require(set(params) <= {SLIDING, FULL}, "rope_parameters", params,
            f"a dict keyed by layer type ({SLIDING}, {FULL})")
    full = {**(params.get(FULL) or {}), **(text.get("rope_scaling") or {})}
    local = dict(params.get(SLIDING) or {})
    full.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", text.get("rope_local_base_freq", 10_000.0))
    kind = full.get("rope_type", full.get("type", "default"))
    require(kind in GLOBAL_ROPE_TYPES, f"rope_parameters.{FULL}.rope_type", kind,
            f"accepted: {', '.join(GLOBAL_ROPE_TYPES)}")
    if kind == "linear":
        require("factor" in full, f"rope_parameters.{FULL}.factor", None,
                "linear RoPE needs a factor")
    local_kind = local.get("rope_type", local.get("type", "default"))
    require(local_kind == "default", f"rope_parameters.{SLIDING}.rope_type", local_kind,
            "the sliding layers are built with plain RoPE")
    return {"rope_theta": float(full["rope_theta"]), "rope_type": kind,
            "rope_factor": float(full.get("factor", 1.0)) if kind == "linear" else 1.0,
            "rope_local_theta": float(local["rope_theta"])}


def _pattern(text: Mapping[str, Any]) -> int:
    """The period P of the layer pattern (layer_types, else sliding_window_pattern), checked."""
    n = text["num_hidden_layers"]
    types = list(text.get("layer_types") or [])
    key = "layer_types" if types else "sliding_window_pattern"
    pattern = types.index(FULL) + 1 if FULL in types else text.get("sliding_window_pattern", 6)
    require(isinstance(pattern, int) and pattern >= 2, key, types or pattern,
            f"periods of sliding_attention layers (at least one) then one {FULL}")
    require(n >= pattern, "num_hidden_layers", n,
            f"at least one period of the layer pattern {pattern} ({pattern - 1} {SLIDING} "
            f"layers and one {FULL} layer)")
    require(not types or types == layer_types(n, pattern), "layer_types", types,
            f"{pattern - 1} {SLIDING} layers then one {FULL}, repeated")
    return pattern


def _softcaps(hf: Mapping[str, Any], text: Mapping[str, Any]) -> None:
    """transformers 5.23's Gemma 3 attention never reads `attn_logit_softcapping`, and its
    `Gemma3ForConditionalGeneration` never applies `final_logit_softcapping` (its
    `Gemma3ForCausalLM` does): a value set there means nothing one reader agrees on, so it is
    refused (the released checkpoints hold null)."""
    cap = text.get("attn_logit_softcapping")
    require(cap is None, "attn_logit_softcapping", cap,
            "transformers' Gemma 3 attention does not apply it (Gemma 3 normalises q and k "
            "instead); accepted: null")
    cap = text.get("final_logit_softcapping")
    require(cap is None or not hf.get("text_config"), "text_config.final_logit_softcapping", cap,
            "transformers' Gemma3ForConditionalGeneration does not apply it (Gemma3ForCausalLM, "
            "model_type gemma3_text, does); accepted: null")


def from_hf(hf: Mapping[str, Any]) -> Gemma3Config:
    text = text_keys(hf)
    pattern = _pattern(text)
    _softcaps(hf, text)
    act = text.get("hidden_activation") or text.get("hidden_act") or GELU
    require(act == GELU, "hidden_activation", act, f"the MLP is GeGLU with {GELU}")
    for key, accepted in (("attention_bias", (False,)), ("tie_word_embeddings", (True,)),
                          ("use_bidirectional_attention", (None, False))):
        value = text.get(key, accepted[0])
        require(value in accepted, key, value, f"Gemma 3 is built with {key}={accepted[0]}")
    window = text.get("sliding_window", 4096)
    require(isinstance(window, int) and window >= 1, "sliding_window", window, "an integer >= 1")
    d, h = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or d // h
    return Gemma3Config(
        vocab_size=text["vocab_size"], max_seq_len=text["max_position_embeddings"], d_model=d,
        num_heads=h, num_kv_heads=text.get("num_key_value_heads") or h,
        num_layers=text["num_hidden_layers"] // pattern, mlp_dim=text["intermediate_size"],
        tail_layers=text["num_hidden_layers"] % pattern,
        explicit_head_dim=None if d % h == 0 and head_dim == d // h else head_dim,
        norm_eps=text.get("rms_norm_eps", 1e-6), init_std=text.get("initializer_range", 0.02),
        query_pre_attn_scalar=text.get("query_pre_attn_scalar", 256),
        final_softcap=text.get("final_logit_softcapping"), sliding_window=window,
        sliding_window_pattern=pattern, **rope_keys(text))


def to_hf(config: Gemma3Config) -> dict[str, Any]:
    """Flat `gemma3_text` keys: what `Gemma3ForCausalLM` (AutoModelForCausalLM) loads."""
    n = config.num_layers * config.sliding_window_pattern + config.tail_layers
    full = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type == "linear":
        full["factor"] = config.rope_factor
    return {"model_type": TEXT_MODEL_TYPE, **shared_hf_keys(config), "num_hidden_layers": n,
            "layer_types": layer_types(n, config.sliding_window_pattern),
            "rope_parameters": {SLIDING: {"rope_type": "default",
                                          "rope_theta": config.rope_local_theta},
                                FULL: full}}


def _layer_rows(c: Gemma3Config, layer: str, ours: str) -> list[Row]:
    """One HF layer's tensors (`layer`: its name prefix; `ours`: our path)."""
    return layer_rows(layer, ours, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim,
                      c.mlp_dim, qk_norm=True)


def tensor_map(c: Gemma3Config) -> list[Row]:
    same = (as_is, as_is_inv)
    rows: list[Row] = [("model.embed_tokens.weight", ("embed/weight",), same),   # [V, D]
                       ("model.norm.weight", ("norm/scale",), same)]
    last = c.sliding_window_pattern - 1
    for j in range(last):
        rows += _layer_rows(c, f"model.layers.{{unit[{j}]}}.", f"local/{j}/")
    rows += _layer_rows(c, f"model.layers.{{unit[{last}]}}.", "glob/")
    for j in range(c.tail_layers):                # HF layers P L + j, after the periods
        rows += _layer_rows(c, f"model.layers.{{tail[{j}]}}.", f"sliding/{j}/")
    return rows


SPEC = Family("gemma3", Gemma3Config, Gemma3, {CAUSAL_LM: "Gemma3ForCausalLM"},
              from_hf, to_hf, tensor_map, aliases=(TEXT_MODEL_TYPE,))
