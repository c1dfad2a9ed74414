"""Qwen3 dense (`model_type: qwen3`, `Qwen3ForCausalLM`): Llama with a per-head RMSNorm of q and k
before RoPE, an explicit head_dim and no biases (`attention_bias` read all the same).
Sliding-window layers are refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..llama import Llama, LlamaConfig
from .llama import architectures, llama_fields, llama_hf, no_sliding_layers, tensor_map
from .spec import Family


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """A Llama config with Qwen3's q/k norms."""

    qk_norm: bool = True
    family: str = dataclasses.field(default="qwen3", init=False)


def from_hf(hf: Mapping[str, Any]) -> Qwen3Config:
    no_sliding_layers(hf)
    bias = bool(hf.get("attention_bias", False))
    return Qwen3Config(qkv_bias=bias, o_bias=bias, **llama_fields(hf))


def to_hf(config: Qwen3Config) -> dict[str, Any]:
    return {**llama_hf(config), "attention_bias": config.o_bias, "use_sliding_window": False,
            "max_window_layers": config.num_layers,
            "layer_types": ["full_attention"] * config.num_layers}


SPEC = Family("qwen3", Qwen3Config, Llama, architectures("Qwen3"), from_hf, to_hf, tensor_map)
