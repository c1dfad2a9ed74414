"""`PipelineConfig`: how a training step is pipelined over the mesh's `stage` axis.

    step = zeroxla.make_step(model, zeroxla.make_mesh(stages=2), optimizer=...,
                             config=zeroxla.ZeroConfig(stage=3),
                             pipeline=zeroxla.PipelineConfig(micro_batches=8))

The number of stages is the mesh's (`make_mesh(stages=S)`); this config says how many
micro-batches each data replica's batch is cut into (DeepSpeed's `gradient_accumulation_steps`
under pipelining), which schedule runs them, how the layers are split over the stages
(DeepSpeed's `PipelineModule(partition_method=...)`), and, under ZeRO-3, how often a stage
gathers its layers. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import re

from zeroxla.pipeline.schedule import GPipeSchedule, PipeSchedule, TrainSchedule
from zeroxla.pipeline.zero_bubble import ZBH1Schedule

# schedule name -> the schedule class whose table the executor runs.
SCHEDULES: dict[str, type[PipeSchedule]] = {"1f1b": TrainSchedule, "gpipe": GPipeSchedule,
                                            "zb-h1": ZBH1Schedule}
PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")
# Under ZeRO-3: gather a stage's layers around every micro-batch's forward and again in its
# backward (least memory: DeepSpeed's ZeRO-3 per-module gathers), or once per step and keep them
# until the step's last backward (fewer bytes: torchtitan's choice under pipelining).
ZERO3_GATHER_MODES = ("micro_batch", "step")


def _fail(field: str, value: object, accepted: str) -> None:
    raise ValueError(f"PipelineConfig.{field}={value!r} is invalid; accepted: {accepted}")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over the mesh's `stage` axis.

    micro_batches     M: each data replica's batch is cut into M micro-batches that flow
                      through the stages (the per-replica batch must be a multiple of M)
    schedule          "1f1b" (DeepSpeed's TrainSchedule: at most S - stage micro-batches in
                      flight), "gpipe" (all forwards, then all backwards: M in flight) or
                      "zb-h1" (zero-bubble 1F1B, Qi et al. 2023: the backward split into an
                      input-gradient and a deferred weight-gradient pass; bubble
                      (S - 1) / (3M + S - 1), at most min(S, M) micro-batches in flight)
    partition_method  how DeepSpeed's layer list view of the model (embedding, each block, the
                      head) is split: "parameters" (balance parameter counts, DeepSpeed's
                      default), "uniform" (the same number of layers) or "type:<regex>"
                      (balance the layers whose class name matches)
    zero3_gather      ZeRO-3 only: "micro_batch" or "step" (see ZERO3_GATHER_MODES)

    What a stage keeps from a micro-batch's forward to its backward is `ZeroConfig.remat`, as in
    the plain step: "none" keeps the stage's vjp residuals (no recompute), "full" keeps only the
    stage input and recomputes the stage in backward (`zeroxla.pipeline.executor`).
    """

    micro_batches: int
    schedule: str = "1f1b"
    partition_method: str = "parameters"
    zero3_gather: str = "micro_batch"

    def __post_init__(self) -> None:
        m = self.micro_batches
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            _fail("micro_batches", m, "an integer >= 1")
        if self.schedule not in SCHEDULES:
            _fail("schedule", self.schedule, ", ".join(f'"{s}"' for s in SCHEDULES))
        method = self.partition_method
        accepted = ", ".join(f'"{p}"' for p in PARTITION_METHODS)
        if not isinstance(method, str):
            _fail("partition_method", method, accepted)
        if method.lower().startswith("type:"):
            try:
                re.compile(method[len("type:"):])
            except re.error as err:
                _fail("partition_method", method, f"{accepted} with a valid regex ({err})")
        elif method.lower() not in ("parameters", "uniform"):
            _fail("partition_method", method, accepted)
        if self.zero3_gather not in ZERO3_GATHER_MODES:
            _fail("zero3_gather", self.zero3_gather,
                  ", ".join(f'"{g}"' for g in ZERO3_GATHER_MODES))

    @property
    def schedule_class(self) -> type[PipeSchedule]:
        return SCHEDULES[self.schedule]

    def replace(self, **changes: object) -> "PipelineConfig":
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)
