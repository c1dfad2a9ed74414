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

zeroxla's keys for the rollout engine (the names are DeepSpeed-FastGen's, whose ragged batching
it follows; `zeroxla.inference.continuous`):
  batching                 "continuous": one compiled step over a paged KV cache, finished
                           rows refilled from the queue, a group's prompt prefilled once
                           (refused, naming why, for a model whose decode does not take a
                           paged cache: `checks.paged_refusal`); "static": the decode loop of
                           one padded batch (the baseline); "auto" (default): continuous
                           where the model takes a paged cache, else static (the engine's
                           `batching` attribute says which, and why)
  kv_block_size            slots per KV page
  max_ragged_batch_size    token places per step and data group (decode tokens and prompt
                           chunks together): every step computes this many
  max_ragged_sequence_count  sequences per data group decoding at once (sampling slots)
  kv_blocks                KV pages per data group, the null page included; None: enough for
                           every slot's longest sequence (no preemption). Fewer share the
                           KV bytes by need (a sequence holds the pages of its tokens), and a
                           full pool preempts the youngest sequence, recomputed later
  rollout_dtype            the inference copy's dtype: "float32" (the default: the masters'
                           values) or "bfloat16" (verl's and slime's rollout: each partition
                           cast before it travels, so the reshard moves half the bytes; the
                           KV cache in it too; the models then compute in bf16 with float32
                           norms, softmax, router and logits, and sampling stays float32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

KEYS = ("enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
        "pin_parameters", "tp_gather_partition_size", "batching", "kv_block_size",
        "max_ragged_batch_size", "max_ragged_sequence_count", "kv_blocks", "rollout_dtype")
BATCHING = ("auto", "continuous", "static")
ROLLOUT_DTYPES = ("float32", "bfloat16")


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
    batching: str = "auto"
    kv_block_size: int = 16
    max_ragged_batch_size: int = 128
    max_ragged_sequence_count: int = 32
    kv_blocks: int | None = None
    rollout_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("enabled", "release_inference_cache", "pin_parameters"):
            _boolean(name, getattr(self, name))
        for name in ("max_out_tokens", "inference_tp_size", "tp_gather_partition_size",
                     "kv_block_size", "max_ragged_batch_size", "max_ragged_sequence_count"):
            _positive_int(name, getattr(self, name))
        if self.batching not in BATCHING:
            raise ValueError(f"HybridEngineConfig.batching={self.batching!r} is invalid; "
                             f"accepted: {', '.join(map(repr, BATCHING))}")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"HybridEngineConfig.rollout_dtype={self.rollout_dtype!r} is "
                             f"invalid; accepted: {', '.join(map(repr, ROLLOUT_DTYPES))}")
        if self.max_ragged_sequence_count > self.max_ragged_batch_size:
            raise ValueError(
                f"HybridEngineConfig.max_ragged_sequence_count={self.max_ragged_sequence_count} "
                f"> max_ragged_batch_size={self.max_ragged_batch_size}; accepted: at most one "
                "sequence per token place (every decoding sequence feeds one token a step)")
        if self.kv_blocks is not None:
            _positive_int("kv_blocks", self.kv_blocks)
            need = 1 + self.pages_per_sequence
            if self.kv_blocks < need:
                raise ValueError(
                    f"HybridEngineConfig.kv_blocks={self.kv_blocks} is too few; accepted: at "
                    f"least {need} (the null page and the pages of one sequence of "
                    f"max_out_tokens={self.max_out_tokens} at kv_block_size="
                    f"{self.kv_block_size}), or None")

    @property
    def pages_per_sequence(self) -> int:
        return -(-self.max_out_tokens // self.kv_block_size)

    @property
    def pool_pages(self) -> int:
        """KV pages per data group, the null page included."""
        return (self.kv_blocks if self.kv_blocks is not None
                else 1 + self.max_ragged_sequence_count * self.pages_per_sequence)

    def replace(self, **changes: Any) -> "HybridEngineConfig":
        return dataclasses.replace(self, **changes)


def rollout_batching(prompts: int, answers: int, groups: int,
                     prompt_length: int) -> dict[str, int]:
    """Continuous-batching sizes for a rollout of `prompts` prompts x `answers` answers each on
    `groups` data groups (devices / inference_tp_size): slots for every answer at once (a
    group's answers decode in one data group) and token places for those decode tokens plus one
    whole prompt (on a CPU a step costs mostly its fixed overhead: fewer, fuller prefill steps
    beat fewer places). The keys are `HybridEngineConfig`'s."""
    slots = max(answers, -(-prompts // groups) * answers)
    return {"max_ragged_sequence_count": slots,
            "max_ragged_batch_size": slots + prompt_length}


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
