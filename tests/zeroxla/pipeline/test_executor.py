"""Pipelined training (1F1B, GPipe and ZB-H1 over the mesh's stage axis, ZeRO inside the
stages) trains exactly like plain single-device optax: losses and final parameters, float32.

Coverage (one compiled step per case, 20-90 s each on the 2-core machine, hence all marked
slow; the cross product would cost many minutes of compilation):

    model       stages x node x local   M   schedule  ZeRO  gather       layers  partition
    gpt-tiny    2 x 1 x 4               4   1f1b      0     -            4       parameters
    gpt-tiny    4 x 1 x 2               8   gpipe     3     micro_batch  4       parameters
    llama-tiny  4 x 1 x 2               1   1f1b      3     step         4       uniform: 1,2,1,0 blocks
    llama-tiny  2 x 1 x 4               8   gpipe     0     -            3       parameters: 2,1
    gpt-tiny    4 x 1 x 2               4   1f1b      2     -            5       type:block: 2,1,1,1
    gpt-tiny    2 x 1 x 4               1   gpipe     3     step         2       parameters
    llama-tiny  2 x 1 x 4               4   1f1b      3     micro_batch  4       parameters

Stages 2 and 4; M = 1 (< S), 4, 8; both schedules; ZeRO 0 and 3 (both gather modes) and 2;
GPT-2's tied embedding and Llama; uneven splits, including a stage with no blocks.

ZB-H1 (backward split into the input-gradient pass B and the weight-gradient pass W), SGD:

    model       stages x node x local   M   ZeRO  gather       layers  remat
    gpt-tiny    2 x 1 x 4               4   0     -            4       none (W weight-only:
                                                                       the split kept vjp)
    llama-tiny  4 x 1 x 2               4   3     micro_batch  4       none (B gathers, W
                                                                       reduce-scatters)
    gpt-tiny    2 x 1 x 4               2   3     step         2       full (B and W recompute)

In the daily subset (`-m "not slow"`), one small case per schedule that runs the executor's
every pass, 2 SGD steps, losses and parameters (about 6-8 s each, compilation mostly):

    model       stages x node x local   M   schedule  ZeRO  layers  remat
    gpt-tiny    2 x 1 x 2               4   1f1b      0     2       none
    gpt-tiny    2 x 1 x 2               4   zb-h1     0     2       none (W weight-only)
"""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from reference import flat_params, masked_optimizer, token_batches, train_single_device
from runs import run_steps

STEPS, BATCH, SEQ = 3, 32, 8
THRESHOLD = 500          # biases and norms replicated, matrices partitioned (and padded) at stage 3

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1),
    "sgd": lambda: optax.sgd(0.5, momentum=0.9),
}


@functools.cache
def _reference(model_name, num_layers, optimizer):
    batches = token_batches(STEPS, BATCH, SEQ, vocab=65, seed=num_layers)
    losses, params = train_single_device(models.build(model_name, seed=1, num_layers=num_layers),
                                         OPTIMIZERS[optimizer](), batches)
    return batches, losses, params


def _pipelined_run(model_name, num_layers, optimizer, stages, pipeline, zero_stage, batches,
                   remat="none"):
    mesh = zeroxla.make_mesh(1, stages=stages)
    step = zeroxla.make_step(
        models.build(model_name, seed=1, num_layers=num_layers), mesh,
        optimizer=OPTIMIZERS[optimizer](),
        config=zeroxla.ZeroConfig(stage=zero_stage, persistence_threshold=THRESHOLD,
                                  remat=remat),
        pipeline=pipeline)
    state, losses = run_steps(step, step.init(), batches)
    return step, losses, flat_params(zeroxla.gather_params(state))


SLOW = pytest.mark.slow
CASES = [  # the optimizer: SGD checks losses and parameters, AdamW losses
    pytest.param("gpt-tiny", 4, 2, zeroxla.PipelineConfig(4), 0, "sgd", (2, 2),
                 id="gpt-s2-m4-1f1b-z0-sgd", marks=SLOW),
    pytest.param("gpt-tiny", 4, 4, zeroxla.PipelineConfig(8, schedule="gpipe"), 3, "adamw",
                 (1, 1, 1, 1), id="gpt-s4-m8-gpipe-z3-microbatch-adamw", marks=SLOW),
    pytest.param("llama-tiny", 4, 4,
                 zeroxla.PipelineConfig(1, partition_method="uniform", zero3_gather="step"), 3,
                 "sgd", (1, 2, 1, 0), id="llama-s4-m1-1f1b-z3-step-uneven-sgd", marks=SLOW),
    pytest.param("llama-tiny", 3, 2, zeroxla.PipelineConfig(8, schedule="gpipe"), 0, "adamw",
                 (2, 1), id="llama-s2-m8-gpipe-z0-uneven-adamw", marks=SLOW),
    pytest.param("gpt-tiny", 5, 4, zeroxla.PipelineConfig(4, partition_method="type:block"), 2,
                 "sgd", (2, 1, 1, 1), id="gpt-s4-m4-1f1b-z2-typeregex-sgd", marks=SLOW),
    pytest.param("gpt-tiny", 2, 2,
                 zeroxla.PipelineConfig(1, schedule="gpipe", zero3_gather="step"), 3, "sgd",
                 (1, 1), id="gpt-s2-m1-gpipe-z3-step-sgd", marks=SLOW),
    pytest.param("llama-tiny", 4, 2, zeroxla.PipelineConfig(4), 3, "sgd", (2, 2),
                 id="llama-s2-m4-1f1b-z3-microbatch-sgd", marks=SLOW),
]


@pytest.mark.parametrize("model_name,num_layers,stages,pipeline,zero_stage,optimizer,blocks",
                         CASES)
def test_matches_single_device(model_name, num_layers, stages, pipeline, zero_stage, optimizer,
                               blocks):
    batches, expected_losses, expected = _reference(model_name, num_layers, optimizer)
    step, losses, got = _pipelined_run(model_name, num_layers, optimizer, stages, pipeline,
                                       zero_stage, batches)
    assert step.pipeline.split.num_layers == blocks          # the split the case claims
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert expected_losses[-1] < expected_losses[0]          # it trained
    assert got.keys() == expected.keys()
    if optimizer == "sgd":
        for path in expected:
            np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                       err_msg=path)
        initial = flat_params(nnx.state(models.build(model_name, seed=1, num_layers=num_layers),
                                        nnx.Param))
        moved = sum(np.abs(expected[p] - initial[p]).max() > 1e-3 for p in expected)
        assert moved > len(expected) // 2                  # the run really changed them


ZB_CASES = [  # the references are the 1F1B cases' (same model, layers, optimizer): cached
    pytest.param("gpt-tiny", 4, 2, zeroxla.PipelineConfig(4, schedule="zb-h1"), 0, "none",
                 id="gpt-s2-m4-zbh1-z0", marks=SLOW),
    pytest.param("llama-tiny", 4, 4, zeroxla.PipelineConfig(4, schedule="zb-h1"), 3, "none",
                 id="llama-s4-m4-zbh1-z3-microbatch", marks=SLOW),
    pytest.param("gpt-tiny", 2, 2,
                 zeroxla.PipelineConfig(2, schedule="zb-h1", zero3_gather="step"), 3, "full",
                 id="gpt-s2-m2-zbh1-z3-step-remat-full", marks=SLOW),
]


@pytest.mark.parametrize("model_name,num_layers,stages,pipeline,zero_stage,remat", ZB_CASES)
def test_zb_h1_matches_single_device(model_name, num_layers, stages, pipeline, zero_stage,
                                     remat):
    batches, expected_losses, expected = _reference(model_name, num_layers, "sgd")
    step, losses, got = _pipelined_run(model_name, num_layers, "sgd", stages, pipeline,
                                       zero_stage, batches, remat=remat)
    assert step.pipeline.table.schedule == "ZBH1Schedule"
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)


def test_describe_and_step_surface():
    mesh = zeroxla.make_mesh(1, stages=2)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=0, num_layers=3), mesh,
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=0),
                             pipeline=zeroxla.PipelineConfig(2))
    text = step.pipeline.describe()
    assert "stage 0: embedding, blocks 0..0" in text and "stage 1: blocks 1..2, head" in text
    assert "TrainSchedule, 2 micro-batches, 6 steps, 2 stash buffers" in text
    zb = zeroxla.make_step(models.build("gpt-tiny", seed=0, num_layers=3), mesh,
                           optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=0),
                           pipeline=zeroxla.PipelineConfig(4, schedule="zb-h1"))
    assert ("ZBH1Schedule, 4 micro-batches, forward, input-gradient backward B and "
            "weight-gradient pass W per micro-batch, 13 steps, 2 stash buffers, bubble 0.077"
            in zb.pipeline.describe())


# The daily subset's pipeline check: the smallest gpt-tiny pipeline that runs the executor's
# every pass (2 stages of one block each, 2 data replicas per stage, M = 4 so that stage 0
# cycles through more than one stash buffer), ZeRO-0, 2 SGD steps. Its single-device reference
# has test_mesh_roles.py's shapes and optimizer, so in a run holding both it compiles once.
DAILY_BATCH, DAILY_SEQ = 16, 16


@functools.cache
def _daily_reference():
    batches = token_batches(2, DAILY_BATCH, DAILY_SEQ, vocab=65, seed=5)
    losses, params = train_single_device(models.build("gpt-tiny", seed=2),
                                         OPTIMIZERS["sgd"](), batches)
    return batches, losses, params


@pytest.mark.parametrize("schedule,schedule_class", [
    ("1f1b", "TrainSchedule"),
    # daily for ZB-H1: test_weight_split.py's split of the backward against float64
    pytest.param("zb-h1", "ZBH1Schedule", marks=pytest.mark.slow)])
def test_two_stages_match_single_device_sgd(schedule, schedule_class):
    """2 stages x 1 node x 2 local, M = 4, ZeRO-0: losses and parameters after 2 SGD steps
    equal single-device optax's. ZB-H1 runs its B / W split (remat "none"): W reads the
    weight stash B wrote at its micro-batch's buffer, and with M = 4 > 2 buffers a W reading
    any other buffer's stash takes another micro-batch's cotangents."""
    batches, expected_losses, expected = _daily_reference()
    mesh = zeroxla.make_mesh(1, stages=2, devices=jax.devices()[:4])
    step = zeroxla.make_step(models.build("gpt-tiny", seed=2), mesh,
                             optimizer=OPTIMIZERS["sgd"](), config=zeroxla.ZeroConfig(stage=0),
                             pipeline=zeroxla.PipelineConfig(4, schedule=schedule))
    assert step.pipeline.table.schedule == schedule_class
    assert step.pipeline.split.num_layers == (1, 1) and step.pipeline.num_buffers == 2
    state, losses = run_steps(step, step.init(), batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = flat_params(zeroxla.gather_params(state))
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)
    assert expected_losses[-1] < expected_losses[0]          # it trained
    initial = flat_params(nnx.state(models.build("gpt-tiny", seed=2), nnx.Param))
    assert sum(np.abs(expected[p] - initial[p]).max() > 1e-3 for p in expected) > len(expected) // 2


# Slow: test_two_stages_match_single_device_sgd[1f1b]'s path with a mask (frozen parameters are
# daily in tests/zeroxla/engine/test_frozen_params.py).
@pytest.mark.slow
def test_frozen_tied_embedding_trains_like_single_device_with_it_masked():
    """`trainable=` freezing GPT-2's tied wte, read by the first stage (embedding) and the last
    (head): 2 stages x 1 node x 2 local, M = 4, 1F1B, ZeRO-0, 2 SGD steps. The reference is
    single-device optax with wte's updates set to zero (`optax.multi_transform`): equal losses
    and parameters, wte bitwise unchanged, and no optimizer state for it."""
    batches = _daily_reference()[0]
    frozen = "embed/wte"
    model = models.build("gpt-tiny", seed=2)
    start = flat_params(nnx.state(model, nnx.Param))
    assert frozen in start

    expected_losses, expected = train_single_device(
        model, masked_optimizer(OPTIMIZERS["sgd"](), set(start) - {frozen}), batches)
    mesh = zeroxla.make_mesh(1, stages=2, devices=jax.devices()[:4])
    step = zeroxla.make_step(models.build("gpt-tiny", seed=2), mesh,
                             optimizer=OPTIMIZERS["sgd"](), config=zeroxla.ZeroConfig(stage=0),
                             trainable=nnx.Not(nnx.PathContains("wte")),
                             pipeline=zeroxla.PipelineConfig(4))
    assert [leaf.path for leaf in step.layout.plan.leaves if not leaf.trainable] == [frozen]
    state, losses = run_steps(step, step.init(), batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = flat_params(zeroxla.gather_params(state))
    np.testing.assert_array_equal(got[frozen], start[frozen])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)
    assert "wte" not in str(jax.tree.structure(state.opt_state))
