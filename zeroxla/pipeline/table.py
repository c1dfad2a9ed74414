"""All stages' instruction streams lowered to one static table, and the bubble it implies.

An executor that runs the pipeline as `lax.scan` over steps needs, at every step, the same
program on every stage with the differences as data: which pass to run, on which buffer, what
to send and receive. `schedule_table` builds those integers by running each stage's schedule;
every field is a `[step][stage]` grid of ints (tuples, no numpy needed; `as_arrays` gives
int32 arrays of shape [T, S] for `lax.scan`, which slices one [S] row per step).

Within a step the table means, for every stage at once:
  1. sends read the buffers left by earlier steps: `send_activation` goes to stage + 1,
     `send_grad` to stage - 1 (one `ppermute` each way);
  2. the matching receives fill buffers on the neighbour (`recv_activation` from stage - 1,
     `recv_grad` from stage + 1), and `load` fills a buffer with micro-batch `load_micro_batch`;
  3. the stage runs `op` on micro-batch `micro_batch` held in buffer `buffer` (FORWARD,
     BACKWARD, or WEIGHT: the weight-gradient half of a backward that a zero-bubble schedule
     splits, BACKWARD then being the input-gradient half);
  4. where `optimizer_step` is 1, the batch's gradients are reduced and applied.

`step_sends` gives, per step, the stage pairs that send at its end (each one of DeepSpeed's
SendActivation / SendGrad instructions); an executor compiles one branch per distinct pattern.
`phases` cuts the steps into at most three runs (one-op warm-up, mixed middle, one-op
cool-down) that an executor compiles as one loop each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroxla.pipeline.schedule import (
    BackwardPass,
    BackwardWeightPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

# `op` values.
IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
# Buffer and micro-batch fields hold this where the stage does not do that thing in that step.
NONE = -1

Grid = tuple[tuple[int, ...], ...]          # [step][stage]

# Instruction class -> the ScheduleTable field holding its buffer id.
_BUFFER_FIELDS = {
    LoadMicroBatch: "load",
    RecvActivation: "recv_activation",
    SendActivation: "send_activation",
    RecvGrad: "recv_grad",
    SendGrad: "send_grad",
}
_REDUCE_AND_STEP = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
# Compute instruction class -> its `op`.
_OPS = {ForwardPass: FORWARD, BackwardPass: BACKWARD, BackwardWeightPass: WEIGHT}

# The ScheduleTable fields that are [step][stage] grids, and the value of an empty slot.
GRID_FIELDS = {
    "op": IDLE, "micro_batch": NONE, "buffer": NONE, "load": NONE, "load_micro_batch": NONE,
    "recv_activation": NONE, "send_activation": NONE, "recv_grad": NONE, "send_grad": NONE,
    "optimizer_step": 0,
}


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """Every stage's schedule for one batch, as `[step][stage]` grids of ints.

    T = `num_steps`, S = `stages`; buffer ids are per stage, below `num_pipe_buffers[stage]`.
    """

    schedule: str                         # the schedule class's name, e.g. "TrainSchedule"
    micro_batches: int                    # M
    stages: int                           # S
    num_pipe_buffers: tuple[int, ...]     # [S]
    op: Grid                              # [T][S] IDLE (0), FORWARD (1), BACKWARD (2), WEIGHT (3)
    micro_batch: Grid                     # [T][S] micro-batch of the pass, NONE when IDLE
    buffer: Grid                          # [T][S] buffer of the pass, NONE when IDLE
    load: Grid                            # [T][S] buffer LoadMicroBatch fills (inputs on
    #                                       the first stage, labels on the last), or NONE
    load_micro_batch: Grid                # [T][S] micro-batch it loads, or NONE
    recv_activation: Grid                 # [T][S] buffer receiving from stage - 1, or NONE
    send_activation: Grid                 # [T][S] buffer whose output goes to stage + 1, or NONE
    recv_grad: Grid                       # [T][S] buffer receiving a gradient from stage + 1
    send_grad: Grid                       # [T][S] buffer whose input gradient goes to stage - 1
    optimizer_step: Grid                  # [T][S] 1 after the batch's last step (ReduceTiedGrads,
    #                                       ReduceGrads, OptimizerStep), else 0

    @property
    def num_steps(self) -> int:
        return len(self.op)

    @property
    def bubble_fraction(self) -> float:
        """Idle (stage, step) slots over all S * T slots.

        A forward, a backward and a weight-gradient pass fill one slot each (lockstep steps
        of equal length, as the schedules are written). For 1F1B and GPipe, T = 2(M + S - 1)
        and each stage computes in 2M slots, so the bubble is (S - 1) / (M + S - 1); for ZB-H1
        T = 3M + S - 1 (S even, M a multiple of S) with 3M busy: (S - 1) / (3M + S - 1).
        """
        idle = sum(row.count(IDLE) for row in self.op)
        return idle / (self.num_steps * self.stages)

    def as_arrays(self) -> dict[str, Any]:
        """The grid fields as numpy int32 arrays of shape [T, S], keyed by field name."""
        import numpy as np
        shape = (self.num_steps, self.stages)
        return {name: np.asarray(getattr(self, name), dtype=np.int32).reshape(shape)
                for name in GRID_FIELDS}


def schedule_table(schedule_class: type[PipeSchedule], micro_batches: int, stages: int
                   ) -> ScheduleTable:
    """Runs `schedule_class(micro_batches, stages, s)` for every stage s into a ScheduleTable.

    Buffer ids come from the instructions; the micro-batch of each pass, which DeepSpeed's
    instructions do not carry, from the schedule's `compute_at`. Raises ValueError if a stage
    issues two instructions of one kind in a step, or if its instructions disagree with
    `compute_at`: the table has one slot of each kind per step and stage.
    """
    if not (isinstance(schedule_class, type) and issubclass(schedule_class, PipeSchedule)):
        raise ValueError(f"schedule_class={schedule_class!r} is invalid; accepted: a PipeSchedule "
                         "subclass such as TrainSchedule, GPipeSchedule or InferenceSchedule")
    schedule_class(micro_batches, stages, 0)          # validates micro_batches and stages
    schedules = [schedule_class(micro_batches, stages, s) for s in range(stages)]
    num_steps = schedules[0].num_steps
    grids = {name: [[empty] * stages for _ in range(num_steps)]
             for name, empty in GRID_FIELDS.items()}
    written = set()

    def put(field: str, step_id: int, stage_id: int, value: int) -> None:
        if (field, step_id, stage_id) in written:
            raise ValueError(f"{schedule_class.__name__} stage {stage_id} step {step_id}: two "
                             f"instructions set {field!r}; a ScheduleTable holds one per step")
        written.add((field, step_id, stage_id))
        grids[field][step_id][stage_id] = value

    for stage_id, schedule in enumerate(schedules):
        loaded = 0                          # LoadMicroBatch takes the data iterator's next item
        for step_id, instructions in enumerate(schedule.steps()):
            work = schedule.compute_at(step_id)
            for instruction in instructions:
                if type(instruction) in _OPS:
                    op = _OPS[type(instruction)]
                    if (work is None or _op_of(work) != op
                            or schedule.buffer_id(work.micro_batch_id) != instruction.buffer_id):
                        raise ValueError(f"{schedule!r} step {step_id}: {instruction!r} "
                                         f"disagrees with compute_at = {work!r}")
                    put("op", step_id, stage_id, op)
                    put("micro_batch", step_id, stage_id, work.micro_batch_id)
                    put("buffer", step_id, stage_id, instruction.buffer_id)
                elif isinstance(instruction, _REDUCE_AND_STEP):
                    grids["optimizer_step"][step_id][stage_id] = 1
                else:
                    put(_BUFFER_FIELDS[type(instruction)], step_id, stage_id,
                        instruction.buffer_id)
                    if isinstance(instruction, LoadMicroBatch):
                        put("load_micro_batch", step_id, stage_id, loaded)
                        loaded += 1

    return ScheduleTable(
        schedule=schedule_class.__name__, micro_batches=micro_batches, stages=stages,
        num_pipe_buffers=tuple(s.num_pipe_buffers() for s in schedules),
        **{name: tuple(tuple(row) for row in grid) for name, grid in grids.items()})


def _op_of(work: Any) -> int:
    """The `op` of a schedule's `Compute`."""
    return WEIGHT if work.is_weight else FORWARD if work.is_forward else BACKWARD


def bubble_fraction(schedule_class: type[PipeSchedule], micro_batches: int, stages: int
                    ) -> float:
    """The fraction of (stage, step) slots in which a stage computes nothing, counting a forward
    and a backward as one slot each; see `ScheduleTable.bubble_fraction`."""
    return schedule_table(schedule_class, micro_batches, stages).bubble_fraction


# ----------------------------------------------------------------------------------------------
# What crosses between stages at the end of each step.

@dataclasses.dataclass(frozen=True)
class StepSends:
    """The stage pairs that exchange results at the end of one step.

    A stage's forward output of step t is its neighbour's input in step t + 1 (the executor's
    one-hop-per-step rule), so these are DeepSpeed's SendActivation / SendGrad instructions of
    step t + 1, issued where the result is made.
    """

    activations: tuple[int, ...]          # stages s whose forward output goes to s + 1
    grads: tuple[int, ...]                # stages s whose input gradient goes to s - 1


def step_sends(table: ScheduleTable) -> tuple[StepSends, ...]:
    """[T] the sends at the end of each step: stage s sends its activation to s + 1 where it
    ran a forward and s < S - 1, its input gradient to s - 1 where it ran a backward and s > 0.
    Over the batch that is M (S - 1) of each, one per SendActivation / SendGrad instruction."""
    last = table.stages - 1
    return tuple(StepSends(
        activations=tuple(s for s, op in enumerate(row) if op == FORWARD and s < last),
        grads=tuple(s for s, op in enumerate(row) if op == BACKWARD and s > 0))
        for row in table.op)


@dataclasses.dataclass(frozen=True)
class Phase:
    """Steps [start, stop) that an executor compiles as one loop, and the ops they hold
    (IDLE included where some stage idles in them)."""

    start: int
    stop: int
    ops: frozenset[int]


def phases(table: ScheduleTable) -> tuple[Phase, ...]:
    """The steps cut into at most three consecutive phases: the leading steps whose stages all
    run one and the same op or idle (1F1B's and ZB-H1's warm-up forwards, GPipe's forward
    half), the trailing such steps (1F1B's cool-down backwards, ZB-H1's last weight pass,
    GPipe's backward half), and everything between (1F1B's steady state, most of ZB-H1).

    An executor compiles each op once per phase that holds it. In a one-op phase the op can
    write its stash buffer inside its branch, which XLA runs in place beside the idle branch;
    where ops mix it cannot (`zeroxla.pipeline.passes`), so the split keeps the one-op ends
    out of the mixed loop."""
    busy = [frozenset(row) - {IDLE} for row in table.op]              # [T]

    def one_op_run(order: list[int]) -> int:
        n = 0
        while (n < len(order) and len(busy[order[n]]) <= 1
               and busy[order[n]] == busy[order[0]]):
            n += 1
        return n
    T = len(busy)
    head = one_op_run(list(range(T)))
    tail = one_op_run(list(range(T - 1, head - 1, -1)))
    bounds = sorted({0, head, T - tail, T})
    return tuple(Phase(start, stop, frozenset(op for row in table.op[start:stop] for op in row))
                 for start, stop in zip(bounds, bounds[1:]))
