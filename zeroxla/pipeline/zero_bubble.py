"""ZB-H1, the zero-bubble 1F1B (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1), in
the lockstep one-hop-per-step form the executor runs.

A backward is split in two passes of about one forward's FLOPs each:
    B   the input-gradient pass: the cotangent of the stage input, sent to stage - 1 at once
        (it is on the critical path of the pipeline);
    W   the weight-gradient pass: the stage's parameter gradients, needed only by the
        optimizer step, so it can wait and fill the steps where 1F1B idles.
With F, B and W one step each, every stage computes in 3M of T = 3M + S - 1 steps: the bubble
is (S - 1) / (3M + S - 1). 1F1B's, whose backward (B and W together) takes two units, is
3(S - 1) / (3M + 3(S - 1)) = (S - 1) / (M + S - 1) in the same units.

The executor needs, as for 1F1B, F(m) on stage s exactly one step after F(m) on s - 1 and B(m)
on s exactly one step after B(m) on s + 1 (results travel one hop per step, no receive
queues). With F(m) at f_m + s and B(m) at f_m + 2S - 1 - s, F and B share a step on some stage
whenever two first-stage forward steps f differ by an odd number, so the paper's F-B-W steady
state (period 3) cannot be written this way. Instead the micro-batches run in blocks of S:

    f_m = P * (m // S) + 2 * (m % S)        P = 3S (S even or 1), 3S + 1 (S odd)

each block is 1F1B's lockstep F / B pattern, and every W runs in the first free step after its
B, oldest first: the block's W fill the next block's warm-up and cool-down steps, where 1F1B
idles. For S even (or 1) and M a multiple of S, T = 3M + S - 1 exactly, ZB-H1's bubble;
otherwise a few steps more. Memory, as in ZB-H1: a stage holds a micro-batch's activations
from F to B for at most S - s micro-batches (1F1B's), and what W needs from B to W, so at most
min(S, M) micro-batches are in flight between F and W on any stage: 1F1B's peak (stage 0's),
which in the SPMD executor every stage allocates anyway.

    for s in range(S): ZBH1Schedule(micro_batches=8, stages=4, stage_id=s)

What B and W compute and keep in this implementation: `zeroxla.pipeline.passes`.
"""

from __future__ import annotations

import functools

from zeroxla.pipeline.schedule import Compute, PipeInstruction, PipeSchedule


def block_period(stages: int) -> int:
    """P: steps between the first forwards of consecutive blocks of S micro-batches."""
    return 3 * stages if stages % 2 == 0 or stages == 1 else 3 * stages + 1


@functools.cache
def zb_h1_steps(micro_batches: int, stages: int) -> tuple[dict[int, Compute], ...]:
    """[S] {step: Compute} of every stage (see the module docstring): F and B at fixed steps,
    each W in the first step after its B where the stage computes nothing else."""
    M, S, P = micro_batches, stages, block_period(stages)
    first = [P * (m // S) + 2 * (m % S) for m in range(M)]          # f_m: F(m) on stage 0
    steps = []
    for s in range(S):
        work = {}
        for m, f in enumerate(first):
            work[f + s] = Compute(m, is_forward=True)
            work[f + 2 * S - 1 - s] = Compute(m, is_forward=False)
        if len(work) != 2 * M:
            raise AssertionError(f"ZB-H1 M={M} S={S}: a forward and a backward share a step")
        pending, t, placed = [], 0, 0                  # micro-batches whose B ran, W not yet
        while placed < M:
            if t in work:
                if not work[t].is_forward:
                    pending.append(work[t].micro_batch_id)
            elif pending:
                work[t] = Compute(pending.pop(0), is_forward=False, is_weight=True)
                placed += 1
            t += 1
        steps.append(work)
    return tuple(steps)


class ZBH1Schedule(PipeSchedule):
    """ZB-H1 (see the module docstring): each stage's forward, input-gradient pass B
    (`BackwardPass`) and weight-gradient pass W (`BackwardWeightPass`), in lockstep steps.

    Stage s runs F(m) at f_m + s and B(m) at f_m + 2S - 1 - s, as 1F1B with f_m = 2m would;
    F and B of a stage fall on steps of opposite parity, so each step's exchanges pair up with
    the neighbours' as in `TrainSchedule`. W(m) runs after B(m) on the same stage, in order.
    """

    @property
    def num_steps(self) -> int:
        return max(max(work) for work in zb_h1_steps(self.micro_batches, self.stages)) + 1

    def compute_at(self, step_id: int) -> Compute | None:
        return zb_h1_steps(self.micro_batches, self.stages)[self.stage_id].get(step_id)

    def num_pipe_buffers(self) -> int:
        """The most micro-batches between their F and their W on this stage (the W reads
        what F and B left in the buffer): at most min(S, M)."""
        work = zb_h1_steps(self.micro_batches, self.stages)[self.stage_id]
        in_flight = peak = 0
        for t in sorted(work):
            in_flight += 1 if work[t].is_forward else -1 if work[t].is_weight else 0
            peak = max(peak, in_flight)
        return peak

    def instructions_at(self, step_id: int) -> list[PipeInstruction]:
        return self._exchange_in_parity(step_id)          # TrainSchedule's order
