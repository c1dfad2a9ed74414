"""Pipeline parallelism as data: DeepSpeed's schedules and layer partitioning, in plain Python.

    partition.py   which layers go to which stage (partition_uniform / _balanced / _layers)
    schedule.py    each stage's instruction stream: TrainSchedule (1F1B), GPipeSchedule,
                   InferenceSchedule, and DeepSpeed's instruction classes
    table.py       all stages' streams lowered to one [step][stage] table for a lax.scan
                   executor (schedule_table), the bubble fraction, the stage pairs that send
                   at each step (step_sends) and the repeating runs of steps (segments)
    timeline.py    the table as text or as a matplotlib picture
    config.py      PipelineConfig: micro-batches, schedule, partition method, ZeRO-3 gathers
    checks.py      what the executor needs of a schedule table and of the step
    split.py       DeepSpeed's layer list view of a model, split over the stages
    storage.py     the layer stack's storage split over the `stage` axis
    stages.py      the model's loss cut at its layer stack: what the first stage computes
                   before the blocks and the last after them (imports JAX)
    passes.py      one stage's forward and backward in a schedule step: the model's pieces
                   on the stage and the idle / forward / backward branches (imports JAX)
    executor.py    the table run as one lax.scan per segment, one ppermute per send, inside
                   the ZeRO step; built on the step's ZeroLayout by `zeroxla.make.make_step`
                   (imports JAX; loaded by zeroxla.make, not by this package)

Nothing here but executor.py, passes.py and stages.py imports JAX.
"""

from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.partition import partition_balanced, partition_layers, partition_uniform
from zeroxla.pipeline.schedule import (
    BackwardPass,
    BufferOpInstruction,
    Compute,
    ForwardPass,
    GPipeSchedule,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)
from zeroxla.pipeline.table import ScheduleTable, bubble_fraction, schedule_table

__all__ = [
    "BackwardPass", "BufferOpInstruction", "Compute", "ForwardPass", "GPipeSchedule",
    "InferenceSchedule", "LoadMicroBatch", "OptimizerStep", "PipeInstruction", "PipeSchedule",
    "PipelineConfig", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads",
    "ScheduleTable", "SendActivation", "SendGrad", "TrainSchedule", "bubble_fraction",
    "partition_balanced", "partition_layers", "partition_uniform", "schedule_table",
]
