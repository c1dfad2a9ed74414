"""The host page pool (`pages.PagePool`) and one data group's scheduler
(`scheduler.GroupScheduler`), counted by hand: a GRPO group holds its prompt once and each
answer's own tokens (KV bytes = prompt + the answers, at page granularity), copy-on-write
copies exactly the shared page an answer first writes into, a full pool is refused without
change, and a step's places go to decode tokens first, then prompt chunks, oldest first."""

from collections import deque

import numpy as np
import pytest

from zeroxla.inference.pages import OutOfPages, PagePool
from zeroxla.inference.scheduler import GroupScheduler, Request


def test_a_group_holds_its_prompt_once_and_copies_only_the_page_it_shares():
    pool = PagePool(pages=32, page_size=4)
    prompt = []
    assert pool.prepare_write(prompt, 0, 10) == []              # 10 tokens: pages 0, 1, 2
    assert len(prompt) == 3 and pool.in_use == 3
    answers = [prompt] + [pool.fork(prompt) for _ in range(2)]  # three answers read them
    assert pool.in_use == 3
    shared = prompt[2]
    copies = []
    for table in answers:                                       # each writes tokens 10..13
        copies += pool.prepare_write(table, 10, 14)
    # page 2 (slots 8..11: prompt tokens 8, 9) is shared: the first two writers copy it, the
    # last finds itself its only reader and writes in place; page 3 is new for each answer
    assert [src for src, _ in copies] == [shared, shared]
    assert [dst for _, dst in copies] == [answers[0][2], answers[1][2]]
    assert answers[2][2] == shared
    assert pool.in_use == 2 + 3 * 2                             # prompt's full pages + answers
    assert answers[0][:2] == answers[1][:2] == answers[2][:2]
    assert len({t[2] for t in answers}) == 3 and len({t[3] for t in answers}) == 3
    for table in answers:
        pool.free(table)
    assert pool.in_use == 0 and pool.free_pages == 31 and pool.peak == 8


def test_a_write_that_does_not_fit_changes_nothing():
    pool = PagePool(pages=4, page_size=4)                       # 3 usable pages
    a, b = [], []
    pool.prepare_write(a, 0, 8)
    with pytest.raises(OutOfPages, match="2 pages needed, 1 free"):
        pool.prepare_write(b, 0, 5)
    assert b == [] and pool.in_use == 2
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(pages=1, page_size=4)


def _request(n, answers=1, max_new=4):
    return Request(prompt=np.arange(n, dtype=np.int32), outputs=list(range(answers)),
                   keys=[None] * answers, max_new=max_new)


def test_decode_tokens_first_then_prompt_chunks_oldest_first():
    group = GroupScheduler(slots=3, tokens=6, pool=PagePool(pages=64, page_size=4))
    queue = deque([_request(5), _request(9), _request(2, answers=2)])
    group.admit(queue)
    assert len(group.running) == 2 and len(queue) == 1          # the group needs 2 slots
    plans, copies = group.plan()
    assert [(p.start, p.count, bool(p.samples)) for p in plans] == [(0, 5, True), (5, 1, False)]
    assert copies == []
    assert [p.seq.cached for p in plans] == [5, 1]               # the chunks counted in
    plans[0].seq.tokens.append(7)                                # sampled: now decoding
    plans, _ = group.plan()
    assert [(p.seq.prompt_size, p.count) for p in plans] == [(5, 1), (9, 5)]
