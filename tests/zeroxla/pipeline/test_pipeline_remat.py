"""`ZeroConfig.remat` in the pipeline: "none" (the default) keeps each stage's vjp residuals per
stash buffer (never the parameters or their shards) and recomputes nothing in backward; "full"
keeps only the stage input and recomputes the stage. Training is the same; "none" runs fewer
FLOPs (XLA's `cost_analysis`) for more temporary memory.

gpt-tiny, 4 layers over 2 stages x 1 x 4, M = 4 (1F1B), at ZeRO-3 with per-micro-batch gathers
(the blocks are a `GatheredStack`, whose custom vjp keeps only shards) and at ZeRO-2 (the blocks
a plain `lax.scan`). "full" needs ZeRO stage 2 or 3 (`ZeroConfig` refuses it below).
"""

import functools

import jax
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from reference import flat_params, token_batches, train_single_device

pytestmark = pytest.mark.slow

STEPS, BATCH, SEQ, STAGES, MICRO_BATCHES = 3, 16, 8, 2, 4


@functools.cache
def _train(zero_stage, remat):
    """(losses, final parameters, compiled step) of SGD on fixed batches."""
    step = zeroxla.make_step(
        models.build("gpt-tiny", seed=1, num_layers=4), zeroxla.make_mesh(1, stages=STAGES),
        optimizer=optax.sgd(0.5, momentum=0.9),
        config=zeroxla.ZeroConfig(stage=zero_stage, persistence_threshold=500, remat=remat),
        pipeline=zeroxla.PipelineConfig(MICRO_BATCHES, zero3_gather="micro_batch"))
    state = step.init()
    batches = token_batches(STEPS, BATCH, SEQ, vocab=65, seed=4)
    compiled = step.compile(jax.eval_shape(lambda: state), batches[0])
    losses = []
    for batch in batches:                   # the compiled step itself: one compile per case
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, flat_params(zeroxla.gather_params(state)), compiled


@pytest.mark.parametrize("zero_stage", [3, 2])
def test_none_trains_like_full_with_fewer_flops(zero_stage):
    losses, params, none = _train(zero_stage, "none")
    full_losses, full_params, full = _train(zero_stage, "full")
    # "full" recomputes every stage forward in backward: about a third more FLOPs.
    flops, full_flops = none.cost_analysis()["flops"], full.cost_analysis()["flops"]
    assert flops < 0.85 * full_flops, (flops, full_flops)
    np.testing.assert_allclose(losses, full_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    assert params.keys() == full_params.keys()
    # The same arithmetic compiled in other fusions (and the last stage's head gradient added
    # in forward): float32 rounding only, which SGD with momentum carries into the parameters.
    # Relative to the model's parameter scale: an entry near zero (a bias, or the key bias,
    # whose gradient is exactly zero and which holds rounding noise) has no scale of its own.
    scale = max(np.abs(v).max() for v in full_params.values())
    for path in params:
        np.testing.assert_allclose(params[path], full_params[path], rtol=1e-6,
                                   atol=1e-6 * scale, err_msg=path)


def test_full_trains_like_one_device():
    """"full" (recompute the stage in backward) against plain optax on one device, not only
    against "none": the same losses (rtol 1e-5) and parameters (rtol 1e-4, atol 1e-6)."""
    losses, params, _ = _train(3, "full")
    batches = token_batches(STEPS, BATCH, SEQ, vocab=65, seed=4)
    expected_losses, expected = train_single_device(
        models.build("gpt-tiny", seed=1, num_layers=4), optax.sgd(0.5, momentum=0.9), batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert params.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(params[path], expected[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)
