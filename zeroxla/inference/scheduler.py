"""Continuous batching on the host: which tokens of which sequences the next compiled step runs
(vLLM's scheduler, DeepSpeed-FastGen's Dynamic SplitFuse), for one data group.

Every step is a fixed budget of `tokens` token places and `slots` sampling rows:
1. admit: queued groups enter while a slot is free for each of their answers and the pool has
   pages for their prompt plus one per running sequence (oldest first);
2. decode first: every running sequence with one token to feed (its newest) gets a place;
3. then prompt chunks: sequences with more to feed (a prompt, or a preempted sequence's tokens
   being recomputed) get the places left, oldest first, a chunk each (chunked prefill);
4. a sequence whose last token is fed samples its next token in its slot; a group's prompt
   (one sequence for its G answers) forks into G sequences at that step, each sampling with its
   own key from the same logits and reading the prompt's pages (`pages.PagePool.fork`).
A finished sequence (EOS, or its own max_new tokens) frees its slot and pages at once, and the
next step refills them from the queue: the compiled step never changes shape.

When a write finds no free page, the youngest running sequence holding pages is preempted (its
pages freed; it stays in its slot and feeds its tokens again later: vLLM's recompute
preemption). The oldest sequence can always proceed, as the pool holds a whole sequence. A
group's answers are ordered too, by answer index after their request's admission, so an answer
can preempt a later one of its own group: a pool of one sequence serves a group of any size
(the later answers recomputed), as it serves the same answers asked for one by one.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import numpy as np

from zeroxla.inference.pages import OutOfPages, PagePool


@dataclasses.dataclass
class Request:
    """A prompt and the answers wanted of it: one per entry of `keys` (the seeds' key data;
    the row key folds in the prompt's hash), each written to output `outputs[i]`; all with the
    same `max_new` and sampling row."""

    prompt: np.ndarray                      # int32 [P]
    outputs: list[int]                      # where each answer goes
    keys: list[np.ndarray]                  # each answer's seed key data
    max_new: int
    row: tuple = ()                         # its `RowSampling` entries, in field order
    prompt_hash: Any = 0                    # uint32 `sampling.prompt_hash` of the prompt


@dataclasses.dataclass
class Sequence:
    """A running sequence: its tokens (prompt, then what it generated), how many are in the
    cache, its pages and its slot. A prompt not yet forked carries the group's answers."""

    tokens: list[int]
    prompt_size: int
    request: Request
    answer: int                             # index into request.outputs (-1: the shared prompt)
    slot: int
    order: tuple[int, int]                  # (admission, answer index); lower: older
    cached: int = 0
    table: list[int] = dataclasses.field(default_factory=list)
    reserved: list[int] = dataclasses.field(default_factory=list)   # its answers' slots
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # with a routing record: each fed token's experts, int32 [L, k] per position (the latest
    # feed's: a preempted sequence's recomputed tokens write theirs again)
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_size


@dataclasses.dataclass(frozen=True)
class Planned:
    """One scheduled chunk: `tokens` of `seq` at positions [first, first + count), at places
    [start, start + count) of the step, read and written through `table` (its page ids as
    the step sees them); `samples`: the sequences sampling at its last place (a group's prompt
    already forked into its answers)."""

    seq: Sequence
    first: int
    start: int
    tokens: tuple[int, ...]                 # seq.tokens[first:first + count]
    table: tuple[int, ...]                  # seq.table for this step
    samples: tuple[Sequence, ...]

    @property
    def count(self) -> int:
        return len(self.tokens)


class GroupScheduler:
    """One data group's slots, page pool and running sequences (module docstring)."""

    def __init__(self, slots: int, tokens: int, pool: PagePool):
        self.slots, self.tokens, self.pool = slots, tokens, pool
        self.free_slots = list(range(slots - 1, -1, -1))
        self.running: list[Sequence] = []
        self._order = 0
        self.preemptions = 0

    def admit(self, queue: deque) -> None:
        """Admits queued requests (oldest first) while slots and prompt pages allow."""
        while queue:
            request = queue[0]
            answers = len(request.outputs)
            # a page kept free per running sequence (each may need one soon): admissions
            # that would force preemptions wait instead (vLLM's watermark, by sequences)
            if (answers > len(self.free_slots)
                    or self.pool.pages_for(request.prompt.size) + len(self.running)
                    > self.pool.free_pages):
                return
            queue.popleft()
            reserved = [self.free_slots.pop() for _ in range(answers)]
            seq = Sequence(tokens=list(request.prompt), prompt_size=request.prompt.size,
                           request=request, answer=0 if answers == 1 else -1,
                           slot=reserved[0], order=(self._order, 0), reserved=reserved)
            self._order += 1
            self.running.append(seq)

    def _preempt_younger(self, seq: Sequence, planned: set[int]) -> bool:
        """Frees the pages of the youngest running sequence younger than `seq`, not planned
        in this step, that holds any; False when there is none."""
        younger = [s for s in self.running
                   if s.order > seq.order and s.table and id(s) not in planned]
        if not younger:
            return False
        victim = max(younger, key=lambda s: s.order)
        self.pool.free(victim.table)
        victim.cached = 0
        self.preemptions += 1
        return True

    def _writable(self, seq: Sequence, count: int, copies: list, planned: set[int]) -> bool:
        while True:
            try:
                copies += self.pool.prepare_write(seq.table, seq.cached, seq.cached + count)
                return True
            except OutOfPages:
                if not self._preempt_younger(seq, planned):
                    return False

    def plan(self) -> tuple[list[Planned], list[tuple[int, int]]]:
        """The next step's chunks (decode tokens first, then prompt chunks, oldest first) and
        the page copies to run before it; each planned sequence's `cached` counts its chunk,
        and a group's prompt whose last token is planned forks into its answers (`fork`)."""
        plans, copies, used, planned = [], [], 0, set()
        by_age = sorted(self.running, key=lambda s: s.order)
        decoding = [s for s in by_age if len(s.tokens) - s.cached == 1]
        filling = [s for s in by_age if len(s.tokens) - s.cached > 1]
        for seq in decoding + filling:
            left = len(seq.tokens) - seq.cached
            count = min(left, self.tokens - used)
            if count == 0 or not self._writable(seq, count, copies, planned):
                continue
            samples = [] if count < left else self.fork(seq) if seq.answer == -1 else [seq]
            plans.append(Planned(seq, seq.cached, used,
                                 tuple(seq.tokens[seq.cached:seq.cached + count]),
                                 tuple(seq.table), tuple(samples)))
            seq.cached += count
            planned.update(id(s) for s in [seq] + samples)
            used += count
        return plans, copies

    def fork(self, seq: Sequence) -> list[Sequence]:
        """The shared prompt `seq`, its pages written up to its last token, becomes its group's
        G answers (`seq` is the first), each reading its pages and holding a copy of its
        routing record so far (the step's own chunk is recorded into each by the update)."""
        children = [seq]
        seq.answer = 0
        for i, slot in enumerate(seq.reserved[1:], start=1):
            child = Sequence(tokens=list(seq.tokens), prompt_size=seq.prompt_size,
                             request=seq.request, answer=i, slot=slot,
                             order=(seq.order[0], i),
                             cached=len(seq.tokens), table=self.pool.fork(seq.table),
                             routing=list(seq.routing))
            children.append(child)
            self.running.append(child)
        return children

    def finish(self, seq: Sequence) -> None:
        self.pool.free(seq.table)
        self.running.remove(seq)
        self.free_slots.append(seq.slot)


__all__ = ["GroupScheduler", "Planned", "Request", "Sequence"]
