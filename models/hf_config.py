"""Hugging Face `config.json` <-> our model configs through the family registry
(`models.families`: each family's mapping, the options it does not build refused by key; the
tensors: `models.hf`), and the head a checkpoint carries (`hf_head`, from `architectures`).

Two heads are read and written: a causal LM (`GPT2LMHeadModel`, `LlamaForCausalLM`, ...: our
models as they are) and a sequence classifier with one label (`GPT2ForSequenceClassification`,
`Qwen2ForSequenceClassification`, ..., `num_labels=1`: a reward or value model, which TRL, OpenRLHF
and verl load as such; ours is `zeroxla.rlhf.RewardModel`). Any other head is refused by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .families import CAUSAL_LM, REGISTRY, SEQUENCE_CLASSIFICATION, family
from .gpt import GPTConfig
from .gemma2 import Gemma2Config
from .llama import LlamaConfig
from .safetensors_io import _np_dtype

Config = GPTConfig | LlamaConfig | Gemma2Config

# head -> family -> the transformers class that config.json's `architectures` names.
# A family transformers has no class of a head for (OLMoE's sequence classifier) is absent there.
ARCHITECTURES = {head: {name: spec.architectures[head] for name, spec in REGISTRY.items()
                        if head in spec.architectures}
                 for head in (CAUSAL_LM, SEQUENCE_CLASSIFICATION)}
# (class-name suffix, head kind), first match wins; the kinds after the first three are refused.
# A vision-language `*ForConditionalGeneration` is read as its causal language model (Qwen3.5's
# published checkpoints, `families.qwen3_5`); a model_type no family builds is refused by it.
_HEAD_SUFFIXES = (("ForCausalLM", CAUSAL_LM), ("LMHeadModel", CAUSAL_LM),
                  ("ForConditionalGeneration", CAUSAL_LM),
                  ("ForSequenceClassification", SEQUENCE_CLASSIFICATION),
                  ("ForTokenClassification", "token_classification"),
                  ("ForQuestionAnswering", "question_answering"),
                  ("DoubleHeadsModel", "double_heads"))
HEAD_NAMES = {CAUSAL_LM: "a causal LM", SEQUENCE_CLASSIFICATION:
              "a sequence-classification (reward) model",
              "token_classification": "a token-classification model",
              "question_answering": "a question-answering model",
              "double_heads": "a double-heads (LM + multiple choice) model",
              "base": "a base model whose checkpoint holds no LM head (untied)",
              "other": "a model whose head zeroxla does not read"}


def to_hf_config(config: Config, *, dtype: Any = "float32", head: str = CAUSAL_LM,
                 **overrides) -> dict[str, Any]:
    """`config.json` contents for `config` (read by transformers 4.x and 5.x) with `head`
    (CAUSAL_LM, or SEQUENCE_CLASSIFICATION with one label); `overrides` add or replace keys
    (e.g. `bos_token_id=...`, a classifier's `pad_token_id`)."""
    if head not in ARCHITECTURES:
        raise ValueError(f"head={head!r} is invalid; accepted: {', '.join(ARCHITECTURES)}")
    dtype_name = np.dtype(_np_dtype(dtype)).name
    hf = family(config.family).to_hf(config)
    hf["torch_dtype"] = hf["dtype"] = dtype_name     # 4.x and 5.x spellings
    if config.family not in ARCHITECTURES[head]:
        raise ValueError(f"transformers has no {HEAD_NAMES[head]} class of {config.family}; "
                         f"accepted families: {', '.join(sorted(ARCHITECTURES[head]))}")
    hf["architectures"] = [ARCHITECTURES[head][config.family]]
    if head == SEQUENCE_CLASSIFICATION:            # num_labels=1, as transformers spells it
        hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    hf.update(overrides)
    return hf


def from_hf_config(hf: Mapping[str, Any]) -> Config:
    """Our config (of the family config.json's `model_type` names, `models.families`) from a HF
    `config.json` dict; a ValueError names the model_type, or the key and value of any option
    the family does not build, with what is supported. Reads no tensor."""
    return family(hf.get("model_type")).from_hf(hf)


def architecture(hf: Mapping[str, Any]) -> str | None:
    """The class config.json's `architectures` names (its first entry), or None."""
    names = hf.get("architectures") or [None]
    return names[0]


def hf_head(hf: Mapping[str, Any]) -> str:
    """The head of a HF config: CAUSAL_LM, SEQUENCE_CLASSIFICATION, or another kind of
    HEAD_NAMES, read from the suffix of its `architectures` class. A config without
    `architectures` counts as a causal LM (our configs always write it; the tensors decide), and
    so does a bare base model (`GPT2Model`) whose LM head is its tied embedding."""
    name = architecture(hf)
    if name is None:
        return CAUSAL_LM
    kind = next((kind for suffix, kind in _HEAD_SUFFIXES if name.endswith(suffix)), "other")
    if kind == "other" and name.endswith("Model"):
        tied = hf.get("tie_word_embeddings", hf.get("model_type") == "gpt2")   # their defaults
        return CAUSAL_LM if tied else "base"
    return kind


def num_labels(hf: Mapping[str, Any]) -> int:
    """A classifier's label count: `id2label`'s size, else `num_labels`, else transformers'
    default of 2."""
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def check_head(hf: Mapping[str, Any], accepted: tuple[str, ...], *, user: str,
               instead: str) -> str:
    """`hf_head(hf)` when it is one of `accepted` (a sequence classifier only with one label);
    otherwise a ValueError naming the `architectures` class, what it is, what `user` (e.g.
    "`zeroxla train`") needs and what to use `instead`. Reads nothing but the config."""
    head, name = hf_head(hf), architecture(hf)
    needs = " or ".join(f"{HEAD_NAMES[h]} ({', '.join(sorted(ARCHITECTURES[h].values()))})"
                        for h in accepted)
    if head not in accepted:
        raise ValueError(f"config.json architectures={hf.get('architectures')!r}: {name} is "
                         f"{HEAD_NAMES[head]}; {user} needs {needs}; {instead}")
    if head == SEQUENCE_CLASSIFICATION and num_labels(hf) != 1:
        raise ValueError(f"config.json of {name} has num_labels={num_labels(hf)} (id2label="
                         f"{hf.get('id2label')!r}); {user} needs num_labels=1: a reward model's "
                         "one score per sequence")
    return head


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` dict of a HF checkpoint directory (or of the directory holding a
    `.safetensors` file), with a FileNotFoundError naming what is missing."""
    path = Path(path)
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.exists():
        what = "directory" if path.is_dir() else "path"
        raise FileNotFoundError(f"{what} {path} has no config.json: a Hugging Face checkpoint "
                                "directory holds config.json and model.safetensors (or "
                                "model.safetensors.index.json and its shards)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e


__all__ = ["ARCHITECTURES", "CAUSAL_LM", "HEAD_NAMES", "SEQUENCE_CLASSIFICATION", "architecture",
           "check_head", "from_hf_config", "hf_head", "num_labels", "read_hf_config",
           "to_hf_config"]
