"""ZB-H1 (zero-bubble 1F1B) as a schedule table: pure Python, no devices.

The references are independent of the schedule's code: the table is executed on symbolic
buffers (each holds a micro-batch id), every read must find the micro-batch it expects, and the
events it records are checked against the paper's claims (Qi et al. 2023, §3.1): every
micro-batch's F, B and W once per stage in dependency order, no more activations in flight than
DeepSpeed's own 1F1B (`TrainSchedule`, whose streams test_schedule.py checks against
DeepSpeed's code), and the bubble (S - 1) / (3M + S - 1) counted as exact fractions.
"""

import itertools
from fractions import Fraction

import pytest

import zeroxla
from zeroxla.pipeline import (BackwardPass, BackwardWeightPass, ForwardPass, LoadMicroBatch,
                              RecvGrad, SendActivation, SendGrad, TrainSchedule, ZBH1Schedule,
                              schedule_table)
from zeroxla.pipeline.checks import check_table
from zeroxla.pipeline.table import BACKWARD, FORWARD, IDLE, NONE, WEIGHT, step_sends

GRID = list(itertools.product((1, 2, 3, 4, 5, 8, 16), (1, 2, 3, 4, 8)))   # (M, S), M < S too


def simulate(table):
    """Runs `table` with buffers holding micro-batch ids; asserts each pass finds its own
    micro-batch's input, output and gradient (no later micro-batch overwrote them) and that
    every receive meets its neighbour's send. Returns {(kind, stage, mb): step}."""
    S = table.stages
    bufs = {k: [[None] * table.num_pipe_buffers[s] for s in range(S)]
            for k in ("inputs", "outputs", "grads_in", "d_y")}
    events = {}

    def record(kind, s, m, t):
        assert (kind, s, m) not in events, f"{kind} of micro-batch {m} twice on stage {s}"
        events[kind, s, m] = t

    for t in range(table.num_steps):
        activations, grads = {}, {}
        for s in range(S):
            if (b := table.send_activation[t][s]) != NONE:
                activations[s + 1] = bufs["outputs"][s][b]
                record("send_activation", s, activations[s + 1], t)
            if (b := table.send_grad[t][s]) != NONE:
                grads[s - 1] = bufs["inputs"][s][b]          # d input of that micro-batch
                record("send_grad", s, grads[s - 1], t)
        for s in range(S):
            if (b := table.recv_activation[t][s]) != NONE:
                bufs["inputs"][s][b] = activations.pop(s)
            if (b := table.recv_grad[t][s]) != NONE:
                bufs["grads_in"][s][b] = grads.pop(s)
            if (b := table.load[t][s]) != NONE and s == 0:
                bufs["inputs"][s][b] = table.load_micro_batch[t][s]
        assert not activations and not grads, f"step {t}: a send nobody receives"
        for s in range(S):
            op, m, b = table.op[t][s], table.micro_batch[t][s], table.buffer[t][s]
            if op == IDLE:
                continue
            assert bufs["inputs"][s][b] == m, (t, s)     # F's input / what B and W differentiate
            if op == FORWARD:
                bufs["outputs"][s][b] = m
                record("F", s, m, t)
            elif op == BACKWARD:
                assert bufs["outputs"][s][b] == m and (s == S - 1 or bufs["grads_in"][s][b] == m)
                bufs["d_y"][s][b] = m                      # what W needs besides the input
                record("B", s, m, t)
            else:
                assert op == WEIGHT and bufs["d_y"][s][b] == m, (t, s)
                record("W", s, m, t)
    return events


def _peak(events, stage, micro_batches, start, stop):
    """Most micro-batches between their `start` and `stop` event on `stage` at any step."""
    steps = [events[start, stage, m] for m in range(micro_batches)]
    return max(sum(events[start, stage, m] <= t < events[stop, stage, m]
                   for m in range(micro_batches)) for t in steps)


@pytest.mark.parametrize("micro_batches,stages", GRID)
def test_every_pass_once_in_dependency_order(micro_batches, stages):
    M, S = micro_batches, stages
    table = schedule_table(ZBH1Schedule, M, S)
    check_table(table)                                   # the executor accepts it
    events = simulate(table)
    for s, m in itertools.product(range(S), range(M)):
        f, b, w = events["F", s, m], events["B", s, m], events["W", s, m]
        assert f < b < w                                 # W after B on the same stage
        if s > 0:
            assert events["F", s - 1, m] < events["send_activation", s - 1, m] <= f
        if s < S - 1:
            assert events["B", s + 1, m] < events["send_grad", s + 1, m] <= b
    for s in range(S):
        ops = [row[s] for row in table.op]
        assert (ops.count(FORWARD), ops.count(BACKWARD), ops.count(WEIGHT)) == (M, M, M)
    assert sum(len([k for k in events if k[0] == kind]) for kind in
               ("send_activation", "send_grad")) == 2 * M * (S - 1)
    assert table.optimizer_step[-1] == (1,) * S and sum(map(sum, table.optimizer_step)) == S


@pytest.mark.parametrize("micro_batches,stages", GRID)
def test_in_flight_activations_at_most_1f1bs(micro_batches, stages):
    """Per stage, F..B (the forward's activations) no more than 1F1B's on that stage; F..W (the
    activations and then what W needs) no more than 1F1B's peak, its first stage's: the stash
    every stage allocates in the SPMD executor, which ZB-H1 does not grow."""
    M, S = micro_batches, stages
    ours = simulate(schedule_table(ZBH1Schedule, M, S))
    one_f_one_b = schedule_table(TrainSchedule, M, S)
    theirs = {(k.replace("forward", "F").replace("backward", "B"), s, m): t
              for (k, s, m), t in _train_events(one_f_one_b).items()}
    theirs_peak = max(_peak(theirs, s, M, "F", "B") for s in range(S))
    for s in range(S):
        assert _peak(ours, s, M, "F", "B") <= _peak(theirs, s, M, "F", "B")
        assert _peak(ours, s, M, "F", "W") <= theirs_peak == min(S, M)
    zb = schedule_table(ZBH1Schedule, M, S)
    assert max(zb.num_pipe_buffers) <= max(one_f_one_b.num_pipe_buffers)


def _train_events(table):
    """{(forward|backward, stage, mb): step} of a 1F1B table, read off its grid."""
    return {("forward" if op == FORWARD else "backward", s, table.micro_batch[t][s]): t
            for t, row in enumerate(table.op) for s, op in enumerate(row) if op != IDLE}


@pytest.mark.parametrize("stages", (2, 4, 8))
@pytest.mark.parametrize("factor", (1, 2, 4))
def test_bubble_is_zb_h1s(stages, factor):
    S, M = stages, factor * stages
    table = schedule_table(ZBH1Schedule, M, S)
    idle = sum(row.count(IDLE) for row in table.op)
    assert table.num_steps == 3 * M + S - 1
    assert Fraction(idle, table.num_steps * S) == Fraction(S - 1, 3 * M + S - 1)
    one_f_one_b = schedule_table(TrainSchedule, M, S)      # (S - 1) / (M + S - 1) of its steps
    assert Fraction(sum(row.count(IDLE) for row in one_f_one_b.op),
                    one_f_one_b.num_steps * S) == Fraction(S - 1, M + S - 1)


def test_hand_checked_table_and_first_stage_stream():
    """M = 4, S = 2: 1F1B's F / B steps in blocks of S, each W in its stage's next free step."""
    table = schedule_table(ZBH1Schedule, 4, 2)
    F, B, W, _ = FORWARD, BACKWARD, WEIGHT, IDLE
    assert table.op == ((F, _), (_, F), (F, B), (B, F), (W, B), (B, W), (F, W), (W, F), (F, B),
                        (B, F), (W, B), (B, W), (W, W))
    assert [row[0] for row in table.micro_batch] == [0, -1, 1, 0, 0, 1, 2, 1, 3, 2, 2, 3, 3]
    assert [row[1] for row in table.micro_batch] == [-1, 0, 0, 1, 1, 0, 1, 2, 2, 3, 3, 2, 3]
    Load, Fwd, Bwd, Wgt = LoadMicroBatch, ForwardPass, BackwardPass, BackwardWeightPass
    assert list(ZBH1Schedule(4, 2, 0))[:6] == [
        [Load(0), Fwd(0)], [SendActivation(0)], [Load(1), Fwd(1)],
        [RecvGrad(0), SendActivation(1), Bwd(0)], [Wgt(0)], [RecvGrad(1), Bwd(1)]]
    assert SendGrad(0) in list(ZBH1Schedule(4, 2, 1))[3]     # B0 of step 2 goes to stage 0
    assert table.num_pipe_buffers == (2, 2)


@pytest.mark.parametrize("stages", (1, 2, 4))
def test_distinct_sends_do_not_grow_with_micro_batches(stages):
    """The executor compiles one send branch per distinct step's sends: bounded once M >= 2S."""
    distinct = {len(set(step_sends(schedule_table(ZBH1Schedule, m, stages))))
                for m in (2 * stages, 4 * stages, 8 * stages)}
    assert len(distinct) == 1 and distinct.pop() <= 4 * stages


def test_config_picks_zb_h1():
    config = zeroxla.PipelineConfig(8, schedule="zb-h1")
    assert config.schedule_class is ZBH1Schedule
    with pytest.raises(ValueError, match=r'accepted: "1f1b", "gpipe", "zb-h1"'):
        zeroxla.PipelineConfig(8, schedule="zb-h2")


class _OneBufferZBH1(ZBH1Schedule):
    def num_pipe_buffers(self):
        return 1


def test_simulation_catches_a_buffer_reused_before_its_weight_pass():
    """The checker can fail: with one buffer, stage 0's second forward overwrites micro-batch
    0's input before its B and W have run."""
    with pytest.raises(AssertionError):
        simulate(schedule_table(_OneBufferZBH1, 4, 2))
