"""Mixtral (`model_type: mixtral`, `MixtralForCausalLM`): Mistral's attention (an optional
sliding window) with an MoE MLP (`num_local_experts`, `num_experts_per_tok`, experts of
`intermediate_size`), the top-k weights always renormalised. Its checkpoints name the layer
`block_sparse_moe` and the projections w1 (gate), w3 (up), w2 (down). Router jitter noise is
refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..moe_llama import MoeLlama, MoeLlamaConfig
from .llama import architectures
from .moe import moe_fields, moe_hf
from .moe import tensor_map as moe_tensor_map
from .spec import Family, require


@dataclasses.dataclass(frozen=True)
class MixtralConfig(MoeLlamaConfig):
    """An MoE Llama config with Mixtral's always-normalised top-k weights."""

    family: str = dataclasses.field(default="mixtral", init=False)
    mlp_dim: int = 32        # config.json's one intermediate_size: the experts'
    ONE_INTERMEDIATE_SIZE = True


def from_hf(hf: Mapping[str, Any]) -> MixtralConfig:
    jitter = hf.get("router_jitter_noise", 0.0)
    require(not jitter, "router_jitter_noise", jitter, "the router's training-time input "
            "noise is not built (0.0)")
    return MixtralConfig(sliding_window=hf.get("sliding_window"), norm_topk_prob=True,
                         **moe_fields(hf, "num_local_experts", "intermediate_size"))


def to_hf(config: MixtralConfig) -> dict[str, Any]:
    hf = moe_hf(config, "num_local_experts", "intermediate_size")
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        del hf[key]
    return {**hf, "sliding_window": config.sliding_window, "router_jitter_noise": 0.0}


def tensor_map(c: MixtralConfig):
    return moe_tensor_map(c, "block_sparse_moe", ("w1", "w3", "w2"))


SPEC = Family("mixtral", MixtralConfig, MoeLlama, architectures("Mixtral"), from_hf, to_hf,
              tensor_map, {"mixtral-tiny": MixtralConfig})
