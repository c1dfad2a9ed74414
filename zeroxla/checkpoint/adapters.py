"""A checkpoint of a LoRA model read as the model its adapters define, for export.

A LoRA model (`zeroxla.lora`) stores each adapted weight as three arrays, `params/<path>/base`
W, `lora_a` A [*L, *IN, r] and `lora_b` B [*L, r, *OUT]; the scaling alpha / r is not an array
but the `LoRAConfig` the trainer records in the checkpoint's metadata under `METADATA_KEY`
(`as_metadata`). `MergedArrays` reads such a checkpoint as if it held `params/<path>` =
W + (alpha / r) A @ B (`LoRAWeight`'s sum, in float64 numpy, one layer at a time like every
export read), so the streaming export writes the merged model without building it. A frozen
base stored as int8/int4 codes reads dequantized (`StoredArrays.read`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from zeroxla.lora.config import LoRAConfig

METADATA_KEY = "lora"               # checkpoint metadata: LoRAConfig's fields
ADAPTER_FIELDS = ("base", "lora_a", "lora_b")


def as_metadata(lora: LoRAConfig) -> dict[str, Any] | None:
    """A checkpoint's record of the adapters (None without LoRA)."""
    return dataclasses.asdict(lora) if lora.enabled else None


def recorded_lora(meta: dict[str, Any]) -> LoRAConfig | None:
    """The LoRAConfig a checkpoint's stored JSON (`read_metadata`'s) records, else None."""
    record = (meta.get("metadata") or {}).get(METADATA_KEY)
    return None if record is None else LoRAConfig(**record)


def adapted_paths(arrays: Any) -> tuple[str, ...]:
    """The parameter paths stored as base + adapters ('blocks/layers/wq')."""
    return tuple(sorted(n[len("params/"):-len("/lora_a")] for n in arrays.meta["arrays"]
                        if n.startswith("params/") and n.endswith("/lora_a")))


def merged(base: np.ndarray, a: np.ndarray, b: np.ndarray, scaling: float) -> np.ndarray:
    """W + scaling * A @ B, float32, for W [*L, *IN, *OUT], A [*L, *IN, r], B [*L, r, *OUT]
    (the stacked dims L, if any, the same on all three)."""
    lead = a.ndim + b.ndim - 2 - base.ndim                     # stacked dims
    ins, outs, rank = a.shape[lead:-1], b.shape[lead + 1:], a.shape[-1]
    a2 = a.astype(np.float64).reshape(*a.shape[:lead], math.prod(ins), rank)
    b2 = b.astype(np.float64).reshape(*b.shape[:lead], rank, math.prod(outs))
    delta = (a2 @ b2).reshape(base.shape)
    return (base.astype(np.float64) + scaling * delta).astype(np.float32)


class MergedArrays:
    """`arrays` (a `StoredArrays`) with every adapted weight readable as `params/<path>`, the
    merged W + (alpha / r) A @ B; everything else as stored. ValueError when the checkpoint
    holds adapters but records no LoRAConfig, or its rank is not the adapters'."""

    def __init__(self, arrays: Any, lora: LoRAConfig | None):
        self.arrays, self.paths = arrays, adapted_paths(arrays)
        if self.paths and lora is None:
            raise ValueError(f"checkpoint {arrays.info.path} holds LoRA adapters "
                             f"({self.paths[:3]}) but records no LoRAConfig (metadata "
                             f"{METADATA_KEY!r}: dim, alpha): their scaling alpha / r is unknown")
        for path in self.paths:
            rank = arrays.shape(f"params/{path}/lora_a")[-1]
            if rank != lora.dim:
                raise ValueError(f"checkpoint {arrays.info.path}: {path}/lora_a has rank {rank}, "
                                 f"its recorded LoRAConfig.dim is {lora.dim}")
        self.lora = lora

    def __getattr__(self, name: str) -> Any:          # meta, info, shape of the stored arrays
        return getattr(self.arrays, name)

    def __contains__(self, name: str) -> bool:
        return name.removeprefix("params/") in self.paths or name in self.arrays

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        path = name.removeprefix("params/")
        if path not in self.paths:
            return self.arrays.read(name, index)
        base, a, b = (self.arrays.read(f"params/{path}/{f}", index) for f in ADAPTER_FIELDS)
        return merged(base, a, b, self.lora.scaling)


__all__ = ["ADAPTER_FIELDS", "METADATA_KEY", "MergedArrays", "adapted_paths", "as_metadata",
           "merged", "recorded_lora"]
