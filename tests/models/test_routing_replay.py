"""Routing replay (R3) in the MoE layer and stack: tokens sent to a recorded selection, weighed by
the live router's probabilities there. The layer's gradients (router included) against a float64
dense reference written out here (every expert computed for every token, the selection a one-hot
mask); replaying the live choice gives the ordinary forward bit for bit; mismatches counted
against the record's construction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.models.moe import MoeMLP

CONFIG = models.Qwen3MoeConfig(vocab_size=64, max_seq_len=32, d_model=32, num_heads=4,
                               num_kv_heads=2, explicit_head_dim=8, num_layers=2, mlp_dim=48,
                               num_experts=8, experts_per_token=2, expert_mlp_dim=16,
                               expert_tile=4, init_std=0.3)
PARAMS = ("router", "w_gate", "w_up", "w_down")


def live_top_k(router, x, top_k):
    """The k most probable experts of each token [N, k], float64 numpy."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)              # [N, E]
    return np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]


def dense_reference(p, x, chosen, norm_topk_prob, cotangent):
    """sum(out * cotangent) of the MoE layer with the selection `chosen` int [N, k] fixed and
    the weights the live softmax(x @ router) at the selected experts; every expert computed
    for every token."""
    probs = jax.nn.softmax(x @ p["router"], axis=-1)                                 # [N, E]
    onehot = jax.nn.one_hot(chosen, probs.shape[-1], dtype=x.dtype)                 # [N, k, E]
    weights = jnp.einsum("NE,NKE->NK", probs, onehot)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    gate = jnp.einsum("ND,EDF->NEF", x, p["w_gate"])
    up = jnp.einsum("ND,EDF->NEF", x, p["w_up"])
    y = jnp.einsum("NEF,EFD->NED", jax.nn.silu(gate) * up, p["w_down"])            # [N, E, D]
    out = jnp.einsum("NK,NKE,NED->ND", weights, onehot, y)
    return jnp.sum(out * cotangent)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_layer_gradients_equal_the_float64_reference(norm_topk_prob):
    """Every gradient (router, experts, input) of the replayed layer within 1e-6 relative of
    the dense float64 reference; a token without a record routes live; the router's gradient
    is not zero (the weights come from the live router)."""
    cfg = CONFIG.replace(norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(0)
    b, t, k, e = 2, 6, cfg.experts_per_token, cfg.num_experts
    with jax.enable_x64(True):
        graphdef, params, rest = nnx.split(MoeMLP(cfg, rngs=nnx.Rngs(1)), nnx.Param, ...)
        params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
        p = {name: params[name][...] for name in PARAMS}
        x = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float64)
        record = np.stack([rng.choice(e, k, replace=False) for _ in range(b * t)])  # [N, k]
        record[[1, 7]] = -1                                     # two tokens with no record
        cotangent = jnp.asarray(rng.normal(size=(b * t, cfg.d_model)), jnp.float64)

        def replayed(params, x):
            out, _, _ = nnx.merge(graphdef, params, rest)(
                x, replay=jnp.asarray(record.reshape(b, t, k), jnp.int32))
            return jnp.sum(out.reshape(b * t, -1) * cotangent)

        grads, g_x = jax.jit(jax.grad(replayed, argnums=(0, 1)))(params, x)
        got = ({name: grads[name][...] for name in PARAMS}, g_x)
        live = live_top_k(p["router"], x.reshape(b * t, -1), k)
        chosen = np.where(record[:, :1] >= 0, record, live)                          # [N, k]
        want = jax.jit(jax.grad(dense_reference, argnums=(0, 1)), static_argnums=(3,))(
            p, x.reshape(b * t, -1), chosen, norm_topk_prob, cotangent)
    for name in PARAMS:
        scale = np.abs(want[0][name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(got[0][name], want[0][name], rtol=0, atol=1e-6 * scale,
                                   err_msg=name)
    np.testing.assert_allclose(got[1].reshape(b * t, -1), want[1], rtol=0,
                               atol=1e-6 * np.abs(want[1]).max())


def test_replaying_the_live_choice_is_the_ordinary_forward_and_mismatches_are_counted():
    """The stack replaying the choice `router_choices` records gives `routed_token_logprobs`'
    log-probs and router statistics bit for bit, 0 mismatches; a record whose last layer is
    changed at n tokens (the last layer's router input unchanged by it) counts exactly n."""
    model = models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (3, 12)), jnp.int32)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    @jax.jit
    def run(record):
        plain = model.routed_token_logprobs(inputs, labels)
        return plain, model.replayed_token_logprobs(inputs, labels, record)

    choices, _ = jax.jit(model.router_choices)(inputs)                      # [L, B, T, k]
    record = jnp.moveaxis(choices, 0, 2)                                    # [B, T, L, k]
    (logp, stats), (got, got_stats, mismatches) = run(record)
    np.testing.assert_array_equal(got, logp)
    for a, b in zip(got_stats, stats):
        np.testing.assert_array_equal(a, b)
    assert int(jnp.sum(mismatches)) == 0
    changed = np.zeros((3, 11), bool)
    changed[0, 2] = changed[1, 5] = changed[2, 0] = changed[2, 10] = True
    shifted = (record[:, :, -1] + 3) % CONFIG.num_experts                  # a different pair
    other = record.at[:, :, -1].set(jnp.where(changed[..., None], shifted, record[:, :, -1]))
    _, (moved, _, mismatches) = run(other)
    np.testing.assert_array_equal(mismatches, changed.astype(np.int32))
    assert not np.array_equal(moved, logp)


def test_a_record_of_the_wrong_shape_is_refused():
    model = models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"replay \(2, 5, 2\) must be \[B, T, L, k\]"):
        model.replayed_token_logprobs(tokens, tokens, jnp.zeros((2, 5, 2), jnp.int32))
