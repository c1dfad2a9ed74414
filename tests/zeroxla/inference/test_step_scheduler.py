"""The rollout scheduler's seam (`step_scheduler.StepScheduler`): `schedule()` returns a step's
plan and `update(plan, tokens, logprobs)` takes its draws back, driven here by hand with a
scripted "step" (a chosen token per slot) instead of a model. Every expectation is worked out
by hand in the comments: which token at which position each place feeds (places sorted by
position, longest first), which place each slot samples at, the pages each place reads, and
that sequences end at their own max_new or at EOS, a preempted one fed again from its tokens
so far. No JAX program runs."""

import dataclasses

import numpy as np
import pytest

from zeroxla.inference.scheduler import Request
from zeroxla.inference.step_plan import BatchShape
from zeroxla.inference.step_scheduler import StepScheduler

EOS = 99
# one group, 4 token places, 2 slots, pages of 2 slots: 3 usable pages (page 0 is the null one)
SHAPE = BatchShape(groups=1, tokens=4, slots=2, pages=4, page_size=2, max_pages=4)


def _request(prompt, output, max_new):
    return Request(prompt=np.asarray(prompt, np.int32), outputs=[output],
                   keys=[np.asarray([0, output + 1], np.uint32)], max_new=max_new,
                   prompt_hash=np.uint32(7 + output))


def _step(scheduler, drawn):
    """schedule(), then the scripted draws {slot: token} (others 77, never taken), each with
    log-prob -token / 100."""
    plan = scheduler.schedule()
    tokens = np.full((1, 2), 77, np.int32)
    for slot, token in drawn.items():
        tokens[0, slot] = token
    return plan, scheduler.update(plan, tokens, (-tokens / 100).astype(np.float32))


def _places(plan):
    """Group 0's places (tokens, positions, page tables) and {slot: (place it samples at, its
    decode step)} for the slots that sample (the others' entries are never read)."""
    arrays = plan.arrays
    samplers = {seq.slot: (int(arrays.sample_at[0, seq.slot]), int(arrays.step[0, seq.slot]))
                for seq in plan.groups[0].samples}
    return (arrays.tokens[0].tolist(), arrays.positions[0].tolist(),
            arrays.token_pages[0].tolist(), samplers)


def test_schedule_and_update_feed_sample_finish_and_recompute_by_hand():
    # A: 3-token prompt, 3 new; B: 2-token prompt, up to 4 new (ends at EOS); C waits for a slot
    scheduler = StepScheduler(SHAPE, [_request([10, 11, 12], 0, 3), _request([20, 21], 1, 4),
                                      _request([30], 2, 1)], EOS, key_shape=(2,),
                              vocab_size=100)
    # step 1: A (slot 0) prefills 10 11 12 on pages 1, 2 and samples at position 2; B (slot 1)
    # gets the one place left: 20 on page 3. Sorted by position: 12 11 10 | 20.
    plan, finished = _step(scheduler, {0: 13})
    a_pages, b_pages = [1, 2, 0, 0], [3, 0, 0, 0]
    assert _places(plan) == ([12, 11, 10, 20], [2, 1, 0, 0],
                             [a_pages, a_pages, a_pages, b_pages], {0: (0, 0)})
    assert plan.arrays.key_data[0, 0].tolist() == [0, 1] and plan.arrays.prompt_hash[0, 0] == 7
    assert plan.inputs[0][0, :4].tolist() == [12, 11, 10, 20]       # the packed tokens lead
    assert [s.request.outputs for s in plan.groups[0].samples] == [[0]] and finished == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups = ()
    with pytest.raises(ValueError, match=r"update\(plan=...\) takes the plan the last "):
        scheduler.update(plan, np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32))
    # step 2: both decode (B's last prompt token counts as one to feed): 13 at 3, 21 at 1
    plan, finished = _step(scheduler, {0: 14, 1: 22})
    fill = [0, 0, 0, 0]
    assert _places(plan) == ([13, 21, 0, 0], [3, 1, 0, 0], [a_pages, b_pages, fill, fill],
                             {0: (0, 1), 1: (1, 0)})
    assert finished == []
    # step 3: A's position 4 needs a fourth page: the pool is full, so B (younger) is
    # preempted (page 3 freed, A takes it) and cannot be fed again this step. Slot 1 draws
    # EOS but does not sample: nothing ends. A has its 3 new tokens: done.
    plan, finished = _step(scheduler, {0: 15, 1: EOS})
    assert _places(plan) == ([14, 0, 0, 0], [4, 0, 0, 0], [[1, 2, 3, 0], fill, fill, fill],
                             {0: (0, 2)})
    assert [(f.output, f.tokens.tolist()) for f in finished] == [(0, [10, 11, 12, 13, 14, 15])]
    np.testing.assert_array_equal(finished[0].logprobs,
                                  np.float32([-0.13, -0.14, -0.15]))
    # step 4: C takes the freed slot 0 and decodes its 1-token prompt on page 3 (the last page
    # freed is the first handed out); B is fed again from its tokens so far, 20 21 22 at 0..2
    # on pages 2, 1, and samples its second token (decode step 1). Sorted: 22 21 | 30 | 20.
    plan, finished = _step(scheduler, {0: 31, 1: EOS})
    b_pages, c_pages = [2, 1, 0, 0], [3, 0, 0, 0]
    assert _places(plan) == ([22, 21, 30, 20], [2, 1, 0, 0],
                             [b_pages, b_pages, c_pages, b_pages], {0: (2, 0), 1: (0, 1)})
    assert plan.arrays.key_data[0].tolist() == [[0, 3], [0, 2]]
    # C ends at its max_new (1), B at EOS after 2 of its 4: in the order they sampled
    assert [(f.output, f.tokens.tolist()) for f in finished] == [(2, [30, 31]),
                                                                 (1, [20, 21, 22, EOS])]
    np.testing.assert_array_equal(finished[1].logprobs, np.float32([-0.22, -0.99]))
    assert scheduler.done
    # fed 4 + 2 + 1 + 4 places; prefill: chunks that start inside their prompt count whole,
    # 4 + 1 + 0 + 4 (B's recompute 20 21 22 included); 6 draws taken; 3 pages in use after
    # each plan; tokens in the cache after each plan 4, 6, 5 (B's freed), 4
    assert scheduler.stats() == {
        "steps": 4, "tokens_fed": 11, "prefill_tokens": 9, "generated_tokens": 6,
        "mean_pages_in_use": 3.0, "kv_slots_per_live_token": 12 * 2 / 19,
        "peak_pages_in_use": 3, "preemptions": 1}
