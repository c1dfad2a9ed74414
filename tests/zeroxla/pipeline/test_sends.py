"""What crosses between stages at each step (`step_sends`), and the phases the executor compiles
as one loop each (`phases`): pure Python, no devices.

* `step_sends` is DeepSpeed's SendActivation / SendGrad instructions, moved one step earlier (to
  the step that computes what is sent): the same stages, the same counts, M (S - 1) each way.
* The executor compiles one branch per distinct step's sends: their number does not grow with M
  and stays under 4S (the steady state's patterns plus the warm-up's and cool-down's partial
  ones).
* `phases` covers [0, T) in order with at most three phases, whatever M: the ends where every
  stage runs one op or idles, and the middle.
"""

import itertools

import pytest

from zeroxla.pipeline import GPipeSchedule, SendActivation, SendGrad, TrainSchedule, schedule_table
from zeroxla.pipeline.table import (BACKWARD, FORWARD, IDLE, WEIGHT, StepSends, phases,
                                    step_sends)
from zeroxla.pipeline.zero_bubble import ZBH1Schedule

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


@pytest.mark.parametrize("schedule_class", SCHEDULES)
@pytest.mark.parametrize("stages", (1, 2, 3, 4, 8))
def test_distinct_sends_do_not_grow_with_micro_batches(schedule_class, stages):
    distinct = {len(set(step_sends(schedule_table(schedule_class, m, stages))))
                for m in (stages, 2 * stages, 4 * stages, 16)}
    assert len(distinct) == 1 and distinct.pop() <= 4 * stages, distinct


def test_sends_of_small_pipelines():
    # 1F1B on 2 stages, 2 micro-batches: F0 | F1 (stage 0), F0 (stage 1) | ...
    sends = step_sends(schedule_table(TrainSchedule, 2, 2))
    assert sends[0] == StepSends((0,), ())                  # stage 0's F0 goes to stage 1
    assert sum(len(x.activations) for x in sends) == sum(len(x.grads) for x in sends) == 2
    assert step_sends(schedule_table(TrainSchedule, 8, 1)) == (StepSends((), ()),) * 16
    assert step_sends(schedule_table(GPipeSchedule, 1, 1)) == (StepSends((), ()),) * 2


@pytest.mark.parametrize("schedule_class", (*SCHEDULES, ZBH1Schedule))
@pytest.mark.parametrize("micro_batches,stages", [(1, 1), (4, 1), (1, 2), (4, 2), (8, 4), (16, 4),
                                                  (16, 8)])
def test_phases_cover_the_steps_in_at_most_three(schedule_class, micro_batches, stages):
    table = schedule_table(schedule_class, micro_batches, stages)
    found = phases(table)
    assert [p.start for p in found] == [0] + [p.stop for p in found[:-1]]
    assert found[-1].stop == table.num_steps and len(found) <= 3
    for p in found:
        assert p.ops == {op for row in table.op[p.start:p.stop] for op in row}
    busy = [p.ops - {IDLE} for p in found]
    # The ends run one op each: forwards first; backwards (ZB-H1: weight passes) last.
    assert busy[0] == {FORWARD}
    assert busy[-1] == ({WEIGHT} if schedule_class is ZBH1Schedule else {BACKWARD})
    if len(found) == 3 and table.num_steps > 3:   # a middle phase is where ops mix (ZB-H1 on
        assert len(busy[1]) > 1                   # one stage, one micro-batch: F | B | W)


def test_phases_of_1f1b_and_gpipe():
    one_f_one_b = phases(schedule_table(TrainSchedule, 8, 4))              # T = 22
    assert [(p.start, p.stop) for p in one_f_one_b] == [(0, 4), (4, 18), (18, 22)]
    assert one_f_one_b[1].ops == {IDLE, FORWARD, BACKWARD}
    gpipe = phases(schedule_table(GPipeSchedule, 8, 4))
    assert [(p.start, p.stop, p.ops) for p in gpipe] == [
        (0, 11, {IDLE, FORWARD}), (11, 22, {IDLE, BACKWARD})]
