"""Schedules against DeepSpeed's own (vendored verbatim) and against the invariants any correct
pipeline schedule must keep, checked by running the lowered table on symbolic buffers."""

import dataclasses
import itertools

import pytest

import deepspeed_schedule_reference as ds
from zeroxla.pipeline import (
    BackwardPass,
    ForwardPass,
    GPipeSchedule,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleTable,
    SendActivation,
    TrainSchedule,
    bubble_fraction,
    schedule_table,
)
from zeroxla.pipeline.schedule import Compute, PipeSchedule
from zeroxla.pipeline.table import BACKWARD, FORWARD, IDLE, NONE

MICRO_BATCHES = (1, 2, 3, 4, 6, 8)
STAGES = (1, 2, 3, 4)
GRID = list(itertools.product(MICRO_BATCHES, STAGES))


def _stream(schedule):
    """A stream as comparable data: (class name, buffer id or None) per instruction per step."""
    return [[(ins.name, getattr(ins, "buffer_id", None)) for ins in step] for step in schedule]


def test_train_schedule_example():
    Load, Fwd, Bwd, SendAct = LoadMicroBatch, ForwardPass, BackwardPass, SendActivation
    schedule = TrainSchedule(micro_batches=4, stages=2, stage_id=0)
    assert schedule.num_pipe_buffers() == 2 and len(schedule) == 10
    assert list(schedule) == [
        [Load(0), Fwd(0)], [SendAct(0)], [Load(1), Fwd(1)], [RecvGrad(0), SendAct(1), Bwd(0)],
        [Load(0), Fwd(0)], [RecvGrad(1), SendAct(0), Bwd(1)], [Load(1), Fwd(1)],
        [RecvGrad(0), SendAct(1), Bwd(0)], [],
        [RecvGrad(1), Bwd(1), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]]


def test_instructions_are_frozen_data_with_deepspeeds_repr():
    assert repr(ForwardPass(3)) == repr(ds.ForwardPass(3)) == "ForwardPass(buffer_id=3)"
    assert repr(OptimizerStep()) == repr(ds.OptimizerStep()) == "OptimizerStep()"
    assert ForwardPass(1) == ForwardPass(buffer_id=1) != BackwardPass(1)
    assert ForwardPass(1).name == "ForwardPass"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ForwardPass(1).buffer_id = 2


@pytest.mark.parametrize("micro_batches,stages", GRID)
@pytest.mark.parametrize("ours_class,theirs_class", [(TrainSchedule, ds.TrainSchedule),
                                                     (InferenceSchedule, ds.InferenceSchedule)])
def test_streams_equal_deepspeeds(ours_class, theirs_class, micro_batches, stages):
    for stage_id in range(stages):
        ours = ours_class(micro_batches, stages, stage_id)
        theirs = theirs_class(micro_batches, stages, stage_id)
        expected = list(theirs)
        assert _stream(ours) == _stream(expected), stage_id
        assert [repr(step) for step in ours] == [repr(step) for step in expected]
        assert len(ours) == len(expected)
        assert ours.num_pipe_buffers() == theirs.num_pipe_buffers()


@pytest.mark.parametrize("micro_batches,stages", GRID)
def test_train_compute_matches_deepspeeds_step_mapping(micro_batches, stages):
    """Our closed form F(m) at 2m + s, B(m) at 2m + 2S - 1 - s is DeepSpeed's parity mapping."""
    for stage_id in range(stages):
        ours = TrainSchedule(micro_batches, stages, stage_id)
        theirs = ds.TrainSchedule(micro_batches, stages, stage_id)
        for step_id in range(ours.num_steps):
            micro_batch_id, is_forward = theirs._step_to_micro_batch(step_id)
            valid = 0 <= micro_batch_id < micro_batches
            expected = Compute(micro_batch_id, is_forward) if valid else None
            assert ours.compute_at(step_id) == expected, (stage_id, step_id)


# --- Invariants, by running the table on symbolic buffers -----------------------------------

def simulate(table: ScheduleTable):
    """Executes `table` with buffers that hold micro-batch ids instead of tensors, asserting that
    every read finds the micro-batch it expects. Returns the events {(kind, stage, mb): step}
    for kind in forward, backward, send_activation, send_grad."""
    S, T = table.stages, table.num_steps
    slots = ("inputs", "labels", "outputs", "grads_in", "grads_out")
    buf = {k: [[None] * table.num_pipe_buffers[s] for s in range(S)] for k in slots}
    events = {}

    def record(kind, s, mb, t):
        assert (kind, s, mb) not in events, f"{kind} of micro-batch {mb} twice on stage {s}"
        events[kind, s, mb] = t

    for t in range(T):
        # 1. Sends read what earlier steps left in the buffers.
        activations, grads = {}, {}
        for s in range(S):
            if (b := table.send_activation[t][s]) != NONE:
                assert s < S - 1, "the last stage sends no activation"
                activations[s + 1] = buf["outputs"][s][b]
                record("send_activation", s, buf["outputs"][s][b], t)
            if (b := table.send_grad[t][s]) != NONE:
                assert s > 0, "the first stage sends no gradient"
                grads[s - 1] = buf["grads_out"][s][b]
                record("send_grad", s, buf["grads_out"][s][b], t)
        # 2. Every receive is matched by its neighbour's send in the same step, and vice versa.
        for s in range(S):
            if (b := table.recv_activation[t][s]) != NONE:
                assert s in activations, f"step {t}: stage {s} receives an unsent activation"
                buf["inputs"][s][b] = activations.pop(s)
            if (b := table.recv_grad[t][s]) != NONE:
                assert s in grads, f"step {t}: stage {s} receives an unsent gradient"
                buf["grads_in"][s][b] = grads.pop(s)
            if (b := table.load[t][s]) != NONE:
                assert s in (0, S - 1), "only the first and last stages load"
                if s == 0:
                    buf["inputs"][s][b] = table.load_micro_batch[t][s]
                if s == S - 1:
                    buf["labels"][s][b] = table.load_micro_batch[t][s]
        assert not activations and not grads, f"step {t}: a send nobody receives"
        # 3. Compute.
        for s in range(S):
            op, mb, b = table.op[t][s], table.micro_batch[t][s], table.buffer[t][s]
            if op == IDLE:
                assert mb == b == NONE
                continue
            # The input is still there: for the backward, no later micro-batch overwrote it.
            assert buf["inputs"][s][b] == mb, (t, s)
            if op == FORWARD:
                if s == S - 1:
                    assert buf["labels"][s][b] == mb
                buf["outputs"][s][b] = mb
                record("forward", s, mb, t)
            else:
                assert buf["outputs"][s][b] == mb, (t, s)
                if s < S - 1:
                    assert buf["grads_in"][s][b] == mb, (t, s)
                buf["grads_out"][s][b] = mb
                record("backward", s, mb, t)
    return events


def _in_flight(events, stage_id, micro_batches, num_steps):
    """Most micro-batches whose forward has run and whose backward has not, at any step."""
    return max(sum(events["forward", stage_id, m] <= t < events["backward", stage_id, m]
                   for m in range(micro_batches)) for t in range(num_steps))


@pytest.mark.parametrize("micro_batches,stages", GRID)
@pytest.mark.parametrize("schedule_class", [TrainSchedule, GPipeSchedule])
def test_training_invariants(schedule_class, micro_batches, stages):
    M, S = micro_batches, stages
    table = schedule_table(schedule_class, M, S)
    assert table.num_steps == 2 * (M + S - 1)
    events = simulate(table)

    for field in ("buffer", "load", "recv_activation", "send_activation", "recv_grad",
                  "send_grad"):
        for row in getattr(table, field):
            assert all(-1 <= b < table.num_pipe_buffers[s] for s, b in enumerate(row)), field
    for s in range(S):
        for m in range(M):
            # Each micro-batch runs forward and backward exactly once on every stage.
            fwd, bwd = events["forward", s, m], events["backward", s, m]
            assert fwd < bwd
            if s > 0:
                # ... forward after the previous stage's, with the activation sent in between,
                sent = events["send_activation", s - 1, m]
                assert events["forward", s - 1, m] < sent <= fwd
            if s < S - 1:
                # ... backward after the next stage's, with the gradient sent in between.
                sent = events["send_grad", s + 1, m]
                assert events["backward", s + 1, m] < sent <= bwd
        assert sum(row[s] != IDLE for row in table.op) == 2 * M
        in_flight = _in_flight(events, s, M, table.num_steps)
        assert in_flight <= table.num_pipe_buffers[s]
        if schedule_class is TrainSchedule:
            assert in_flight == min(S - s, M)                   # 1F1B: at most S - stage_id
        else:
            assert in_flight == M                               # GPipe: all of them
    assert all(len(set(row)) == 1 for row in table.optimizer_step)
    assert table.optimizer_step[-1] == (1,) * S and sum(map(sum, table.optimizer_step)) == S
    # DeepSpeed's LoadMicroBatch takes the next item of the data iterator: 0, 1, 2, ...
    for s in {0, S - 1}:
        assert [row[s] for row in table.load_micro_batch if row[s] != NONE] == list(range(M))


class _OneBufferTrainSchedule(TrainSchedule):
    def num_pipe_buffers(self):
        return 1


def test_simulation_catches_a_reused_buffer():
    """The checker can fail: with one buffer, 1F1B's second forward on stage 0 overwrites the
    first micro-batch's activations before its backward."""
    with pytest.raises(AssertionError):
        simulate(schedule_table(_OneBufferTrainSchedule, 4, 2))


@pytest.mark.parametrize("micro_batches,stages", GRID)
def test_inference_table(micro_batches, stages):
    table = schedule_table(InferenceSchedule, micro_batches, stages)
    assert table.num_steps == micro_batches + stages - 1
    for t, s in itertools.product(range(table.num_steps), range(stages)):
        m = t - s                                            # forward of m at step m + s
        expected = (FORWARD, m) if 0 <= m < micro_batches else (IDLE, NONE)
        assert (table.op[t][s], table.micro_batch[t][s]) == expected
    events = simulate(table)                      # pairing, and buffers hold what is read
    for s, m in itertools.product(range(stages), range(micro_batches)):
        if s > 0:
            sent = events["send_activation", s - 1, m]
            assert events["forward", s - 1, m] < sent <= events["forward", s, m]
    assert not any(map(any, table.optimizer_step))
    assert BACKWARD not in {op for row in table.op for op in row}


@pytest.mark.parametrize("micro_batches,stages", GRID)
@pytest.mark.parametrize("schedule_class", [TrainSchedule, GPipeSchedule, InferenceSchedule])
def test_bubble_fraction(schedule_class, micro_batches, stages):
    expected = (stages - 1) / (micro_batches + stages - 1)
    assert bubble_fraction(schedule_class, micro_batches, stages) == pytest.approx(expected)


def test_table_example():
    """Hand-checked 1F1B, M = 2, S = 2 (see render_text's docstring for the picture)."""
    table = schedule_table(TrainSchedule, 2, 2)
    F, B, _ = FORWARD, BACKWARD, IDLE
    assert table.op == ((F, _), (_, F), (F, B), (B, F), (_, B), (B, _))
    assert table.micro_batch == ((0, -1), (-1, 0), (1, 0), (0, 1), (-1, 1), (1, -1))
    assert table.send_activation == ((-1, -1), (0, -1), (-1, -1), (1, -1), (-1, -1), (-1, -1))
    assert table.recv_activation == ((-1, -1), (-1, 0), (-1, -1), (-1, 1), (-1, -1), (-1, -1))
    assert table.send_grad == ((-1, -1), (-1, -1), (-1, -1), (-1, 0), (-1, -1), (-1, 1))
    assert table.recv_grad == ((-1, -1), (-1, -1), (-1, -1), (0, -1), (-1, -1), (1, -1))
    assert table.load == table.load_micro_batch == ((0, -1), (-1, 0), (1, -1), (-1, 1),
                                                    (-1, -1), (-1, -1))
    assert table.num_pipe_buffers == (2, 2)
    arrays = table.as_arrays()
    assert set(arrays) == {"op", "micro_batch", "buffer", "load", "load_micro_batch",
                           "recv_activation", "send_activation", "recv_grad", "send_grad",
                           "optimizer_step"}
    assert all(a.shape == (6, 2) and a.dtype == "int32" for a in arrays.values())
    assert arrays["op"].tolist() == [list(row) for row in table.op]


class _TwoForwardsPerStep(PipeSchedule):
    """Not lowerable: DeepSpeed's DataParallelSchedule shape (forward and backward in one step)."""

    num_steps = 1

    def compute_at(self, step_id):
        return Compute(0, True)

    def instructions_at(self, step_id):
        return [ForwardPass(0), ForwardPass(0)]


def test_table_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match=r"two instructions set 'op'"):
        schedule_table(_TwoForwardsPerStep, 1, 1)
    with pytest.raises(ValueError, match=r"schedule_class=.* accepted: a PipeSchedule subclass"):
        schedule_table(ds.TrainSchedule, 2, 2)
    with pytest.raises(ValueError, match=r"stages=0 is invalid; accepted: an integer >= 1"):
        schedule_table(TrainSchedule, 2, 0)


@pytest.mark.parametrize("schedule_class", [TrainSchedule, GPipeSchedule, InferenceSchedule])
@pytest.mark.parametrize("args,message", [
    ((0, 2, 0), r"micro_batches=0 is invalid; accepted: an integer >= 1"),
    ((2, 0, 0), r"stages=0 is invalid; accepted: an integer >= 1"),
    ((2, 2, 2), r"stage_id=2 is invalid; accepted: an integer in 0\.\.1 \(stages=2\)"),
    ((2, 2, -1), r"stage_id=-1 is invalid"),
    ((2.0, 2, 0), r"micro_batches=2\.0 is invalid"),
])
def test_constructor_validation(schedule_class, args, message):
    with pytest.raises(ValueError, match=schedule_class.__name__ + ": " + message):
        schedule_class(*args)


def test_schedules_are_frozen_values():
    schedule = TrainSchedule(4, 2, 1)
    assert schedule == TrainSchedule(4, 2, 1) and hash(schedule) == hash(TrainSchedule(4, 2, 1))
    assert repr(schedule) == "TrainSchedule(micro_batches=4, stages=2, stage_id=1)"
    assert list(schedule) == list(schedule)                  # iterating twice gives the same
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.stage_id = 0


def test_pipeline_package_imports_no_jax():
    """The schedules are data: importing them (with zeroxla's own __init__, which loads the
    engine, bypassed) loads neither JAX nor numpy nor matplotlib."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[3]
    code = ("import sys, types; pkg = types.ModuleType('zeroxla'); "
            f"pkg.__path__ = [{str(root / 'zeroxla')!r}]; sys.modules['zeroxla'] = pkg; "
            "import zeroxla.pipeline, zeroxla.pipeline.timeline; "
            "zeroxla.pipeline.schedule_table(zeroxla.pipeline.TrainSchedule, 4, 2); "
            "print(sorted(m for m in ('jax', 'numpy', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
