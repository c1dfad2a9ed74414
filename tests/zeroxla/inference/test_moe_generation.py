"""MoE models on the Hybrid Engine: after ZeRO-3 training steps (with and without expert
parallelism), each MoE family decodes with continuous batching over the paged KV cache (its
experts whole on every inference device) the same greedy tokens as the unsharded model's full
forward, at tp 1 and 2."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zeroxla
from zeroxla import models
from zeroxla.inference.expert_reshard import in_device_order
from zeroxla.inference.layout import inference_mesh
from zeroxla.inference.reshard import relabel

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


def trained(family, expert=1):
    config = CONFIGS[family]()
    model = models.REGISTRY[family].model_class(config, rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4 // expert, expert=expert),
                             optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state = step.init()
    rng = np.random.default_rng(1)
    for _ in range(2):
        t = rng.integers(0, 61, (8, 17)).astype(np.int32)
        state, metrics = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
        assert "router/load" in metrics
    return step, state


@pytest.mark.parametrize("family,tp,expert", [
    pytest.param("qwen3_moe", 1, 1, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", 2, 1, marks=pytest.mark.slow),
    pytest.param("mixtral", 1, 1, marks=pytest.mark.slow),
    pytest.param("olmoe", 2, 1, marks=pytest.mark.slow),
    ("qwen3_moe", 2, 2),        # daily: tp 2 and trained at expert parallelism 2
    pytest.param("qwen2_moe", 1, 4, marks=pytest.mark.slow)])
def test_moe_greedy_generation_equals_the_unsharded_model(family, tp, expert):
    """`expert` > 1: trained with the experts split over an expert axis, generated with them
    placed for inference (whole on every device)."""
    step, state = trained(family, expert)
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, **SMALL))
    assert engine.batching == "continuous"
    prompts = [np.random.default_rng(n).integers(0, 61, n).astype(np.int32)
               for n in (1, 3, 9, 14, 5)]
    out = engine.generate(state, prompts, max_new_tokens=10)
    for got, want in zip(out, greedy_reference(step.gathered_model(state), prompts, 10)):
        np.testing.assert_array_equal(got, want)
    assert len({tuple(o[p.size:]) for o, p in zip(out, prompts)}) > 1, "degenerate model"
    targets = engine.layout.param_shardings()          # the decode reads them where they lie
    assert {path: a.sharding for path, a in engine.inference_params(state).items()} == targets


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_major_layout_restated_in_the_training_order_holds_every_slice_where_it_was(tp):
    """The expert-parallel reshard writes the tensor-major inference layout (position (l, t)
    is training device t D/tp + l) over the training devices' order, then relabels the
    buffers: each device must hold the slice the inference layout gives it."""
    devices = jax.devices()
    mesh = inference_mesh(devices, tp)
    assert [d.id for d in mesh.devices.flat] != [d.id for d in devices]
    x = np.arange(8 * 12 * 3, dtype=np.float32).reshape(8, 12, 3)
    for spec in (P(None, "tensor"), P("local", "tensor"), P("tensor", None, None), P()):
        target = NamedSharding(mesh, spec)
        written = in_device_order(target, devices)
        assert list(written.mesh.devices.flat) == devices
        moved = relabel(jax.device_put(x, written), target)
        assert moved.sharding == target
        for shard in moved.addressable_shards:
            np.testing.assert_array_equal(shard.data, x[target.devices_indices_map(x.shape)[
                shard.device]])
    with pytest.raises(ValueError, match="no regrouping of the training devices' order"):
        in_device_order(NamedSharding(mesh, P()), devices[::-1])


def _routing_mismatches(tp):
    """(mismatched (token, layer) pairs, pairs compared) between the KV-cached decode (prompt
    prefilled, then one token a step, as a rollout) with the Hybrid Engine's inference
    parameters at tensor-parallel degree `tp` (its resharded layout, the decode's dots and
    sums split as the engine splits them) and the training forward of the unsharded model,
    over 32 greedy answers of 128 tokens generated by the engine after ZeRO-3 steps."""
    import jax
    import jax.numpy as jnp

    config = CONFIGS["qwen3_moe"]().replace(max_seq_len=144)
    model = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, max_out_tokens=144))
    prompts = [np.random.default_rng(n).integers(0, 61, 8).astype(np.int32) for n in range(32)]
    tokens = jnp.asarray(np.stack(engine.generate(state, prompts, max_new_tokens=128)))
    trained = step.gathered_model(state)
    full, _ = jax.jit(lambda t: trained.router_choices(t))(tokens)        # [L, B, T, k]
    params = engine.inference_params(state)

    @jax.jit
    def decode(params, tokens, positions, cache):
        return engine.model_def.module(params, {}).router_choices(tokens, positions, cache)

    # a cache of the KV heads as the engine lays them out (repeated when tp exceeds them)
    shape = (config.num_layers, 32, 136, config.num_kv_heads * engine.layout.kv_repeat,
             config.head_dim)
    cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}
    positions = jnp.broadcast_to(jnp.arange(8), (32, 8))
    chosen, cache = decode(params, tokens[:, :8], positions, cache)
    cached = [chosen]
    for t in range(8, 135):
        chosen, cache = decode(params, tokens[:, t:t + 1], jnp.full((32, 1), t), cache)
        cached.append(chosen)
    cached = jnp.concatenate(cached, axis=2)                              # [L, B, 135, k]
    generated = slice(7, 135)        # the positions whose output drew a generated token
    differ = jnp.any(cached[:, :, generated] != full[:, :, generated], -1)
    return int(jnp.sum(differ)), differ.size


@pytest.mark.slow
def test_routing_parity_between_the_rollout_decode_and_the_training_forward():
    """Over 4,096 generated tokens x 2 layers: 0 mismatches at tp 1. (The counts at tp 2 and 4
    are measured, not asserted: `_routing_mismatches(2)`; the note of issue 54 states them.)"""
    mismatches, compared = _routing_mismatches(1)
    assert compared == 2 * 32 * 128
    assert mismatches == 0


@pytest.mark.slow
def test_adapter_only_switch_after_expert_parallel_lora_steps():
    """LoRA on the attention and on every expert of an MoE model trained at EP = 2, the base
    frozen: after adapter-only steps the engine reshards the adapters alone (the frozen base
    found bitwise unchanged) and decodes the fused unsharded model's greedy tokens."""
    from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora, fuse_lora_weight
    from zeroxla.lora import lora_trainable

    lora = LoRAConfig(dim=4, alpha=8.0, module_name=r"wq|w_gate|w_down",
                      only_optimize_lora=True)
    model = models.REGISTRY["qwen3_moe"].model_class(CONFIGS["qwen3_moe"](), rngs=nnx.Rngs(0))
    convert_linear_layer_to_lora(model, lora, rngs=nnx.Rngs(2))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 2, expert=2),
                             optimizer=optax.adam(3e-2), trainable=lora_trainable(lora),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=2, **SMALL))
    prompts = [np.random.default_rng(n).integers(0, 61, n).astype(np.int32) for n in (2, 7, 11)]
    state = step.init()
    engine.generate(state, prompts, max_new_tokens=8)
    rng = np.random.default_rng(4)
    for _ in range(3):
        t = rng.integers(0, 61, (8, 17)).astype(np.int32)
        state, _ = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
    out = engine.generate(state, prompts, max_new_tokens=8)
    assert (engine.reshards, engine.trainable_reshards) == (2, 1)
    fused = fuse_lora_weight(step.gathered_model(state))
    for got, want in zip(out, greedy_reference(fused, prompts, 8)):
        np.testing.assert_array_equal(got, want)
