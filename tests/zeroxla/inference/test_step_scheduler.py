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


def _routed_step(scheduler, drawn, step):
    """`_step` with a scripted routing (one layer, k = 3): each program place's "experts" are
    (the token it feeds, its position, the step number), so a record says which token was fed
    at which position, and when."""
    plan = scheduler.schedule()
    tokens = np.full((1, 2), 77, np.int32)
    for slot, token in drawn.items():
        tokens[0, slot] = token
    experts = np.stack([plan.arrays.tokens, plan.arrays.positions,
                        np.full_like(plan.arrays.tokens, step)], -1)[:, :, None]  # [1, N, 1, 3]
    return scheduler.update(plan, tokens, np.zeros((1, 2), np.float32), experts)


def _record(*fed):
    """The expected record of an output whose tokens were fed as (token, step) at positions
    0, 1, ...: [(token, position, step)] per position, then -1 for the last token."""
    rows = [[token, position, step] for position, (token, step) in enumerate(fed)]
    return np.asarray(rows + [[-1, -1, -1]], np.int32)[:, None]               # [T, 1, 3]


def test_update_records_each_fed_tokens_routing_at_its_position_by_hand():
    # The first test's schedule (A, B, C; B preempted at step 3 and recomputed at step 4), its
    # routing scripted: A's tokens fed at steps 1, 1, 1, 2, 3; B's three all at step 4 (the
    # recompute overwrites what steps 1 and 2 wrote); C's at step 4.
    scheduler = StepScheduler(SHAPE, [_request([10, 11, 12], 0, 3), _request([20, 21], 1, 4),
                                      _request([30], 2, 1)], EOS, key_shape=(2,),
                              vocab_size=100)
    finished = []
    for step, drawn in enumerate([{0: 13}, {0: 14, 1: 22}, {0: 15, 1: EOS},
                                  {0: 31, 1: EOS}], start=1):
        finished += _routed_step(scheduler, drawn, step)
    records = {f.output: f.routing for f in finished}
    np.testing.assert_array_equal(records[0], _record((10, 1), (11, 1), (12, 1), (13, 2),
                                                      (14, 3)))
    np.testing.assert_array_equal(records[1], _record((20, 4), (21, 4), (22, 4)))
    np.testing.assert_array_equal(records[2], _record((30, 4)))


def test_a_groups_answers_share_their_prompts_routing_record_by_hand():
    # One prompt of 5 tokens, 2 answers of 2 new tokens, 4 places a step: step 1 feeds the
    # prompt's first chunk (0..3), step 2 its last token at 4, where it forks into the two
    # answers (slots 0, 1) that draw 50 and 60; step 3 feeds those (position 5) and both end.
    shape = dataclasses.replace(SHAPE, pages=8)
    request = Request(prompt=np.arange(40, 45, dtype=np.int32), outputs=[0, 1],
                      keys=[np.asarray([0, 1], np.uint32), np.asarray([0, 2], np.uint32)],
                      max_new=2, prompt_hash=np.uint32(7))
    scheduler = StepScheduler(shape, [request], EOS, key_shape=(2,), vocab_size=100)
    finished = []
    for step, drawn in enumerate([{}, {0: 50, 1: 60}, {0: 51, 1: 61}], start=1):
        finished += _routed_step(scheduler, drawn, step)
    prompt = [(40, 1), (41, 1), (42, 1), (43, 1), (44, 2)]
    assert [(f.output, f.tokens.tolist()) for f in finished] == [
        (0, [40, 41, 42, 43, 44, 50, 51]), (1, [40, 41, 42, 43, 44, 60, 61])]
    np.testing.assert_array_equal(finished[0].routing, _record(*prompt, (50, 3)))
    np.testing.assert_array_equal(finished[1].routing, _record(*prompt, (60, 3)))
    assert scheduler.done
