"""Every ZeRO stage on 8 devices trains exactly like plain single-device optax."""

import functools

import numpy as np
import optax
import pytest
from flax import nnx

from zeroxla import models
import zeroxla
from reference import flat_params, token_batches, train_single_device

STEPS = 5
BATCH, SEQ = 32, 16
# Under this threshold biases and norms stay replicated; the matrices and embeddings (vocabulary
# 65, d_model 60: no size divides 8) are partitioned and padded.
THRESHOLD = 500

CASES = [  # (mesh nodes x local, gradient accumulation steps)
    ((2, 4), 1),
    ((1, 8), 4),
]


def _zero_run(model_name, optimizer, stage, mesh_shape, accumulation, batches):
    model = models.build(model_name, seed=1)
    mesh = zeroxla.make_mesh(*mesh_shape)
    config = zeroxla.ZeroConfig(stage=stage, persistence_threshold=THRESHOLD,
                                gradient_accumulation_steps=accumulation, gradient_clipping=1.0)
    step = zeroxla.make_step(model, mesh, optimizer=optimizer, config=config)
    state = step.init()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, flat_params(zeroxla.gather_params(state))


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1),
    "sgd": lambda: optax.sgd(0.5, momentum=0.9),
}


@functools.cache
def _reference(model_name, optimizer_name):
    """The single-device run, computed once per model and optimizer (all stages compare to it)."""
    batches = token_batches(STEPS, BATCH, SEQ, vocab=65, seed=len(optimizer_name))
    losses, params = train_single_device(models.build(model_name, seed=1),
                                          OPTIMIZERS[optimizer_name](), batches, clip=1.0)
    return batches, losses, params


def _sweep():
    """Every (model, stage, mesh, accumulation); the daily `-m "not slow"` subset keeps one:
    gpt-tiny at stage 3 on 2 x 4."""
    for model_name in ("gpt-tiny", "llama-tiny"):
        for stage in (0, 1, 2, 3):
            for mesh_shape, accumulation in CASES:
                daily = (model_name, stage, mesh_shape) == ("gpt-tiny", 3, (2, 4))
                yield pytest.param(model_name, stage, mesh_shape, accumulation,
                                   marks=() if daily else pytest.mark.slow,
                                   id=f"{model_name}-stage{stage}-{mesh_shape[0]}x"
                                      f"{mesh_shape[1]}-accumulate{accumulation}")


SWEEP = list(_sweep())


@pytest.mark.parametrize("model_name,stage,mesh_shape,accumulation", SWEEP)
def test_adamw_losses_match_single_device(model_name, stage, mesh_shape, accumulation):
    batches, expected, _ = _reference(model_name, "adamw")
    got, _ = _zero_run(model_name, OPTIMIZERS["adamw"](), stage, mesh_shape, accumulation,
                       batches)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert expected[-1] < expected[0]   # it trained


@pytest.mark.parametrize("model_name,stage,mesh_shape,accumulation", SWEEP)
def test_sgd_parameters_match_single_device(model_name, stage, mesh_shape, accumulation):
    batches, _, expected = _reference(model_name, "sgd")
    _, got = _zero_run(model_name, OPTIMIZERS["sgd"](), stage, mesh_shape, accumulation, batches)
    initial = flat_params(nnx.state(models.build(model_name, seed=1), nnx.Param))
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert got[path].shape == initial[path].shape
    moved = sum(np.abs(expected[p] - initial[p]).max() > 1e-3 for p in expected)
    assert moved > len(expected) // 2   # the run really changed the parameters
