"""Qwen3-MoE (`model_type: qwen3_moe`, `Qwen3MoeForCausalLM`; Qwen3-30B-A3B, Qwen3-235B-A22B):
Qwen3's attention (per-head q/k RMSNorm) with an MoE MLP in every layer (`num_experts`,
`num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..moe_llama import MoeLlama, MoeLlamaConfig
from .llama import architectures, no_sliding_layers
from .moe import all_layers_sparse, moe_fields, moe_hf, tensor_map
from .spec import Family


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(MoeLlamaConfig):
    """An MoE Llama config with Qwen3's q/k norms."""

    qk_norm: bool = True
    family: str = dataclasses.field(default="qwen3_moe", init=False)

    @classmethod
    def tiny(cls) -> "Qwen3MoeConfig":
        return cls(explicit_head_dim=16)


def from_hf(hf: Mapping[str, Any]) -> Qwen3MoeConfig:
    no_sliding_layers(hf)
    all_layers_sparse(hf)
    bias = bool(hf.get("attention_bias", False))
    return Qwen3MoeConfig(qkv_bias=bias, o_bias=bias,
                          norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                          **moe_fields(hf, "num_experts", "moe_intermediate_size"))


def to_hf(config: Qwen3MoeConfig) -> dict[str, Any]:
    return {**moe_hf(config, "num_experts", "moe_intermediate_size"),
            "attention_bias": config.o_bias, "use_sliding_window": False,
            "max_window_layers": config.num_layers}


SPEC = Family("qwen3_moe", Qwen3MoeConfig, MoeLlama, architectures("Qwen3Moe"), from_hf, to_hf,
              tensor_map, {"qwen3-moe-tiny": Qwen3MoeConfig.tiny})
