"""The rollout engine's scheduler over its D data groups: it plans each step and takes the
step's draws back, so the loop that runs the compiled step only moves arrays (vLLM v1's
`schedule() -> SchedulerOutput` and `update_from_output`):

    scheduler = StepScheduler(shape, requests, eos_id, key_shape, vocab_size)
    while not scheduler.done:
        plan = scheduler.schedule()                       # step_plan.StepPlan
        tokens, logprobs = <run the step on plan.inputs>  # [D, S] each, one per slot
        for answer in scheduler.update(plan, tokens, logprobs):  # + experts [D, N, L, k]
            ...                                           # Finished: output index, arrays
    scheduler.stats()

`schedule` admits queued requests (the emptiest group first), lets each group's
`scheduler.GroupScheduler` pick its chunks and page copies (preempting when its pool runs out)
and fills the step's arrays (`step_plan.StepPlan.build`); `update` appends each sampling
sequence's token and log-prob and finishes a sequence at EOS or at its own `max_new`, freeing
its slot and pages for the queue. Given the step's routing (an MoE model's experts per place,
`experts`), `update` also writes each chunk's experts into its sequence's record at the chunk's
positions (a forked group's prompt chunk into every answer), and a finished answer carries
its record. Host side only: no JAX program runs here.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from zeroxla.inference.pages import PagePool
from zeroxla.inference.scheduler import GroupScheduler, Request, Sequence
from zeroxla.inference.step_plan import BatchShape, GroupPlan, StepPlan, filler_rows


@dataclasses.dataclass(frozen=True)
class Finished:
    """A finished answer: output index `output` (`Request.outputs`), its tokens (prompt then
    new tokens, the last one EOS where it ended there) and the log-probs of its new tokens."""

    output: int
    tokens: np.ndarray                      # int32 [P + new]
    logprobs: np.ndarray                    # float32 [new]
    routing: np.ndarray | None = None       # int32 [P + new, L, k]: the experts of each fed
    #                                         token; -1 on the last (never fed)


class StepScheduler:
    """The D groups' schedulers, the request queue and the counts behind `stats` of one
    `ContinuousBatcher.run` (module docstring)."""

    def __init__(self, shape: BatchShape, requests: Iterable[Request], eos_id: int | None,
                 key_shape: tuple[int, ...], vocab_size: int):
        self.shape, self.eos_id, self.key_shape = shape, eos_id, key_shape
        self.groups = [GroupScheduler(shape.slots, shape.tokens,
                                      PagePool(shape.pages, shape.page_size))
                       for _ in range(shape.groups)]
        self.queue = deque(requests)
        # a slot that does not sample in a step keeps its last row: the rows the step sees
        # choose its top-k / top-p branches (`row_sampling.row_log_weights`)
        self._rows = filler_rows(shape, vocab_size)
        self._pending: StepPlan | None = None
        self._counts = dict(steps=0, tokens_fed=0, prefill_tokens=0, generated_tokens=0,
                            pages=0, live_tokens=0)

    @property
    def done(self) -> bool:
        """No request queued and no sequence running."""
        return not self.queue and not any(g.running for g in self.groups)

    def schedule(self) -> StepPlan:
        """The next step: admissions (emptiest group first), then each group's chunks and page
        copies (`GroupScheduler.plan`), as a `StepPlan`."""
        for group in sorted(self.groups, key=lambda g: -len(g.free_slots)):   # emptiest first
            group.admit(self.queue)
        plans = []
        for group in self.groups:
            chunks, copies = group.plan()
            plans.append(GroupPlan(tuple(chunks), tuple(copies)))
            self._counts["pages"] += group.pool.in_use
            self._counts["live_tokens"] += live_tokens(group)
        if not any(plan.chunks for plan in plans):
            raise RuntimeError("no sequence could be scheduled: the page pool is smaller "
                               "than one sequence")
        for chunk in (chunk for plan in plans for chunk in plan.chunks):
            self._counts["tokens_fed"] += chunk.count
            self._counts["prefill_tokens"] += (chunk.count if chunk.first < chunk.seq.prompt_size
                                               else 0)
        self._rows = jax.tree.map(np.copy, self._rows)    # the plan keeps its own rows
        self._pending = StepPlan.build(tuple(plans), self.shape, self.key_shape, self._rows)
        return self._pending

    def update(self, plan: StepPlan, tokens: np.ndarray, logprobs: np.ndarray,
               experts: np.ndarray | None = None) -> list[Finished]:
        """Takes the draws of `plan`'s step (the last `schedule`'s): tokens int32 [D, S] and
        logprobs float32 [D, S], one per slot. Each sampling sequence appends its slot's draw;
        one at EOS or at its own `max_new` finishes (its slot and pages freed). `experts`
        int32 [D, N, L, k] (the program's places, `StepPlan.places`): the step's routing,
        recorded per sequence (`record_routing`) and returned with each finished answer.
        Returns the finished answers in the order they finished."""
        if plan is not self._pending:
            raise ValueError("update(plan=...) takes the plan the last schedule() returned, "
                             "once; got another")
        self._pending = None
        if experts is not None:
            record_routing(plan, experts)
        finished = []
        for d, (group, group_plan) in enumerate(zip(self.groups, plan.groups)):
            for seq in group_plan.samples:
                self._counts["generated_tokens"] += 1
                seq.tokens.append(int(tokens[d, seq.slot]))
                seq.logprobs.append(float(logprobs[d, seq.slot]))
                if ((self.eos_id is not None and seq.tokens[-1] == self.eos_id)
                        or seq.generated >= seq.request.max_new):
                    finished.append(Finished(
                        seq.request.outputs[seq.answer], np.asarray(seq.tokens, np.int32),
                        np.asarray(seq.logprobs, np.float32),
                        None if experts is None else routing_record(seq, experts.shape[2:])))
                    group.finish(seq)
        self._counts["steps"] += 1
        return finished

    def stats(self) -> dict[str, Any]:
        """steps, tokens fed, prefill tokens (fed at positions of a prompt, recomputed ones
        included), generated tokens, pages in use after each step's plan (mean over steps and
        groups; peak), KV slots held per token in the cache, preemptions."""
        counts, shape = self._counts, self.shape
        return {"steps": counts["steps"], "tokens_fed": counts["tokens_fed"],
                "prefill_tokens": counts["prefill_tokens"],
                "generated_tokens": counts["generated_tokens"],
                "mean_pages_in_use": counts["pages"] / max(1, counts["steps"] * shape.groups),
                "kv_slots_per_live_token": (counts["pages"] * shape.page_size
                                            / max(1, counts["live_tokens"])),
                "peak_pages_in_use": max(g.pool.peak for g in self.groups),
                "preemptions": sum(g.preemptions for g in self.groups)}


def record_routing(plan: StepPlan, experts: np.ndarray) -> None:
    """Writes each chunk's experts (`experts` int32 [D, N, L, k] at the program's places) into
    its sequence's record at the chunk's positions, and into every answer a group's prompt
    forked into at this chunk (each holds a copy of the prompt's earlier chunks)."""
    for d, group_plan in enumerate(plan.groups):
        for chunk in group_plan.chunks:
            fed = experts[d, plan.places[d, chunk.start:chunk.start + chunk.count]]
            for seq in chunk.samples or (chunk.seq,):
                seq.routing[chunk.first:chunk.first + chunk.count] = list(fed)


def routing_record(seq: Sequence, dims: tuple[int, ...]) -> np.ndarray:
    """A finished sequence's record int32 [len(tokens), L, k] (`dims` = (L, k)): each fed
    token's experts, -1 on its last token (drawn, never fed)."""
    record = np.full((len(seq.tokens),) + tuple(dims), -1, np.int32)
    if seq.routing:
        record[:len(seq.routing)] = np.stack(seq.routing)
    return record


def live_tokens(group: GroupScheduler) -> int:
    """Tokens in a group's cache, each once however many sequences read it (a shared prompt
    page counts its filled slots once)."""
    fill: dict[int, int] = {}
    size = group.pool.page_size
    for seq in group.running:
        for i, page in enumerate(seq.table):
            fill[page] = max(fill.get(page, 0), min(size, seq.cached - i * size))
    return sum(fill.values())


__all__ = ["Finished", "StepScheduler", "live_tokens", "record_routing", "routing_record"]
