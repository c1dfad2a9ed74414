"""Qwen3.5 MoE (`model_type: qwen3_5_moe`, or `qwen3_5_moe_text` as transformers'
`Qwen3_5MoeForCausalLM` saves it; Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): `models.qwen3_5_moe`.

The text model's keys and tensors are the dense family's (`families.qwen3_5`: `text_config`
nesting, periods of DeltaNet layers and one gated attention layer, `mtp.*` and a vision tower
never read, the same refusals by key), with every layer's MLP an MoE
(`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`,
`router_aux_loss_coef`, `output_router_logits`; transformers' config has no norm_topk_prob: its
router always renormalises). Tensors (transformers 5.23): `save_pretrained` writes one tensor per
expert and projection, `mlp.experts.{e}.gate_proj.weight` [F, D], and reads that or the fused
in-memory layout, `mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]; the rows
name the per-expert tensors and the loader cuts them from fused ones
(`models.hf_names.NameFallbacks`), flat or under `model.language_model.`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeConfig
from .moe import expert_rows
from .qwen3_5 import period_map, text_fields, text_hf, text_keys
from .spec import CAUSAL_LM, Family, Row, require

TEXT_MODEL_TYPE = "qwen3_5_moe_text"     # what Qwen3_5MoeForCausalLM writes, flat

# transformers 5.23 `Qwen3_5MoeTextConfig`'s defaults of the keys a config.json may leave out
DEFAULTS = {"num_experts_per_tok": 8, "shared_expert_intermediate_size": 512,
            "router_aux_loss_coef": 0.001, "output_router_logits": False}


def from_hf(hf: Mapping[str, Any]) -> Qwen3_5MoeConfig:
    text = {**DEFAULTS, **text_keys(hf)}
    for key in ("num_experts", "moe_intermediate_size", "num_experts_per_tok",
                "shared_expert_intermediate_size"):
        value = text.get(key)
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                value, "Qwen3.5 MoE names its expert count and sizes (integers >= 1; every "
                "layer has a shared expert)")
    return Qwen3_5MoeConfig(
        num_experts=text["num_experts"], experts_per_token=text["num_experts_per_tok"],
        expert_mlp_dim=text["moe_intermediate_size"],
        shared_expert_mlp_dim=text["shared_expert_intermediate_size"],
        router_aux_loss_coef=float(text["router_aux_loss_coef"]),
        output_router_logits=bool(text["output_router_logits"]), **text_fields(text))


def to_hf(config: Qwen3_5MoeConfig) -> dict[str, Any]:
    """Flat `qwen3_5_moe_text` keys: what `Qwen3_5MoeForCausalLM` (AutoModelForCausalLM)
    loads."""
    return {"model_type": TEXT_MODEL_TYPE, **text_hf(config),
            "num_experts": config.num_experts, "num_experts_per_tok": config.experts_per_token,
            "moe_intermediate_size": config.expert_mlp_dim,
            "shared_expert_intermediate_size": config.shared_expert_mlp_dim,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": config.output_router_logits}


def _moe_rows(c: Qwen3_5MoeConfig, layer: str, ours: str) -> list[Row]:
    """One HF layer's MoE MLP (`layer`: its name prefix; `ours`: our layer path)."""
    return expert_rows(c, layer + "mlp.", ours + "moe/")


def tensor_map(c: Qwen3_5MoeConfig) -> list[Row]:
    return period_map(c, _moe_rows)


SPEC = Family("qwen3_5_moe", Qwen3_5MoeConfig, Qwen3_5Moe,
              {CAUSAL_LM: "Qwen3_5MoeForCausalLM"}, from_hf, to_hf, tensor_map,
              aliases=(TEXT_MODEL_TYPE,))
