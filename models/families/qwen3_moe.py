"""Qwen3-MoE (`model_type: qwen3_moe`, `Qwen3MoeForCausalLM`; Qwen3-30B-A3B, Qwen3-235B-A22B):
Qwen3's attention (per-head q/k RMSNorm) with an MoE MLP in every layer (`num_experts`,
`num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`). Its sliding window is
Mistral's, in every layer (`window`), not Qwen3's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..moe_llama import MoeLlama, MoeLlamaConfig
from .llama import architectures
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


def window(hf: Mapping[str, Any]) -> int | None:
    """The sliding window of every layer (transformers 5.23 `Qwen3MoeConfig`: `sliding_window`
    when `use_sliding_window`, else null; `Qwen3MoeModel.forward` builds one mask for all
    layers). Unlike Qwen3's, the config has no `max_window_layers` or `layer_types`: such keys
    are ignored, as transformers ignores them."""
    return hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None


def from_hf(hf: Mapping[str, Any]) -> Qwen3MoeConfig:
    all_layers_sparse(hf)
    bias = bool(hf.get("attention_bias", False))
    return Qwen3MoeConfig(qkv_bias=bias, o_bias=bias, sliding_window=window(hf),
                          norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                          **moe_fields(hf, "num_experts", "moe_intermediate_size"))


def to_hf(config: Qwen3MoeConfig) -> dict[str, Any]:
    return {**moe_hf(config, "num_experts", "moe_intermediate_size"),
            "attention_bias": config.o_bias,
            "use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window,
            # what transformers 5.23 ignores, said so that Qwen2's rule reads the same layers
            "max_window_layers": 0 if config.sliding_window else config.num_layers}


SPEC = Family("qwen3_moe", Qwen3MoeConfig, MoeLlama, architectures("Qwen3Moe"), from_hf, to_hf,
              tensor_map, {"qwen3-moe-tiny": Qwen3MoeConfig.tiny})
