"""Pipeline schedules as data: what each stage does, step by step, to run one batch.

A schedule for stage `stage_id` of `stages` yields, for each step, a list of instructions
(`LoadMicroBatch`, `ForwardPass`, `SendActivation`, ...), each naming the pipeline buffer it works
on. Steps are lockstep: every stage runs step t at the same time, and a send on one stage is
paired with the receive on its neighbour in the same step, so a barrier between steps never
deadlocks. Nothing here runs anything; an executor interprets the instructions (DeepSpeed's
`PipelineEngine` with torch p2p, ours with `ppermute` over the stage axis, via `table.py`).

    TrainSchedule       DeepSpeed's synchronous 1F1B (Narayanan et al. 2019, PipeDream-Flush)
    GPipeSchedule       all forwards, then all backwards (Huang et al. 2019, GPipe)
    InferenceSchedule   forwards only
    ZBH1Schedule        zero-bubble 1F1B (Qi et al. 2023, ZB-H1), backward split into the
                        input-gradient pass B and the weight-gradient pass W
                        (`zeroxla.pipeline.zero_bubble`; not DeepSpeed's)

`TrainSchedule` and `InferenceSchedule` yield exactly DeepSpeed's instruction streams
(`deepspeed/runtime/pipe/schedule.py`, unchanged since v0.8.3): the same instructions, buffer ids
and order within a step. Where DeepSpeed computes each step's micro-batch from step and stage
parities, we write the closed form (`compute_at`) and derive the instructions from it.

Every step of a stage has the same shape:
  1. send the result of the previous step's compute on to the stage that needs it (activations
     to stage + 1, gradients to stage - 1);
  2. receive this step's input (an activation from stage - 1 for a forward, a gradient from
     stage + 1 for a backward), and on the first and last stages load the micro-batch (inputs and
     labels respectively);
  3. compute: one forward or one backward pass (or, in a split backward, one weight-gradient
     pass), or nothing (a bubble);
  4. after the last step of a training batch: ReduceTiedGrads, ReduceGrads, OptimizerStep.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterator


# --- Instructions (DeepSpeed's names and fields) ---------------------------------------------

@dataclasses.dataclass(frozen=True, repr=False)
class PipeInstruction:
    """One thing a stage does in a step. Subclasses add fields; the repr is DeepSpeed's,
    `ForwardPass(buffer_id=0)`, so streams print the same in both."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{self.name}({fields})"


class OptimizerStep(PipeInstruction):
    """Apply the optimizer to the accumulated gradients and zero them (after the reductions)."""


class ReduceGrads(PipeInstruction):
    """Reduce the stage's gradients over its data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of modules tied across stages (e.g. input and output embeddings).
    Which stages take part is known only once layers are partitioned: at worst, all of them."""


@dataclasses.dataclass(frozen=True, repr=False)
class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer: the slot holding one in-flight micro-batch's
    inputs, outputs and gradients on this stage."""

    buffer_id: int


class LoadMicroBatch(BufferOpInstruction):
    """Fill the buffer with the next micro-batch from the data iterator: inputs on the first
    stage, labels on the last."""


class ForwardPass(BufferOpInstruction):
    """outputs[buffer_id] = stage_forward(inputs[buffer_id])."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate gradients[buffer_id] (the loss on the last stage) through the forward
    that produced outputs[buffer_id]; accumulate parameter gradients."""


class BackwardWeightPass(BufferOpInstruction):
    """Zero-bubble schedules only (not a DeepSpeed instruction): the weight-gradient pass W of
    the micro-batch in buffer_id, whose BackwardPass (then the input-gradient pass B) ran in an
    earlier step; accumulate the stage's parameter gradients. torch.distributed.pipelining
    calls the two halves BACKWARD_INPUT and BACKWARD_WEIGHT."""


class SendActivation(BufferOpInstruction):
    """Send outputs[buffer_id] to stage + 1 (paired with its RecvActivation)."""


class RecvActivation(BufferOpInstruction):
    """inputs[buffer_id] = the activation sent by stage - 1 (paired with its SendActivation)."""


class SendGrad(BufferOpInstruction):
    """Send the gradient w.r.t. inputs[buffer_id] to stage - 1 (paired with its RecvGrad)."""


class RecvGrad(BufferOpInstruction):
    """gradients[buffer_id] = the gradient sent by stage + 1 (paired with its SendGrad)."""


# --- Schedules --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Compute:
    """What a stage computes in one step: the forward or the backward pass of one micro-batch,
    or (`is_weight`, zero-bubble schedules) the weight-gradient pass W of a backward split in
    two; `is_forward` is then False and the backward before it is the input-gradient pass B."""

    micro_batch_id: int
    is_forward: bool
    is_weight: bool = False


def _check(schedule: str, field: str, value: object, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{schedule}: {field}={value!r} is invalid; accepted: {accepted}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class PipeSchedule(abc.ABC):
    """The instruction stream of one stage (`stage_id` of `stages`) for one batch of
    `micro_batches` micro-batches. Iterating yields the steps, each a list of instructions."""

    micro_batches: int
    stages: int
    stage_id: int

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(name, "micro_batches", self.micro_batches,
               _is_int(self.micro_batches) and self.micro_batches >= 1, "an integer >= 1")
        _check(name, "stages", self.stages, _is_int(self.stages) and self.stages >= 1,
               "an integer >= 1")
        _check(name, "stage_id", self.stage_id,
               _is_int(self.stage_id) and 0 <= self.stage_id < self.stages,
               f"an integer in 0..{self.stages - 1} (stages={self.stages})")

    @property
    @abc.abstractmethod
    def num_steps(self) -> int:
        """Steps in one batch, the same on every stage."""

    @abc.abstractmethod
    def compute_at(self, step_id: int) -> Compute | None:
        """This stage's forward or backward in `step_id`, or None if it idles (a bubble)."""

    @abc.abstractmethod
    def instructions_at(self, step_id: int) -> list[PipeInstruction]:
        """The instructions of `step_id`, in the order the stage issues them."""

    def num_pipe_buffers(self) -> int:
        """Buffers this stage allocates: at least the micro-batches it has in flight."""
        return self.micro_batches

    def buffer_id(self, micro_batch_id: int) -> int:
        """The buffer holding `micro_batch_id`: buffers are reused cyclically."""
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        """The instructions of each step, step 0 first."""
        for step_id in range(self.num_steps):
            yield self.instructions_at(step_id)

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def __len__(self) -> int:
        return self.num_steps

    # Building blocks of a step; each schedule puts them in its own order.

    def _send(self, step_id: int) -> list[PipeInstruction]:
        """Step 1: pass the previous step's result on (nothing if there was none, or if this is
        the stage at the end it would travel towards)."""
        done = self.compute_at(step_id - 1) if step_id > 0 else None
        if done is None or done.is_weight:              # W makes nothing another stage needs
            return []
        buffer = self.buffer_id(done.micro_batch_id)
        if done.is_forward:
            return [] if self.is_last_stage else [SendActivation(buffer)]
        return [] if self.is_first_stage else [SendGrad(buffer)]

    def _recv(self, step_id: int) -> list[PipeInstruction]:
        """Step 2: receive this step's input from the neighbour that produced it."""
        work = self.compute_at(step_id)
        if work is None or work.is_weight:              # W reads only this stage's buffer
            return []
        buffer = self.buffer_id(work.micro_batch_id)
        if work.is_forward:
            return [] if self.is_first_stage else [RecvActivation(buffer)]
        return [] if self.is_last_stage else [RecvGrad(buffer)]

    def _load(self, step_id: int) -> list[PipeInstruction]:
        """Step 2: the first stage loads a forward's inputs, the last stage its labels."""
        work = self.compute_at(step_id)
        if work is None or not work.is_forward:
            return []
        if not (self.is_first_stage or self.is_last_stage):
            return []
        return [LoadMicroBatch(self.buffer_id(work.micro_batch_id))]

    def _compute(self, step_id: int) -> list[PipeInstruction]:
        """Step 3: this step's forward, backward or weight-gradient pass, if any."""
        work = self.compute_at(step_id)
        if work is None:
            return []
        buffer = self.buffer_id(work.micro_batch_id)
        if work.is_weight:
            return [BackwardWeightPass(buffer)]
        return [ForwardPass(buffer) if work.is_forward else BackwardPass(buffer)]

    def _optimizer_step(self, step_id: int) -> list[PipeInstruction]:
        """Step 4: reduce and apply the accumulated gradients after the batch's last step."""
        if step_id != self.num_steps - 1:
            return []
        return [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def _exchange_in_parity(self, step_id: int) -> list[PipeInstruction]:
        """One step of a schedule whose stages alternate forward and backward along the pipe
        (1F1B, ZB-H1). Sends and receives are blocking p2p in DeepSpeed. In a step where stage s
        computes a forward, its neighbours compute backwards (parities alternate along the
        pipe); the forward stage sends its gradient before receiving its activation and the
        backward stage receives its gradient before sending its activation, so each pair of
        stages exchanges in the same order on both sides."""
        send, recv = self._send(step_id), self._recv(step_id)
        forward_step = (step_id - self.stage_id) % 2 == 0
        exchange = send + recv if forward_step else recv + send
        return (exchange + self._load(step_id) + self._compute(step_id)
                + self._optimizer_step(step_id))

    def _micro_batch(self, micro_batch_id: int, is_forward: bool) -> Compute | None:
        if 0 <= micro_batch_id < self.micro_batches:
            return Compute(micro_batch_id, is_forward)
        return None


class TrainSchedule(PipeSchedule):
    """DeepSpeed's training schedule: synchronous one-forward-one-backward (1F1B).

    Each stage alternates forward and backward steps. The forward of micro-batch m reaches stage
    s at step 2m + s: the first stage starts a micro-batch every other step, and each stage
    runs it one step after the stage before. The other steps are for backwards: stage s runs the
    backward of m at step 2m + 2S - 1 - s, one step after stage s + 1 did, so the last stage
    runs each backward right after its forward. Stage s thus holds the activations of at most
    S - s micro-batches at once (PipeDream-Flush), where GPipe holds all M, for the same
    bubble: 2(M + S - 1) steps of which each stage computes in 2M.
    """

    @property
    def num_steps(self) -> int:
        return 2 * (self.micro_batches + self.stages - 1)

    def compute_at(self, step_id: int) -> Compute | None:
        # Forward steps are those with step_id - stage_id even: 2m + s. The backward step
        # 2m + 2S - 1 - s has the other parity, so a stage never has both in one step.
        if (step_id - self.stage_id) % 2 == 0:
            return self._micro_batch((step_id - self.stage_id) // 2, is_forward=True)
        first_backward = 2 * self.stages - 1 - self.stage_id       # of micro-batch 0
        return self._micro_batch((step_id - first_backward) // 2, is_forward=False)

    def num_pipe_buffers(self) -> int:
        """The micro-batches in flight on this stage, min(S - stage_id, M), but never fewer
        than two: DeepSpeed's allocation, kept so buffer ids match its streams."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def instructions_at(self, step_id: int) -> list[PipeInstruction]:
        return self._exchange_in_parity(step_id)


class GPipeSchedule(PipeSchedule):
    """All forwards, then all backwards (GPipe), in the same lockstep form as `TrainSchedule`.

    Forward phase, steps 0 .. M + S - 2: stage s runs the forward of m at step m + s.
    Backward phase, the next M + S - 1 steps: stage s runs the backward of m at step
    (M + S - 1) + m + (S - 1 - s); the last stage starts right after its last forward and the
    gradient of m walks back one stage per step. Same step count and bubble as 1F1B, but every
    stage keeps all M micro-batches' activations until the backward phase: M buffers.
    """

    @property
    def num_steps(self) -> int:
        return 2 * (self.micro_batches + self.stages - 1)

    def compute_at(self, step_id: int) -> Compute | None:
        phase = self.micro_batches + self.stages - 1                 # steps per phase
        if step_id < phase:
            return self._micro_batch(step_id - self.stage_id, is_forward=True)
        backward_id = step_id - phase - (self.stages - 1 - self.stage_id)
        return self._micro_batch(backward_id, is_forward=False)

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def instructions_at(self, step_id: int) -> list[PipeInstruction]:
        # A stage sends and receives in the same direction here (activations up in the forward
        # phase, gradients down in the backward phase). For blocking p2p, even stages send
        # first and odd stages receive first, so neighbours always pair up (as in
        # DeepSpeed's InferenceSchedule).
        send, recv = self._send(step_id), self._recv(step_id)
        exchange = send + recv if self.stage_id % 2 == 0 else recv + send
        return (exchange + self._load(step_id) + self._compute(step_id)
                + self._optimizer_step(step_id))


class InferenceSchedule(PipeSchedule):
    """Forwards only: stage s runs the forward of micro-batch m at step m + s, M + S - 1 steps.

    Two buffers alternate: a stage receives micro-batch m into one while it sends m - 1 from the
    other. Even stages send before receiving, odd stages receive before sending, so blocking
    p2p pairs up along the pipe.
    """

    @property
    def num_steps(self) -> int:
        return self.micro_batches + self.stages - 1

    def compute_at(self, step_id: int) -> Compute | None:
        return self._micro_batch(step_id - self.stage_id, is_forward=True)

    def num_pipe_buffers(self) -> int:
        return 2

    def instructions_at(self, step_id: int) -> list[PipeInstruction]:
        send, recv = self._send(step_id), self._recv(step_id)
        exchange = send + recv if self.stage_id % 2 == 0 else recv + send
        # DeepSpeed loads before exchanging here (after, in TrainSchedule).
        return self._load(step_id) + exchange + self._compute(step_id)
