"""`LoRAConfig`: DeepSpeed-Chat's LoRA options (`--lora_dim`, `--lora_module_name`,
`--only_optimize_lora`) plus the `alpha` of Hu et al. 2021 (LoRA §4.1), as one frozen dataclass."""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Rank-`dim` adapters on the linear weights whose parameter path matches `module_name`.

    dim:                the adapter rank r (DeepSpeed-Chat's `lora_dim`); 0 means no LoRA.
    alpha:              the adapted weight is W + (alpha / dim) * A @ B (LoRA §4.1's scaling,
                        PEFT's `lora_alpha`; DeepSpeed-Chat's `lora_scaling` is alpha / dim).
    module_name:        a regular expression searched (`re.search`) in each parameter's
                        '/'-joined path ('blocks/layers/wq'); every weight of rank >= 2 per layer
                        it matches gets an adapter (DeepSpeed-Chat's `lora_module_name`).
    only_optimize_lora: train the adapters alone; the base weights are frozen, so optimizer
                        state exists for the adapters only.
    """

    dim: int = 0
    alpha: float = 1.0
    module_name: str = r"blocks/layers/"
    only_optimize_lora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"LoRAConfig.dim={self.dim!r} must be an int >= 0 (0: no LoRA)")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha={self.alpha!r} must be > 0")
        try:
            re.compile(self.module_name)
        except re.error as err:
            raise ValueError(f"LoRAConfig.module_name={self.module_name!r} is not a regular "
                             f"expression: {err}") from None
        if self.only_optimize_lora and not self.dim:
            raise ValueError("LoRAConfig.only_optimize_lora=True needs dim > 0 (there are no "
                             "adapters to train with dim=0)")
        # Without adapters a pattern or a scaling would be ignored and every weight would train:
        # a full fine-tune where LoRA was asked for.
        for name in ("module_name", "alpha"):
            if not self.dim and getattr(self, name) != getattr(LoRAConfig, name):
                raise ValueError(f"LoRAConfig.{name}={getattr(self, name)!r} needs dim > 0 (with "
                                 "dim=0 no weight gets adapters and every weight trains: a full "
                                 "fine-tune)")

    @property
    def enabled(self) -> bool:
        return self.dim > 0

    @property
    def scaling(self) -> float:
        """alpha / dim: the factor on A @ B."""
        return self.alpha / self.dim
