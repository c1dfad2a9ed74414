"""What the compiled pipelined step holds and sends, read from XLA's own reports.

* Memory (`compiled.memory_analysis()`): the activation stash is bounded by the micro-batches in
  flight. From 4 to 16 micro-batches (fixed micro-batch size, 4 stages) GPipe's temporaries grow
  (it stashes every micro-batch) and 1F1B's stay flat (at most S - stage in flight).
* Collective-permutes (`compiled.as_text()`, with loop trip counts): exactly the two the executor
  issues per schedule step (activations to stage + 1, gradients to stage - 1), each run once per
  step of the table, moving one micro-batch activation [mb, T, D] between the stage pairs of every
  data replica.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from zeroxla.analysis.hlo import collectives

pytestmark = pytest.mark.slow

STAGES, LAYERS, SEQ, MICRO_BATCH = 4, 4, 32, 2          # mesh 4 stages x 1 x 2
D_MODEL = models.GPTConfig.tiny().d_model


@functools.cache
def _compiled(schedule, micro_batches):
    mesh = zeroxla.make_mesh(1, stages=STAGES)
    step = zeroxla.make_step(models.build("gpt-tiny", num_layers=LAYERS), mesh,
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=0),
                             pipeline=zeroxla.PipelineConfig(micro_batches, schedule=schedule))
    batch_size = MICRO_BATCH * micro_batches * step.data_size
    batch = {k: jnp.zeros((batch_size, SEQ), jnp.int32) for k in ("inputs", "targets")}
    return step, step.compile(jax.eval_shape(step.init), batch)


def _temp_bytes(schedule, micro_batches):
    return _compiled(schedule, micro_batches)[1].memory_analysis().temp_size_in_bytes


def test_1f1b_stash_is_flat_in_micro_batches_and_gpipe_grows():
    temps = {(s, m): _temp_bytes(s, m) for s in ("1f1b", "gpipe") for m in (4, 16)}
    stash_buffer = MICRO_BATCH * SEQ * D_MODEL * 4                    # one [mb, T, D] float32
    gpipe_growth = temps["gpipe", 16] - temps["gpipe", 4]
    one_f_one_b_growth = temps["1f1b", 16] - temps["1f1b", 4]
    # GPipe keeps 12 more micro-batches' stage inputs; 1F1B keeps min(S, M) = 4 either way.
    assert gpipe_growth >= 12 * stash_buffer, temps
    assert one_f_one_b_growth <= 0.1 * gpipe_growth, temps
    assert temps["1f1b", 16] < temps["gpipe", 16]


@pytest.mark.parametrize("schedule,micro_batches", [("1f1b", 4), ("gpipe", 16)])
def test_collective_permutes_are_what_the_table_implies(schedule, micro_batches):
    step, compiled = _compiled(schedule, micro_batches)
    table = step.pipeline.table
    permutes = [c for c in collectives(compiled) if c.kind == "collective-permute"]
    activation = MICRO_BATCH * SEQ * D_MODEL * 4                      # [mb, T, D] float32
    assert len(permutes) == 2                                         # one each way per step
    assert all(c.multiplier == table.num_steps == 2 * (micro_batches + STAGES - 1)
               for c in permutes)
    assert all(c.operand_bytes == activation for c in permutes)
    # Per data replica, the S - 1 neighbour pairs, one way and the other.
    grid = np.asarray(step.mesh.devices)                               # [stage, node, local]
    position = {d: i for i, d in enumerate(step.mesh.devices.flat)}
    up = {(position[grid[s, 0, j]], position[grid[s + 1, 0, j]])
          for s in range(STAGES - 1) for j in range(grid.shape[2])}
    down = {(b, a) for a, b in up}
    assert sorted(set(c.device_pairs) for c in permutes) == sorted([up, down])
    # Every send the table schedules rides one of these permutes: M (S - 1) activations and as
    # many gradients, of the T (S - 1) slots the lockstep executor moves each way.
    sends = sum(b >= 0 for row in table.send_activation for b in row)
    grads = sum(b >= 0 for row in table.send_grad for b in row)
    assert sends == grads == micro_batches * (STAGES - 1)
    assert sends <= table.num_steps * (STAGES - 1)
