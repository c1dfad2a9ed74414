"""MoE models on the Hybrid Engine: after ZeRO-3 training steps, each MoE family decodes with
continuous batching over the paged KV cache (its experts whole on every inference device) the
same greedy tokens as the unsharded model's full forward, at tp 1 and 2."""

import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models

from inference_helpers import greedy_reference

SHAPE = dict(vocab_size=61, max_seq_len=40, d_model=32, num_heads=4, num_kv_heads=2,
             num_layers=2, num_experts=8, experts_per_token=2, expert_mlp_dim=16, mlp_dim=16,
             expert_tile=4, init_std=0.3)
CONFIGS = {
    "qwen3_moe": lambda: models.Qwen3MoeConfig(**SHAPE, explicit_head_dim=8),
    "qwen2_moe": lambda: models.Qwen2MoeConfig(**SHAPE, shared_expert_mlp_dim=24),
    "mixtral": lambda: models.MixtralConfig(**SHAPE, sliding_window=6),
    "olmoe": lambda: models.OlmoeConfig(**SHAPE),
}
SMALL = dict(kv_block_size=4, max_ragged_batch_size=12, max_ragged_sequence_count=4,
             max_out_tokens=32)


def trained(family):
    config = CONFIGS[family]()
    model = models.REGISTRY[family].model_class(config, rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    rng = np.random.default_rng(1)
    for _ in range(2):
        t = rng.integers(0, 61, (8, 17)).astype(np.int32)
        state, metrics = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
        assert "router/load" in metrics
    return step, state


@pytest.mark.parametrize("family,tp", [
    ("qwen3_moe", 1), pytest.param("qwen2_moe", 2, marks=pytest.mark.slow),
    pytest.param("mixtral", 1, marks=pytest.mark.slow), ("olmoe", 2)])
def test_moe_greedy_generation_equals_the_unsharded_model(family, tp):
    step, state = trained(family)
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, **SMALL))
    assert engine.batching == "continuous"
    prompts = [np.random.default_rng(n).integers(0, 61, n).astype(np.int32)
               for n in (1, 3, 9, 14, 5)]
    out = engine.generate(state, prompts, max_new_tokens=10)
    for got, want in zip(out, greedy_reference(step.gathered_model(state), prompts, 10)):
        np.testing.assert_array_equal(got, want)
    assert len({tuple(o[p.size:]) for o, p in zip(out, prompts)}) > 1, "degenerate model"


@pytest.mark.slow
def test_routing_parity_between_the_cached_decode_and_the_training_forward():
    """Over 4,096 generated tokens (32 answers of 128, greedy on the Hybrid Engine after ZeRO-3
    steps), the KV-cached decode path (prompt prefilled, then one token a step, as a rollout)
    and the training forward of the whole sequences choose the same experts at every token and
    layer: 0 mismatches."""
    import jax
    import jax.numpy as jnp

    config = CONFIGS["qwen3_moe"]().replace(max_seq_len=144)
    model = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(max_out_tokens=144))
    prompts = [np.random.default_rng(n).integers(0, 61, 8).astype(np.int32) for n in range(32)]
    tokens = jnp.asarray(np.stack(engine.generate(state, prompts, max_new_tokens=128)))
    trained = step.gathered_model(state)
    full, _ = jax.jit(lambda t: trained.router_choices(t))(tokens)        # [L, B, T, k]

    @jax.jit
    def decode(tokens, positions, cache):
        return trained.router_choices(tokens, positions, cache)

    cache = trained.init_cache(32, 136)
    positions = jnp.broadcast_to(jnp.arange(8), (32, 8))
    steps, cache = decode(tokens[:, :8], positions, cache)
    cached = [steps]
    for t in range(8, 135):
        chosen, cache = decode(tokens[:, t:t + 1], jnp.full((32, 1), t), cache)
        cached.append(chosen)
    cached = jnp.concatenate(cached, axis=2)                              # [L, B, 135, k]
    generated = slice(7, 135)        # the positions whose output drew a generated token
    mismatches = int(jnp.sum(jnp.any(cached[:, :, generated] != full[:, :, generated], -1)))
    assert tokens.shape == (32, 136) and cached[:, :, generated].shape[1:3] == (32, 128)
    assert mismatches == 0
