"""The name fallbacks real Hugging Face checkpoints need (`NameFallbacks`): a reader answering
the names our tensor maps use (`models.hf`) from checkpoints that store them otherwise: GPT-2
without its `transformer.` prefix, MoE experts fused into 3-D tensors, a vision-language
model's language model under `model.language_model.` (or Gemma 3's `language_model.model.`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# A per-expert tensor name (transformers' saved layout) and the fused one holding it (its
# in-memory layout: gate_up_proj [E, 2F, D], gate rows first; down_proj [E, D, F]).
_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                          r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
          "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
_MIXTRAL_LEGACY = ".block_sparse_moe."
# Where a vision-language checkpoint (Qwen3.5's `*ForConditionalGeneration`) keeps the language
# model's `model.*` tensors; its vision tower (`model.visual.*`) and `mtp.*` are never read.
_LANGUAGE_MODEL = "model.language_model."
# The same in Gemma 3's published layout (what transformers 5.23 still writes for
# `Gemma3ForConditionalGeneration`); `vision_tower.*`, `multi_modal_projector.*` are never read.
_LANGUAGE_MODEL_LEGACY = "language_model.model."


class NameFallbacks:
    """`reader` with the name fallbacks real checkpoints need: GPT-2 saved from `GPT2Model` (the
    hub's openai-community/gpt2) has no `transformer.` prefix; an MoE checkpoint written with
    fused experts (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F],
    Mixtral's router under `mlp.gate`) answers the per-expert names, the last fused tensor
    read kept for the next expert; a vision-language checkpoint answers `model.*` from
    `model.language_model.*` (or `language_model.model.*`). Called and `shape`d as the reader is
    (`SafetensorsReader`)."""

    def __init__(self, reader: Callable[..., np.ndarray], hf: Mapping[str, Any]):
        self.reader = reader
        self._fused: tuple[str, np.ndarray] | None = None

    def _resolve(self, fn: Callable[[str], Any], name: str) -> Any:
        try:
            return fn(name)
        except KeyError:
            if name.startswith("transformer."):
                return fn(name.removeprefix("transformer."))
            if name.startswith("model.") and not name.startswith(_LANGUAGE_MODEL):
                for prefix in (_LANGUAGE_MODEL, _LANGUAGE_MODEL_LEGACY):
                    try:
                        return fn(prefix + name.removeprefix("model."))
                    except KeyError:
                        pass                       # the error names the name asked for
            if _MIXTRAL_LEGACY in name and ".experts." not in name:
                return fn(name.replace(_MIXTRAL_LEGACY, ".mlp."))
            raise

    def _fused_expert(self, name: str) -> np.ndarray:
        """The per-expert tensor `name` cut from its fused tensor; KeyError when `name` is no
        expert's."""
        match = _EXPERT_NAME.match(name)
        if match is None:
            raise KeyError(name)
        layer, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        fused_name, half = _FUSED[proj]
        fused_name = f"{layer}.mlp.experts.{fused_name}"
        if self._fused is None or self._fused[0] != fused_name:
            self._fused = (fused_name, np.asarray(self.reader(fused_name)))
        tensor = self._fused[1][expert]
        if half is None:
            return tensor
        f = tensor.shape[0] // 2
        return tensor[half * f:(half + 1) * f]

    def __call__(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        try:
            return self._resolve(lambda n: self.reader(n) if index is None
                                 else self.reader(n, index), name)
        except KeyError:
            if index is not None or _EXPERT_NAME.match(name) is None:
                raise
            return self._fused_expert(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._resolve(self.reader.shape, name)
