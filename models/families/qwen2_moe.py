"""Qwen2-MoE (`model_type: qwen2_moe`, `Qwen2MoeForCausalLM`; Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B):
Qwen2's attention (q/k/v biases) with an MoE MLP plus a shared expert
(`shared_expert_intermediate_size`) behind a sigmoid gate (`shared_expert_gate`). Its sliding
layers follow a rule of its own (`sliding_layers`), refused as Qwen2's are."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..moe_llama import MoeLlama, MoeLlamaConfig
from .llama import architectures, no_sliding_layers
from .moe import all_layers_sparse, moe_fields, moe_hf, tensor_map
from .spec import Family, require


@dataclasses.dataclass(frozen=True)
class Qwen2MoeConfig(MoeLlamaConfig):
    """An MoE Llama config with Qwen2's biases and a shared expert."""

    qkv_bias: bool = True
    norm_topk_prob: bool = False
    shared_expert_mlp_dim: int = 48
    family: str = dataclasses.field(default="qwen2_moe", init=False)


SLIDING_RULE = "layer i slides when use_sliding_window, i is even and i < max_window_layers"


def sliding_layers(hf: Mapping[str, Any]) -> list[int]:
    """The layers that slide by Qwen2-MoE's rule, not Qwen2's (transformers 5.23
    `Qwen2MoeConfig.__post_init__`, when `layer_types` is not given): layer i when
    `use_sliding_window`, i is even and i < `max_window_layers` (default 28). So the default
    max_window_layers slides layer 0, and only max_window_layers 0 slides none."""
    if not hf.get("use_sliding_window", False):
        return []
    return list(range(0, min(hf.get("max_window_layers", 28), hf["num_hidden_layers"]), 2))


def from_hf(hf: Mapping[str, Any]) -> Qwen2MoeConfig:
    no_sliding_layers(hf, sliding_layers, SLIDING_RULE)
    all_layers_sparse(hf)
    shared = hf.get("shared_expert_intermediate_size", 0)
    require(isinstance(shared, int) and shared > 0, "shared_expert_intermediate_size", shared,
            "Qwen2-MoE has a shared expert (an integer >= 1)")
    return Qwen2MoeConfig(qkv_bias=bool(hf.get("qkv_bias", True)),
                          norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                          shared_expert_mlp_dim=shared,
                          **moe_fields(hf, "num_experts", "moe_intermediate_size"))


def to_hf(config: Qwen2MoeConfig) -> dict[str, Any]:
    return {**moe_hf(config, "num_experts", "moe_intermediate_size"),
            "shared_expert_intermediate_size": config.shared_expert_mlp_dim,
            "qkv_bias": config.qkv_bias, "use_sliding_window": False,
            "max_window_layers": config.num_layers,
            "layer_types": ["full_attention"] * config.num_layers}


SPEC = Family("qwen2_moe", Qwen2MoeConfig, MoeLlama, architectures("Qwen2Moe"), from_hf, to_hf,
              tensor_map, {"qwen2-moe-tiny": Qwen2MoeConfig})
