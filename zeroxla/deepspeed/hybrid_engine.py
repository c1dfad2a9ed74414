"""DeepSpeed's `hybrid_engine` section read into a `HybridEngineConfig`.

The keys, DeepSpeed's defaults and the checks live with the engine
(`zeroxla.inference.config`); this module only reads the section from a DeepSpeed JSON config.
`hybrid_engine_config_from_json(path_or_dict)` returns the `HybridEngineConfig`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from zeroxla.deepspeed.config import read_deepspeed_json
from zeroxla.inference.config import HybridEngineConfig, hybrid_engine_config_from_section


def hybrid_engine_config_from_json(source: str | os.PathLike | Mapping[str, Any]
                                   ) -> HybridEngineConfig:
    """The `hybrid_engine` section of a DeepSpeed JSON config (a path or a dict) -> config.

    A missing section gives DeepSpeed's defaults; an unknown key or a bad value is a ValueError
    naming the JSON key and the accepted keys or values."""
    raw, where = read_deepspeed_json(source)
    return hybrid_engine_config_from_section(raw.get("hybrid_engine", {}), where=where)


__all__ = ["hybrid_engine_config_from_json"]
