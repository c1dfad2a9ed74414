"""OLMoE (`model_type: olmoe`, `OlmoeForCausalLM`): Llama's attention with RMSNorms over the
whole q and k projections (not per head), an MoE MLP (`num_experts`, `num_experts_per_tok`,
experts of `intermediate_size`, `norm_topk_prob`). `clip_qkv` and a `sliding_window` are
refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..moe_llama import MoeLlama, MoeLlamaConfig
from .moe import moe_fields, moe_hf, tensor_map
from .spec import CAUSAL_LM, Family, require


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(MoeLlamaConfig):
    """An MoE Llama config with OLMoE's projection-wide q/k norms."""

    qk_norm: bool = True
    qk_norm_scope: str = "projection"
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.01
    family: str = dataclasses.field(default="olmoe", init=False)
    mlp_dim: int = 32        # config.json's one intermediate_size: the experts'
    ONE_INTERMEDIATE_SIZE = True


def from_hf(hf: Mapping[str, Any]) -> OlmoeConfig:
    clip = hf.get("clip_qkv")
    require(clip is None, "clip_qkv", clip, "clamping q, k and v is not built (null)")
    # transformers 5.23's OLMoE mask is full causal, but its attention hands sliding_window to
    # flash_attention_2: one config.json, two models, so neither is guessed.
    window = hf.get("sliding_window")
    require(window is None, "sliding_window", window, "OLMoE's attention is full (null); "
            "transformers slides it under flash_attention_2 only")
    bias = bool(hf.get("attention_bias", False))
    return OlmoeConfig(qkv_bias=bias, o_bias=bias,
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       **moe_fields(hf, "num_experts", "intermediate_size"))


def to_hf(config: OlmoeConfig) -> dict[str, Any]:
    hf = moe_hf(config, "num_experts", "intermediate_size")
    for key in ("decoder_sparse_step", "mlp_only_layers"):
        del hf[key]
    return {**hf, "attention_bias": config.o_bias, "clip_qkv": None}


# transformers 5.23 has no OlmoeForSequenceClassification: a causal LM only.
SPEC = Family("olmoe", OlmoeConfig, MoeLlama, {CAUSAL_LM: "OlmoeForCausalLM"}, from_hf, to_hf,
              tensor_map, {"olmoe-tiny": OlmoeConfig})
