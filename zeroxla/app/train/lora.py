"""The `lora` section of a `zeroxla train` job: DeepSpeed-Chat's `--lora_dim`,
`--lora_module_name` and `--only_optimize_lora`, plus LoRA's alpha (PEFT's `lora_alpha`;
DeepSpeed-Chat's `lora_scaling` is alpha / dim), checked by `zeroxla.lora.LoRAConfig`'s own
checks.

`LoRA.config()` is the one place the section becomes the library's `LoRAConfig`; a checkpoint
records the section with the rest of the tree (`zeroxla.app.train.resume`: `--resume` rebuilds
the adapted model), and its metadata holds the LoRAConfig too
(`zeroxla.checkpoint.adapters.METADATA_KEY`: `zeroxla export` merges or exports the adapters).

Where a job's adapters apply (`adapters_base`, `recorded_base`): the weights it started from.
`zeroxla train` records its `--init-from` (a Hugging Face directory) in its tree; `zeroxla dpo`
and `zeroxla grpo` record `BASE_KEY` in their checkpoints' metadata: their `--init-from`, or,
started from a zeroxla run (GRPO's SFT `--actor` always), that run's checkpoint step they read
merged. `zeroxla export --adapter-only` names it as the PEFT adapter's
`base_model_name_or_path`: base + adapters is the trained model.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar

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


def add_adapters(model: Any, lora: LoRAConfig, rngs: Any) -> None:
    """`convert_linear_layer_to_lora(model, lora)` in place; a module_name the model refuses
    (matching no weight, or a shared one) is named as the option, `--lora-module-name`."""
    from zeroxla.lora import convert_linear_layer_to_lora

    try:
        convert_linear_layer_to_lora(model, lora, rngs=rngs)
    except ValueError as err:
        if str(err).startswith("LoRAConfig.module_name"):
            raise ValueError(f"--lora-module-name {lora.module_name!r}: {err}") from None
        raise


BASE_KEY = "adapters_base"      # checkpoint metadata: the weights the adapters apply to


def adapters_base(source: str | Path) -> str:
    """The absolute path of the weights a job that starts from `source` (its --init-from or
    --actor) puts its adapters on: a Hugging Face directory (holding config.json) itself; a
    zeroxla run or checkpoint directory, its newest complete step `<checkpoint>/<step>`, which
    the job reads merged (`load_trained`) and `zeroxla export` writes as a HF model."""
    from zeroxla import checkpoint
    from zeroxla.app import rundir

    path = Path(source).absolute()
    if (path / "config.json").is_file():
        return str(path)
    directory = rundir.checkpoint_dir_of(path)
    step = checkpoint.latest_step(directory) if directory.is_dir() else None
    return str(path if step is None else directory / str(step))


def recorded_base(meta: dict[str, Any]) -> str | None:
    """The base a checkpoint's adapters apply to (`checkpoint.read_metadata`'s JSON): the
    recorded `BASE_KEY` (dpo, grpo), else a `zeroxla train` run's --init-from; None for a
    preset's run."""
    metadata = meta.get("metadata") or {}
    if metadata.get(BASE_KEY) is not None:
        return metadata[BASE_KEY]
    return ((metadata.get("job_config") or {}).get("model") or {}).get("init_from")


__all__ = ["BASE_KEY", "LoRA", "adapters_base", "add_adapters", "recorded_base"]
