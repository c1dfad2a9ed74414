"""The model config a checkpoint records: a frozen config dataclass <-> its JSON record.

    {"family": "gpt2", "class": "GPTConfig", "fields": {"num_layers": 2, ...}}

`save` stores the record of the model's own `config` (or the caller's); `restore` and
`load_params` rebuild the config from it when its family is one `models` knows
(`models.FAMILIES`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroxla import models
from zeroxla.engine.layout import ZeroLayout


def config_record(config: Any) -> dict[str, Any] | None:
    """A frozen model config dataclass -> {'family', 'class', 'fields'} (init fields only)."""
    if config is None:
        return None
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"model_config must be a dataclass (e.g. GPTConfig), got "
                        f"{type(config).__name__}")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return {"family": getattr(config, "family", None), "class": type(config).__qualname__,
            "fields": fields}


def model_config_from_record(record: Mapping[str, Any] | None) -> Any:
    """Inverse of the stored model-config record (None stays None)."""
    if record is None:
        return None
    if record.get("family") not in models.FAMILIES:
        raise ValueError(f"checkpoint model family {record.get('family')!r} is not one of "
                         f"{sorted(models.FAMILIES)}; restore into a ZeroStep you build yourself")
    return models.FAMILIES[record["family"]][1](**record["fields"])


def known_model_config(meta: Mapping[str, Any]) -> Any:
    """The checkpoint's model config, or None if it has none of a family `models` knows."""
    record = meta["model_config"]
    return (model_config_from_record(record)
            if record and record.get("family") in models.FAMILIES else None)


def model_config_of(layout: ZeroLayout) -> Any:
    """The `config` dataclass of the layout's model, if the model keeps one (models/ do)."""
    config = getattr(layout.model_def.abstract_module(), "config", None)
    return config if dataclasses.is_dataclass(config) else None


__all__ = ["config_record", "known_model_config", "model_config_from_record", "model_config_of"]
