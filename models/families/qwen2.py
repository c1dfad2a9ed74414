"""Qwen2 and Qwen2.5 (`model_type: qwen2`, `Qwen2ForCausalLM`): Llama with q/k/v biases (no output
bias), GQA, tied embeddings in the small sizes. Sliding-window layers (`use_sliding_window`,
off in every released Qwen2.5; on with `max_window_layers` >= the layer count, none slides and
it loads) are refused (`no_sliding_layers`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..llama import Llama, LlamaConfig
from .llama import architectures, llama_fields, llama_hf, no_sliding_layers, tensor_map
from .spec import Family


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """A Llama config with Qwen2's q/k/v biases."""

    qkv_bias: bool = True
    family: str = dataclasses.field(default="qwen2", init=False)


def from_hf(hf: Mapping[str, Any]) -> Qwen2Config:
    no_sliding_layers(hf)
    return Qwen2Config(**llama_fields(hf))


def to_hf(config: Qwen2Config) -> dict[str, Any]:
    return {**llama_hf(config), "use_sliding_window": False, "max_window_layers":
            config.num_layers, "layer_types": ["full_attention"] * config.num_layers}


SPEC = Family("qwen2", Qwen2Config, Llama, architectures("Qwen2"), from_hf, to_hf, tensor_map)
