"""`ZeroConfig.check_grad_overflow` (DeepSpeed's `bf16.check_grad_overflow`): in float32 and
bfloat16, a step whose gradients are not finite skips its update, as fp16's loss scaler does; a
finite step is the plain step. Checked against single-device optax that skips the same steps
(`optax.apply_if_finite`, which leaves parameters and the inner state as they were)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
from reference import flat_params, token_batches, train_single_device
from zeroxla import models
from zeroxla.engine.step import next_token_loss


def _poisoned_loss(model, batch):
    """Cross-entropy times the mean of a per-example factor: inf in a poisoned batch."""
    loss = next_token_loss(model, {"inputs": batch["inputs"], "targets": batch["targets"]})
    return loss * jnp.mean(batch["poison"])


def _optimizer():
    # Momentum SGD: optimizer state to keep, and no Adam normalisation, which turns gpt-tiny's
    # key-bias gradient (exactly zero, computed as rounding noise) into full +-lr steps.
    return optax.sgd(0.3, momentum=0.9)


def _batches():
    batches = token_batches(3, 16, 16, vocab=65, seed=3)
    poison = [np.ones(16, np.float32) for _ in batches]
    poison[1][5] = np.inf           # one example on one device: the check must be global
    return [{**b, "poison": p} for b, p in zip(batches, poison)]


@pytest.mark.parametrize("stage,offload", [
    (3, "none"), pytest.param(1, "none", marks=pytest.mark.slow),
    pytest.param(3, "cpu", marks=pytest.mark.slow)])
def test_a_non_finite_gradient_skips_the_update_as_single_device_apply_if_finite(stage, offload):
    batches = _batches()
    _, expected = train_single_device(
        models.build("gpt-tiny", seed=2), optax.apply_if_finite(_optimizer(), 10), batches,
        loss_fn=_poisoned_loss)
    config = zeroxla.ZeroConfig(stage=stage, persistence_threshold=500,
                                check_grad_overflow=True, offload_optimizer=offload)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=2), zeroxla.make_mesh(2, 4),
                             optimizer=_optimizer(), config=config, loss_fn=_poisoned_loss)
    state = step.init()
    state, first = step(state, batches[0])
    before = jax.tree.map(np.array, (state.params, state.opt_state, state.step))
    state, poisoned = step(state, batches[1])
    assert not bool(first["overflow"]) and bool(poisoned["overflow"])
    assert "loss_scale" not in poisoned                  # no loss scaler outside fp16
    after = jax.tree.map(np.array, (state.params, state.opt_state))
    for b, a in zip(jax.tree.leaves(before[:2]), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)              # bit-identical
    state, last = step(state, batches[2])
    assert not bool(last["overflow"])
    got = flat_params(zeroxla.gather_params(state))
    for path, value in expected.items():
        np.testing.assert_allclose(got[path], value, rtol=2e-5, atol=2e-6, err_msg=path)


@pytest.mark.slow
def test_finite_steps_are_the_plain_step():
    """The check adds a select XLA fuses into the update, which may round the update's
    arithmetic differently in the last bit (measured: 7e-9 absolute, 1e-6 relative)."""
    batches = [{k: v for k, v in b.items() if k != "poison"} for b in _batches()]
    batches = [batches[0], batches[2]]
    results = []
    for check in (False, True):
        step = zeroxla.make_step(models.build("gpt-tiny", seed=2), zeroxla.make_mesh(2, 4),
                                 optimizer=_optimizer(),
                                 config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500,
                                                           check_grad_overflow=check))
        state = step.init()
        for batch in batches:
            state, _ = step(state, batch)
        results.append(jax.tree.map(np.array, state.params))
    for a, b in zip(*map(jax.tree.leaves, results)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
