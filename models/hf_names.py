"""The name fallbacks real Hugging Face checkpoints need (`NameFallbacks`): a reader answering
the names our tensor maps use (`models.hf`) from checkpoints that store them otherwise: GPT-2
without its `transformer.` prefix, MoE experts fused into 3-D tensors, a vision-language
model's language model under `model.language_model.` (or Gemma 3's `language_model.model.`),
gpt-oss' experts stored as MXFP4 (`<name>_blocks`, `<name>_scales`: `models.mxfp4`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import mxfp4

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
    Mixtral's router under `mlp.gate`) answers the per-expert names (the fused tensor flat
    or under the language model's prefix, Qwen3.5 MoE's published layout), the last fused
    tensor read kept for the next expert; a vision-language checkpoint answers `model.*` from
    `model.language_model.*` (or `language_model.model.*`); with `quantization_config`'s
    quant_method "mxfp4" (gpt-oss), a weight stored as `<name>_blocks` and `<name>_scales`
    answers `<name>` decoded (`models.mxfp4`). Called and `shape`d as the reader is
    (`SafetensorsReader`)."""

    def __init__(self, reader: Callable[..., np.ndarray], hf: Mapping[str, Any]):
        self.reader = reader
        self._fused: tuple[str, np.ndarray] | None = None
        quant = hf.get("quantization_config") or {}
        self.mxfp4 = quant.get("quant_method") == "mxfp4"      # gpt-oss' released experts
        self._said_mxfp4 = False

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
            self._fused = (fused_name, np.asarray(self._resolve(self.reader, fused_name)))
        tensor = self._fused[1][expert]
        if half is None:
            return tensor
        f = tensor.shape[0] // 2
        return tensor[half * f:(half + 1) * f]

    def _mxfp4(self, name: str) -> np.ndarray:
        """The float32 weight `name` decoded from its MXFP4 `_blocks` and `_scales`
        (`models.mxfp4.decode`, exact); KeyError when the checkpoint has neither."""
        try:
            blocks = self._resolve(self.reader, name + mxfp4.BLOCKS)
            scales = self._resolve(self.reader, name + mxfp4.SCALES)
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint, nor its MXFP4 "
                           f"{name}{mxfp4.BLOCKS} and {name}{mxfp4.SCALES}") from None
        if not self._said_mxfp4:
            logging.getLogger(__name__).warning(
                "%s and the other MXFP4 expert weights (quantization_config.quant_method="
                "'mxfp4') are decoded exactly to float32 while reading; a save writes them "
                "unquantized, in its dtype, without quantization_config", name)
            self._said_mxfp4 = True
        return mxfp4.decode(blocks, scales, name)

    def __call__(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        try:
            return self._resolve(lambda n: self.reader(n) if index is None
                                 else self.reader(n, index), name)
        except KeyError:
            if self.mxfp4 and not _EXPERT_NAME.match(name):
                weight = self._mxfp4(name)
                return weight if index is None else weight[index]
            if index is not None or _EXPERT_NAME.match(name) is None:
                raise
            return self._fused_expert(name)

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return self._resolve(self.reader.shape, name)
        except KeyError:
            if not self.mxfp4:
                raise
            return mxfp4.decoded_shape(self._resolve(self.reader.shape, name + mxfp4.BLOCKS))
