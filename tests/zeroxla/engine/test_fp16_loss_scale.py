"""fp16 dynamic loss scaling: DeepSpeed's scaler semantics, and overflow skips the step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zeroxla import models
import zeroxla
from reference import distance_over_travelled, flat_params, token_batches, train_single_device
from tracking import travel_ratio
from zeroxla.engine.loss_scale import init_loss_scale, update_loss_scale
from zeroxla.engine.step import next_token_loss


class DeepSpeedDynamicLossScaler:
    """A line-by-line port of deepspeed/runtime/fp16/loss_scaler.py:DynamicLossScaler.update_scale
    (consecutive_hysteresis=False, raise_error_at_min_scale=False)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


@pytest.mark.parametrize("hysteresis,window", [(1, 3), (2, 4), (3, 2)])
def test_scale_trajectory_matches_deepspeed(hysteresis, window):
    config = zeroxla.ZeroConfig(compute_dtype="float16", initial_scale_power=8,
                                loss_scale_window=window, hysteresis=hysteresis, min_loss_scale=4)
    reference = DeepSpeedDynamicLossScaler(2.0 ** 8, window, 4, hysteresis)
    state = init_loss_scale(config)
    overflows = np.random.default_rng(hysteresis).random(200) < 0.3
    update = jax.jit(update_loss_scale, static_argnums=2)
    for overflow in overflows:
        state = update(state, jnp.bool_(overflow), config)
        reference.update_scale(bool(overflow))
        assert float(state.scale) == reference.cur_scale
        assert int(state.cur_hysteresis) == reference.cur_hysteresis


def _poisoned_loss(model, batch):
    """Cross-entropy, times a per-example factor that is inf in a poisoned batch."""
    loss = next_token_loss(model, {"inputs": batch["inputs"], "targets": batch["targets"]})
    return loss * jnp.mean(batch["poison"])


def _batch(poisoned):
    batch = token_batches(1, 16, 16, vocab=65)[0]
    poison = np.ones(16, np.float32)
    if poisoned:
        poison[3] = np.inf          # lands on one device only: the overflow check must be global
    return {**batch, "poison": poison}


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_overflow_skips_step_and_halves_scale(stage):
    config = zeroxla.ZeroConfig(stage=stage, compute_dtype="float16", persistence_threshold=500,
                                hysteresis=1, initial_scale_power=12, loss_scale_window=2)
    step = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adam(1e-3), config=config, loss_fn=_poisoned_loss)
    state = step.init()
    state, metrics = step(state, _batch(False))          # a good step: Adam state is non-trivial
    assert not bool(metrics["overflow"]) and float(metrics["loss_scale"]) == 2.0 ** 12
    before = jax.tree.map(np.array, (state.params, state.opt_state))
    scale_before = float(state.loss_scale.scale)

    state, metrics = step(state, _batch(True))
    assert bool(metrics["overflow"])
    after = jax.tree.map(np.array, (state.params, state.opt_state))
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)              # bit-identical
    assert float(state.loss_scale.scale) == scale_before / 2

    state, _ = step(state, _batch(False))                # and training goes on
    changed = [not np.array_equal(a, np.array(c)) for a, c in
               zip(jax.tree.leaves(after[0]), jax.tree.leaves(state.params))]
    assert any(changed)


@pytest.mark.slow
def test_hysteresis_absorbs_first_overflow():
    config = zeroxla.ZeroConfig(stage=3, compute_dtype="float16", persistence_threshold=500,
                                hysteresis=2, initial_scale_power=10)
    step = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(1e-2), config=config, loss_fn=_poisoned_loss)
    state = step.init()
    state, m1 = step(state, _batch(True))
    assert bool(m1["overflow"]) and float(state.loss_scale.scale) == 2.0 ** 10
    state, m2 = step(state, _batch(True))
    assert bool(m2["overflow"]) and float(state.loss_scale.scale) == 2.0 ** 9


def test_fp16_training_tracks_float32_single_device():
    """fp16 compute (ZeRO-3, loss-scaled fp16 gradients reduced in 16 bits, fp32 master
    partitions) against plain float32 optax on one device, SGD so that a wrong gradient scale
    shows (Adam normalises it away). Measured, the losses' largest relative gap: 3.7e-7 with
    XLA:CPU's older loop emitters (jax 0.10's suite), 1.35e-5 with its MLIR fusion emitters
    (jax 0.10's default build, and jax 0.12's only emitters: 1.75e-5), which round the 16-bit
    backward differently; step 1's loss is bit-identical in all three. The parameters' distance
    from the reference is 0.08% of the distance travelled, the travel ratio 1 within 1.2e-4.
    With every 16-bit reduced gradient scaled by 1.01 (a wrong scale): 3.9e-4, 0.86% and 1.0058
    (`tracking.py`), so the bounds below (5e-5, 0.2%, 1e-3) hold under either emitter and fail
    for that bug by 8x, 4x and 6x."""
    batches = token_batches(3, 16, 16, vocab=65, seed=4)
    expected_losses, expected = train_single_device(models.build("gpt-tiny", seed=1),
                                                    optax.sgd(0.5), batches)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.5),
                             config=zeroxla.ZeroConfig(compute_dtype="float16",
                                                       persistence_threshold=500))
    state, losses = step.init(), []
    for batch in batches:
        state, metrics = step(state, batch)
        assert not bool(metrics["overflow"])            # every step taken, as the reference's
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected_losses, rtol=5e-5)
    got = flat_params(zeroxla.gather_params(state))
    initial = flat_params(nnx.state(models.build("gpt-tiny", seed=1), nnx.Param))
    assert distance_over_travelled(got, expected, initial) < 2e-3
    assert abs(travel_ratio(got, expected, initial) - 1) < 1e-3
