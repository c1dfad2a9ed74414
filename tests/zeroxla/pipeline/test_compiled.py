"""What the compiled pipelined step holds and sends, read from XLA's own reports.

* Memory (`compiled.memory_analysis()`): the activation stash is bounded by the micro-batches in
  flight. From 4 to 16 micro-batches (fixed micro-batch size, 4 stages) GPipe's temporaries grow
  (it stashes every micro-batch) and 1F1B's stay flat (at most S - stage in flight); ZB-H1's
  stay flat too (at most min(S, M) from F to W), above 1F1B's by W's stash.
* Collective-permutes (`compiled.as_text()`, with loop trip counts, through `comm_report`, which
  counts each send branch as often as the table takes it): one execution per DeepSpeed
  SendActivation / SendGrad instruction of the schedule, counted from every stage's stream:
  each permute moves one micro-batch activation [mb, T, D] between ONE stage pair (in every data
  replica), and summed over the steps, each stage pair carries exactly as many activations
  (gradients) as the sending stage's stream has SendActivation (SendGrad) instructions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from zeroxla.analysis.comm_report import comm_report
from zeroxla.pipeline import SendActivation, SendGrad

# Compiles many steps: in the full suite, not in the daily `-m "not slow"` subset.
pytestmark = pytest.mark.slow

STAGES, LAYERS, SEQ, MICRO_BATCH = 4, 4, 32, 2          # mesh 4 stages x 1 x 2
D_MODEL = models.GPTConfig.tiny().d_model


@functools.cache
def _compiled(schedule, micro_batches, stages=STAGES):
    mesh = zeroxla.make_mesh(1, stages=stages)
    step = zeroxla.make_step(models.build("gpt-tiny", num_layers=LAYERS), mesh,
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=0),
                             pipeline=zeroxla.PipelineConfig(micro_batches, schedule=schedule))
    return step, step.compile(jax.eval_shape(step.init), _batch(step, micro_batches))


def _batch(step, micro_batches):
    batch_size = MICRO_BATCH * micro_batches * step.layout.data_size
    return {k: jnp.zeros((batch_size, SEQ), jnp.int32) for k in ("inputs", "targets")}


def _temp_bytes(schedule, micro_batches, stages=STAGES):
    return _compiled(schedule, micro_batches, stages)[1].memory_analysis().temp_size_in_bytes


def test_1f1b_stash_is_flat_in_micro_batches_and_gpipe_grows():
    temps = {(s, m): _temp_bytes(s, m) for s in ("1f1b", "gpipe") for m in (4, 16)}
    stash_buffer = MICRO_BATCH * SEQ * D_MODEL * 4                    # one [mb, T, D] float32
    gpipe_growth = temps["gpipe", 16] - temps["gpipe", 4]
    one_f_one_b_growth = temps["1f1b", 16] - temps["1f1b", 4]
    # GPipe keeps 12 more micro-batches' stashes (each at least an [mb, T, D]: the stage's vjp
    # residuals under the default remat "none"); 1F1B keeps min(S, M) = 4 either way.
    assert gpipe_growth >= 12 * stash_buffer, temps
    assert one_f_one_b_growth <= 0.1 * gpipe_growth, temps
    assert temps["1f1b", 16] < temps["gpipe", 16]


def test_zb_h1_stash_is_flat_in_micro_batches():
    """ZB-H1 keeps min(S, M) = 4 buffers from F to W whatever M: from 4 to 16 micro-batches
    (4 stages: at M = 4 warm-up and cool-down alone, at M = 16 the 3S-step steady state runs as
    a loop) its temporaries stay flat as 1F1B's do (within a tenth of what GPipe's 12 more
    stashes add),
    and exceed 1F1B's by at most what W reads from B: per layer, the output cotangent of each
    op whose weights W differentiates (q, k, v, the attention's and the MLP's output
    projections, the MLP's first layer [4D], the two layer norms: 11 D per token), for each
    buffer and one more in flight as B writes it."""
    zb = {m: _temp_bytes("zb-h1", m) for m in (4, 16)}
    gpipe_growth = _temp_bytes("gpipe", 16) - _temp_bytes("gpipe", 4)
    assert max(zb.values()) - min(zb.values()) <= 0.1 * gpipe_growth, (zb, gpipe_growth)
    buffers, layers_per_stage = STAGES, LAYERS // STAGES             # min(S, M), M >= S
    w_stash = layers_per_stage * MICRO_BATCH * SEQ * 11 * D_MODEL * 4   # one buffer's
    assert zb[16] - _temp_bytes("1f1b", 16) <= (buffers + 1) * w_stash, zb


def _sends_in_streams(schedule, micro_batches, instruction, stages):
    """{stage: how many `instruction`s its stream issues} over one batch."""
    schedule_class = zeroxla.PipelineConfig(micro_batches, schedule=schedule).schedule_class
    return {s: sum(isinstance(i, instruction)
                   for step in schedule_class(micro_batches, stages, s).steps() for i in step)
            for s in range(stages)}


@pytest.mark.parametrize("schedule,micro_batches,stages", [
    ("1f1b", 4, STAGES), ("1f1b", 16, STAGES), ("gpipe", 16, STAGES), ("zb-h1", 16, 2)])
def test_collective_permutes_are_what_the_table_implies(schedule, micro_batches, stages):
    step, compiled = _compiled(schedule, micro_batches, stages)
    report = comm_report(step, jax.eval_shape(step.init), _batch(step, micro_batches))
    permutes = [e for e in report.entries if e.collective.kind == "collective-permute"]
    grid = np.asarray(step.layout.mesh.devices).reshape(stages, -1)          # [stage, data replica]
    position = {d: i for i, d in enumerate(step.layout.mesh.devices.flat)}
    stage_of = {position[d]: s for s in range(stages) for d in grid[s]}
    activation = MICRO_BATCH * SEQ * D_MODEL * 4                      # [mb, T, D] float32
    # One loop per phase of the table; each step's sends are one branch of a switch in it.
    phase_lengths = {p.stop - p.start for p in step.pipeline.phases}
    assert {e.collective.multiplier for e in permutes} <= phase_lengths

    # Each permute moves one activation between one stage pair, in every data replica.
    runs, sent_bytes = {}, {}                                         # (stage, hop) -> total
    for e in permutes:
        c = e.collective
        source, target = c.device_pairs[0]
        s, hop = stage_of[source], stage_of[target] - stage_of[source]
        assert hop in (1, -1), c.device_pairs
        assert sorted(c.device_pairs) == sorted(
            (position[a], position[b]) for a, b in zip(grid[s], grid[s + hop])), c.device_pairs
        assert c.operand_bytes == activation
        runs[s, hop] = runs.get((s, hop), 0) + e.executions
        sent_bytes[s, hop] = sent_bytes.get((s, hop), 0) + e.executions * c.operand_bytes

    # Summed over the steps that take each branch: one run per Send instruction of the sending
    # stage's stream.
    for hop, instruction in ((1, SendActivation), (-1, SendGrad)):
        expected = {s: n for s, n in _sends_in_streams(schedule, micro_batches, instruction,
                                                       stages).items() if n}
        assert sum(expected.values()) == micro_batches * (stages - 1)
        assert {s: n for (s, h), n in runs.items() if h == hop} == expected
        assert sum(b for (_, h), b in sent_bytes.items() if h == hop) == (
            micro_batches * (stages - 1) * activation)


def test_comm_report_counts_the_stage_gathers_once_per_micro_batch():
    """ZeRO-3 inside 2 stages, gathering per micro-batch, default remat "none": each device
    gathers its stage's layers M times in forward, re-gathers them M times in backward and
    reduce-scatters their gradients M times, whatever the loop around the pipeline's branches
    says (`branch_executions`: the forward is compiled into loops of 8 steps in all here, the
    backward of 8, not 4)."""
    stages, m, layers = 2, 4, 4
    step = zeroxla.make_step(
        models.build("gpt-tiny", num_layers=layers), zeroxla.make_mesh(1, stages=stages),
        optimizer=optax.sgd(0.1),
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500),
        pipeline=zeroxla.PipelineConfig(m, zero3_gather="micro_batch"))
    batch = {k: np.zeros((2 * m * step.layout.data_size, 16), np.int32)
             for k in ("inputs", "targets")}
    report = comm_report(step, jax.eval_shape(step.init), batch)
    compiled_runs = step.pipeline.branch_executions()
    for scope in ("pipeline_forward", "pipeline_backward"):              # the loops over-run
        assert compiled_runs[scope][0] > m, compiled_runs
    # One stage's blocks gathered whole, float32: max_layers layers of every stacked leaf.
    stage_blocks = step.pipeline.split.max_layers * sum(
        4 * leaf.padded_numel for leaf in step.layout.plan.leaves if leaf.stacked
        and leaf.params_partitioned)

    def payload(kind, scope):
        return sum(e.collective.payload_bytes * e.executions for e in report.entries
                   if e.collective.kind == kind and scope in e.collective.op_name)

    assert payload("all-gather", "pipeline_forward") == m * stage_blocks
    assert payload("all-gather", "pipeline_backward") == m * stage_blocks
    assert payload("reduce-scatter", "pipeline_backward") == m * stage_blocks
