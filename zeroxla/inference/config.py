"""`HybridEngineConfig`: DeepSpeed's `hybrid_engine` section as a frozen dataclass.

    {"hybrid_engine": {"enabled": true, "max_out_tokens": 512, "inference_tp_size": 2,
                       "release_inference_cache": false, "pin_parameters": true,
                       "tp_gather_partition_size": 8}}

The keys and defaults are DeepSpeed's (`deepspeed/runtime/hybrid_engine.py`). What each means
here:
  enabled                  whether a training job builds the engine (the engine itself runs
                           whenever it is constructed)
  max_out_tokens           the KV cache length: a prompt plus its new tokens must fit in it;
                           at most the model's max_seq_len (the models' one maximum length
                           rule, `ModelConfig.check_seq_len`: refused at construction)
  inference_tp_size        devices in one tensor-parallel group; the other devices serve
                           other prompts data-parallel
  release_inference_cache  free the KV cache after every `generate` (else it is kept, per batch
                           and prompt bucket, for the next call)
  pin_parameters           keep the tensor-parallel copy of the parameters between
                           `generate` calls until an optimizer step makes it stale (else it is
                           rebuilt and freed on every call)
  tp_gather_partition_size DeepSpeed gathers this many layers at a time; here the reshard is one
                           compiled program over all layers, so it is checked and recorded only
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

KEYS = ("enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
        "pin_parameters", "tp_gather_partition_size")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"HybridEngineConfig.{name}={value!r} is invalid; accepted: an "
                         "integer >= 1")


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"HybridEngineConfig.{name}={value!r} is invalid; accepted: true or "
                         "false")


@dataclasses.dataclass(frozen=True)
class HybridEngineConfig:
    """DeepSpeed's `hybrid_engine` keys (see the module docstring); DeepSpeed's defaults."""

    enabled: bool = False
    max_out_tokens: int = 512
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = 8

    def __post_init__(self) -> None:
        for name in ("enabled", "release_inference_cache", "pin_parameters"):
            _boolean(name, getattr(self, name))
        for name in ("max_out_tokens", "inference_tp_size", "tp_gather_partition_size"):
            _positive_int(name, getattr(self, name))

    def replace(self, **changes: Any) -> "HybridEngineConfig":
        return dataclasses.replace(self, **changes)


def hybrid_engine_config_from_section(section: Any, *, where: str) -> HybridEngineConfig:
    """DeepSpeed's `hybrid_engine` JSON object, already read, -> config (`where` names its
    source in messages). `zeroxla.deepspeed.hybrid_engine_config_from_json` reads it from a
    DeepSpeed JSON config.

    An unknown key or a bad value is a ValueError naming the JSON key and the accepted keys or
    values."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where}: 'hybrid_engine' must be a JSON object; got {section!r}")
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key 'hybrid_engine.{unknown[0]}'; accepted keys: "
                         f"{', '.join(KEYS)}")
    try:
        return HybridEngineConfig(**section)
    except ValueError as err:
        raise ValueError(f"{where}: {str(err).replace('HybridEngineConfig.', 'hybrid_engine.')}"
                         ) from None
