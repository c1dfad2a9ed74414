"""Routing replay (R3) in the ZeRO step: a loss replaying a recorded selection (the record
[B, T, L, k] beside the batch, split over the data devices with its rows) trains at expert
parallelism 2 under ZeRO-3 with remat as the same replayed loss does on one device in float64
(its layer checked against a dense float64 reference in tests/models/test_routing_replay.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from reference import flat_params, token_batches, train_single_device
from test_moe_training import CONFIG


def float64_model(seed=0):
    model = models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.float64), params))
    return model


def replayed_loss(model, batch, *, experts=None):
    """(sum, count, stats) of the next-token loss with every layer's routing replayed from
    batch["replay"] int32 [B, T, L, k]."""
    options = {} if experts is None else {"experts": experts}
    logp, stats, _ = model.replayed_token_logprobs(batch["inputs"], batch["targets"],
                                                   batch["replay"], **options)
    return -jnp.sum(logp), jnp.float32(logp.size), stats


def written_out(model, batch):
    """The single-device loss: the mean replayed cross-entropy plus the weighed auxiliary loss
    (transformers' load_balancing_loss_func of the live router's statistics)."""
    total, count, s = replayed_loss(model, batch)
    rows = s.rows
    return total / count + CONFIG.aux_loss_weight * CONFIG.num_experts * jnp.sum(
        s.counts / rows * s.prob_sum / rows)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "none"])
def test_replayed_step_at_expert_parallelism_2_equals_one_device_float64(remat):
    """One SGD step of learning rate 1 (the update is the gradient) at EP 2 x 4 data devices,
    ZeRO-3, remat "full" (the layers recomputed in backward with the same record; "none":
    their residuals kept), float64, the record another model's routing (so that it differs
    from the live one): every leaf's gradient, the router's included, within 1e-6 relative of
    the single-device float64 gradient of the same replayed loss."""
    with jax.enable_x64(True):
        batch = token_batches(1, 8, 12, CONFIG.vocab_size, seed=5)[0]
        other = models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(7))
        choices, _ = jax.jit(other.router_choices)(jnp.asarray(batch["inputs"]))
        batch["replay"] = np.asarray(jnp.moveaxis(choices, 0, 2))            # [B, T, L, k]
        live, _ = jax.jit(float64_model().router_choices)(jnp.asarray(batch["inputs"]))
        assert np.any(np.asarray(live) != np.moveaxis(batch["replay"], 2, 0))
        sgd = optax.sgd(1.0)
        initial = flat_params(nnx.state(float64_model(), nnx.Param))
        _, want = train_single_device(float64_model(), sgd, [batch], loss_fn=written_out)
        step = zeroxla.make_step(
            float64_model(), zeroxla.make_mesh(2, 2, expert=2), optimizer=sgd,
            loss_fn=replayed_loss, config=zeroxla.ZeroConfig(
                stage=3, persistence_threshold=0, remat=remat, compute_dtype="float64"))
        state, _ = step(step.init(), batch)
        got = flat_params(zeroxla.gather_params(state))
    assert "blocks/layers/moe/router" in want
    for path in want:
        grad, want_grad = initial[path] - got[path], initial[path] - want[path]
        scale = np.abs(want_grad).max()
        assert scale > 0, path
        np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6 * scale, err_msg=path)
