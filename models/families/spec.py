"""What one model family is (`Family`, torchtitan's `ModelSpec`): the config dataclass and nnx
module, the transformers classes per head, the `config.json` mapping both ways and the tensor
name map. Each family's module (`families.gpt2`, `families.llama`, ...) builds one; the table
in `families/__init__` registers them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"

# A tensor-map row: (HF name, holding "{i}" when per layer; our parameter paths, relative as
# `models.hf` resolves them; (to_hf, from_hf) reshapes, see `models.hf_rules`).
Row = tuple[str, tuple[str, ...], tuple[Callable, Callable]]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    name            config.json's `model_type`, and our config's `family`
    config_class    the frozen config dataclass (`family` == name)
    model_class     the nnx module (logical axes on every parameter; `embed`/`blocks`/`head`)
    architectures   head (CAUSAL_LM, SEQUENCE_CLASSIFICATION) -> transformers class name
    from_hf         config.json dict -> config; ValueError naming any key/value not built,
                    raised before any tensor is read
    to_hf           config -> config.json keys of the family (model_type and its options)
    tensor_map      config -> list of `Row`s covering every parameter once
    presets         preset name (`models.build`, `zeroxla train --model`) -> config factory
    aliases         other `model_type`s config.json may give the family (Qwen3.5's text model
                    saved alone is `qwen3_5_text`)
    """

    name: str
    config_class: type
    model_class: type
    architectures: Mapping[str, str]
    from_hf: Callable[[Mapping[str, Any]], Any]
    to_hf: Callable[[Any], dict[str, Any]]
    tensor_map: Callable[[Any], list[Row]]
    presets: Mapping[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    aliases: tuple[str, ...] = ()


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """ValueError naming config.json's `key`, its `value` and what is supported (`why`)."""
    if not ok:
        raise ValueError(f"config.json {key}={value!r} is not supported: {why}")
