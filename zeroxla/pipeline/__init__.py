"""Pipeline parallelism as data: DeepSpeed's schedules and layer partitioning, in plain Python.

    partition.py   which layers go to which stage (partition_uniform / _balanced / _layers)
    schedule.py    each stage's instruction stream: TrainSchedule (1F1B), GPipeSchedule,
                   InferenceSchedule, and DeepSpeed's instruction classes (plus
                   BackwardWeightPass, the weight-gradient half of a split backward)
    zero_bubble.py ZBH1Schedule: zero-bubble 1F1B (ZB-H1), backward split into the input-gradient
                   pass B and the weight-gradient pass W, W deferred into 1F1B's bubbles
    table.py       all stages' streams lowered to one [step][stage] table for a lax.scan
                   executor (schedule_table), the bubble fraction, the stage pairs that send
                   at each step (step_sends) and the phases compiled as one loop each
    timeline.py    the table as text or as a matplotlib picture
    config.py      PipelineConfig: micro-batches, schedule, partition method, ZeRO-3 gathers
    checks.py      what the executor needs of a schedule table and of the step
    split.py       DeepSpeed's layer list view of a model, split over the stages
    storage.py     the layer stack's storage split over the `stage` axis
    stages.py      the model's loss cut at its layer stack: what the first stage computes
                   before the blocks and the last after them (imports JAX)
    stage_model.py the model's pieces on one stage: the computation up to the stack, the
                   stage's blocks, the head and loss (imports JAX)
    passes.py      one stage's forward and backward in a schedule step: the idle / forward /
                   backward (/ weight-gradient) branches, and what ZB-H1's B and W compute and
                   keep (imports JAX)
    step_update.py what a step's op changes in the carry (the one stash buffer it fills, its
                   gradients, its sends), written in after the switch (imports JAX)
    weight_pass.py ZB-H1's W weight-only where the blocks' vjp splits (engine.weight_split),
                   decided once per trace, or the warned fallback (imports JAX)
    executor.py    the table run as one lax.scan per phase, one ppermute per send, inside
                   the ZeRO step; built on the step's ZeroLayout by `zeroxla.make.make_step`
                   (imports JAX; loaded by zeroxla.make, not by this package)

Nothing here but executor.py, passes.py, stage_model.py, step_update.py, weight_pass.py and
stages.py imports JAX.
"""

from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.partition import partition_balanced, partition_layers, partition_uniform
from zeroxla.pipeline.schedule import (
    BackwardPass,
    BackwardWeightPass,
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
from zeroxla.pipeline.zero_bubble import ZBH1Schedule

__all__ = [
    "BackwardPass", "BackwardWeightPass", "BufferOpInstruction", "Compute", "ForwardPass",
    "GPipeSchedule", "InferenceSchedule", "LoadMicroBatch", "OptimizerStep", "PipeInstruction",
    "PipeSchedule", "PipelineConfig", "RecvActivation", "RecvGrad", "ReduceGrads",
    "ReduceTiedGrads", "ScheduleTable", "SendActivation", "SendGrad", "TrainSchedule",
    "ZBH1Schedule", "bubble_fraction", "partition_balanced", "partition_layers",
    "partition_uniform", "schedule_table",
]
