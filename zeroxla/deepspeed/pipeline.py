"""DeepSpeed's pipeline settings read into a `PipelineConfig`.

In DeepSpeed the pipeline is mostly code (`PipelineModule(layers, num_stages,
partition_method)`); the JSON contributes the micro-batch count, which is
`gradient_accumulation_steps` (the PipelineEngine runs that many micro-batches per
`train_batch()`), and a `pipeline` section:

    pipeline.partition        -> PipelineConfig.partition_method ("best", DeepSpeed's
                                 default, is "parameters")
    pipeline.stages           the stage count: "auto" or an integer; zeroxla takes it from the
                              mesh (make_mesh(stages=...)); an integer is returned for checking
    pipeline.seed_layers, activation_checkpoint_interval, pipe_partitioned, grad_partitioned:
                              no effect (the executor always recomputes a stage's forward from
                              its stashed input; activations move whole between stages)

`pipeline_config_from_json(path_or_dict)` returns `(PipelineConfig, stages or None)`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from zeroxla.deepspeed.checks import DeepSpeedConfigError, DeepSpeedConfigWarning
from zeroxla.deepspeed.config import load_deepspeed_config, read_deepspeed_json
from zeroxla.pipeline.config import PipelineConfig

_NO_EFFECT = {
    "seed_layers": "layers are initialised by the model's own nnx.Rngs",
    "activation_checkpoint_interval": ("the pipeline executor always stashes a stage's input and "
                                       "recomputes its forward in backward"),
    "pipe_partitioned": "activations move whole between stages (no tensor-parallel split)",
    "grad_partitioned": "gradients move whole between stages (no tensor-parallel split)",
}
_PARTITION = {"best": "parameters", "parameters": "parameters", "uniform": "uniform"}


def pipeline_config_from_json(source: str | os.PathLike | Mapping[str, Any], *,
                              schedule: str = "1f1b", data_parallel_size: int | None = None,
                              name: str | None = None) -> tuple[PipelineConfig, int | None]:
    """`(PipelineConfig, stages)` of a DeepSpeed JSON: micro_batches from
    `gradient_accumulation_steps` (after DeepSpeed's batch arithmetic over
    `data_parallel_size` replicas), partition_method from `pipeline.partition`, `schedule` as
    given (DeepSpeed's engine runs 1F1B), and `pipeline.stages` when it is an integer.
    DeepSpeedConfigError names the key and the accepted values."""
    raw, src = read_deepspeed_json(source)
    src = name or src
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)     # the pipeline key itself
        accumulation = load_deepspeed_config(
            raw, data_parallel_size=data_parallel_size, name=src).gradient_accumulation_steps
    section = raw.get("pipeline", {})
    if not isinstance(section, Mapping):
        raise DeepSpeedConfigError(f"{src}: pipeline must be a JSON object (a dict)")
    partition = "parameters"
    stages = None
    for key, value in section.items():
        if key == "partition":
            if not isinstance(value, str) or not (value.lower() in _PARTITION
                                                  or value.lower().startswith("type:")):
                raise DeepSpeedConfigError(
                    f"{src}: pipeline.partition={value!r} is invalid; accepted: \"best\", "
                    "\"parameters\", \"uniform\", \"type:<regex>\"")
            partition = _PARTITION.get(value.lower(), value)
        elif key == "stages":
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool)
                                    or value < 1):
                raise DeepSpeedConfigError(f"{src}: pipeline.stages={value!r} is invalid; "
                                           "accepted: \"auto\" or an integer >= 1")
            stages = None if value == "auto" else value
        elif key in _NO_EFFECT:
            warnings.warn(f"DeepSpeed key 'pipeline.{key}' is ignored: {_NO_EFFECT[key]}",
                          DeepSpeedConfigWarning, stacklevel=2)
        else:
            accepted = ", ".join(sorted(["partition", "stages", *_NO_EFFECT]))
            raise DeepSpeedConfigError(f"{src}: unknown key 'pipeline.{key}'; accepted: "
                                       f"{accepted}")
    return (PipelineConfig(accumulation, schedule=schedule, partition_method=partition),
            stages)
