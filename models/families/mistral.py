"""Mistral (`model_type: mistral`, `MistralForCausalLM`): Llama with sliding-window attention in
every layer (`sliding_window`; null is full attention), in training masks and in the KV-cached
decode alike (`models.layers.visible_keys`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..llama import Llama, LlamaConfig
from .llama import architectures, llama_fields, llama_hf, tensor_map
from .spec import Family


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """A Llama config with Mistral's attention window (4096 positions by default, as HF's)."""

    sliding_window: int | None = 4096
    family: str = dataclasses.field(default="mistral", init=False)


def from_hf(hf: Mapping[str, Any]) -> MistralConfig:
    # A config.json without the key gets transformers' MistralConfig default, 4096.
    return MistralConfig(sliding_window=hf.get("sliding_window", 4096), **llama_fields(hf))


def to_hf(config: MistralConfig) -> dict[str, Any]:
    return {**llama_hf(config), "sliding_window": config.sliding_window}


SPEC = Family("mistral", MistralConfig, Llama, architectures("Mistral"), from_hf, to_hf,
              tensor_map)
