"""What crosses between stages at each step (`step_sends`) and the runs of steps the executor
compiles as one loop each (`segments`): pure Python, no devices.

* `step_sends` is DeepSpeed's SendActivation / SendGrad instructions, moved one step earlier (to
  the step that computes what is sent): the same stages, the same counts, M (S - 1) each way.
* `segments` covers [0, T) in order with runs that really repeat, and its compiled step bodies
  (the sum of the periods) do not grow with M: 1F1B's steady state is one period-2 loop,
  GPipe's phases are period-1 loops.
"""

import itertools

import pytest

from zeroxla.pipeline import GPipeSchedule, SendActivation, SendGrad, TrainSchedule, schedule_table
from zeroxla.pipeline.table import Segment, StepSends, segments, send_segments, step_sends

SCHEDULES = (TrainSchedule, GPipeSchedule)
GRID = list(itertools.product(SCHEDULES, (1, 2, 3, 4, 8, 16), (1, 2, 3, 4)))   # M < S included


def _stream_sends(schedule_class, micro_batches, stages, instruction):
    """{(step, stage)} where the stage's DeepSpeed stream issues `instruction`."""
    return {(step_id, stage_id) for stage_id in range(stages)
            for step_id, step in enumerate(schedule_class(micro_batches, stages, stage_id).steps())
            for i in step if isinstance(i, instruction)}


@pytest.mark.parametrize("schedule_class,micro_batches,stages", GRID)
def test_step_sends_are_the_streams_send_instructions(schedule_class, micro_batches, stages):
    table = schedule_table(schedule_class, micro_batches, stages)
    sends = step_sends(table)
    assert len(sends) == table.num_steps
    for field, instruction in (("activations", SendActivation), ("grads", SendGrad)):
        ours = {(t + 1, s) for t, step in enumerate(sends) for s in getattr(step, field)}
        theirs = _stream_sends(schedule_class, micro_batches, stages, instruction)
        assert ours == theirs
        assert len(ours) == micro_batches * (stages - 1)


def _check_cover(pattern, found):
    assert [seg.start for seg in found] == [0] + [seg.stop for seg in found[:-1]]
    assert (found[-1].stop if found else 0) == len(pattern)
    for seg in found:
        assert seg.period in (1, 2) and seg.repeats >= 1
        unit = pattern[seg.start:seg.start + seg.period]
        assert pattern[seg.start:seg.stop] == unit * seg.repeats


@pytest.mark.parametrize("schedule_class,micro_batches,stages", GRID)
def test_segments_cover_the_steps_with_repeating_runs(schedule_class, micro_batches, stages):
    table = schedule_table(schedule_class, micro_batches, stages)
    _check_cover(step_sends(table), send_segments(table))


@pytest.mark.parametrize("schedule_class", SCHEDULES)
@pytest.mark.parametrize("stages", (1, 2, 3, 4))
def test_compiled_step_bodies_do_not_grow_with_micro_batches(schedule_class, stages):
    bodies = {sum(seg.period for seg in send_segments(schedule_table(schedule_class, m, stages)))
              for m in (stages, 2 * stages, 4 * stages, 16)}
    assert len(bodies) == 1, bodies


def test_steady_states():
    one_f_one_b = send_segments(schedule_table(TrainSchedule, 16, 4))       # T = 38
    assert Segment(6, 2, 13) in one_f_one_b            # forward / backward alternating
    assert sum(seg.period for seg in one_f_one_b) == 14
    gpipe = send_segments(schedule_table(GPipeSchedule, 16, 4))
    assert Segment(2, 1, 14) in gpipe and Segment(21, 1, 14) in gpipe     # both phases full
    assert send_segments(schedule_table(TrainSchedule, 8, 1)) == (Segment(0, 1, 16),)  # no sends
    assert step_sends(schedule_table(GPipeSchedule, 1, 1)) == (StepSends((), ()),) * 2


def test_segments_of_plain_patterns():
    assert segments(()) == ()
    assert segments(tuple("aaaa")) == (Segment(0, 1, 4),)
    # A lone step before an alternation does not steal its first step.
    assert segments(tuple("xababab")) == (Segment(0, 1, 1), Segment(1, 2, 3))
    assert segments(tuple("aabababb")) == (Segment(0, 1, 1), Segment(1, 2, 3), Segment(7, 1, 1))
    for pattern in ("abcabc", "abba", "aabbaab", "x"):
        _check_cover(tuple(pattern), segments(tuple(pattern)))
    assert segments(tuple("abcabc"), max_period=3) == (Segment(0, 3, 2),)
    with pytest.raises(ValueError, match="max_period=0 is invalid; accepted: an integer >= 1"):
        segments(tuple("ab"), max_period=0)
