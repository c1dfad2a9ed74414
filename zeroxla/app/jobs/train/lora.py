"""The `lora` section of a `zeroxla train` job: DeepSpeed-Chat's `--lora_dim`,
`--lora_module_name` and `--only_optimize_lora`, plus LoRA's alpha (PEFT's `lora_alpha`;
DeepSpeed-Chat's `lora_scaling` is alpha / dim), checked by `zeroxla.lora.LoRAConfig`'s own
checks.

`LoRA.config()` is the one place the section becomes the library's `LoRAConfig`; a checkpoint
records the section with the rest of the tree (`zeroxla.app.jobs.train.resume`: `--resume` rebuilds
the adapted model), and its metadata holds the LoRAConfig too
(`zeroxla.checkpoint.adapters.METADATA_KEY`: `zeroxla export` merges or exports the adapters).

Adapters on a model, and where a job's adapters apply, are `zeroxla.app.jobs.loading`'s.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from zeroxla.lora.config import LoRAConfig


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Rank-`dim` adapters on the weights whose path matches `module_name` (0: no LoRA)."""

    NAME: ClassVar[str] = "lora"
    dim: int = LoRAConfig.dim
    alpha: float = LoRAConfig.alpha
    module_name: str = LoRAConfig.module_name
    only_optimize_lora: bool = LoRAConfig.only_optimize_lora

    def __post_init__(self) -> None:
        self.config()

    def config(self) -> LoRAConfig:
        """The library's LoRAConfig; its errors name the tree's field."""
        try:
            return LoRAConfig(**dataclasses.asdict(self))
        except ValueError as err:
            raise ValueError(re.sub(r"^LoRAConfig\.", "TrainJobConfig.lora.", str(err))) from None

    @property
    def enabled(self) -> bool:
        return self.dim > 0


__all__ = ["LoRA"]
