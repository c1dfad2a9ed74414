"""The rollout's routing record (`generate(..., return_routing=True)`), static and continuous
batching: each output's [len(output), L, k] experts, per token fed and per MoE layer, against
the unsharded model's full forward over the output (`router_choices`), for sampled answers of
prompts of several lengths at tp 1 and 2 (EP 2 training storage); under continuous batching
also against the static record, with prompts prefilled in chunks, a pool small enough to
preempt (the recomputed tokens recorded again) and a group's shared prompt; refusal by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models

CONFIG = models.Qwen3MoeConfig(vocab_size=61, max_seq_len=40, d_model=32, num_heads=4,
                               num_kv_heads=2, num_layers=2, num_experts=8, experts_per_token=2,
                               expert_mlp_dim=16, mlp_dim=16, expert_tile=4, init_std=0.3,
                               explicit_head_dim=8)


def engine_and_state(tp, expert=2, batching="static"):
    model = models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4 // expert, expert=expert),
                             optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, max_out_tokens=32, batching=batching))
    return step, engine, step.init()


def record_mismatches(step, state, outputs, routing):
    """(differing (token, layer) pairs, pairs compared) between each output's record and the
    gathered model's full forward over the output, on every fed token (all but the last)."""
    model = step.gathered_model(state)
    differ = compared = 0
    for out, record in zip(outputs, routing):
        assert record.shape == (out.size, CONFIG.num_layers, CONFIG.experts_per_token)
        assert np.all(record[-1] == -1) and np.all(record[:-1] >= 0)
        full, _ = jax.jit(model.router_choices)(jnp.asarray(out[None]))    # [L, 1, T, k]
        want = np.moveaxis(np.asarray(full)[:, 0], 0, 1)[:-1]             # [T - 1, L, k]
        got = record[:-1]
        differ += int(np.any(np.sort(got, -1) != np.sort(want, -1), -1).sum())
        compared += want.shape[0] * want.shape[1]
    return differ, compared


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_the_static_rollout_records_every_fed_tokens_experts(tp):
    """Sampled answers (with their drawn log-probs) of prompts of 3, 7 and 11 tokens: the
    record equals the full forward's choice at every fed token and layer (float32; tp 2
    measured equal too), and asking for it changes no token."""
    step, engine, state = engine_and_state(tp)
    prompts = [np.random.default_rng(n).integers(0, 61, n).astype(np.int32) for n in (3, 7, 11)]
    kw = dict(max_new_tokens=9, temperature=1.0, seed=4)
    outputs, drawn, routing = engine.generate(state, prompts, return_logprobs=True,
                                              return_routing=True, **kw)
    for got, want in zip(outputs, engine.generate(state, prompts, **kw)):
        np.testing.assert_array_equal(got, want)
    assert [d.size for d in drawn] == [o.size - p.size for o, p in zip(outputs, prompts)]
    differ, compared = record_mismatches(step, state, outputs, routing)
    assert compared == sum(o.size - 1 for o in outputs) * CONFIG.num_layers
    assert differ == 0


# pages of 4 slots, 8 token places (the 11-token prompt prefills in two chunks), 4 slots, and
# 9 pages (the least for max_out_tokens 32): the answers cannot all fit and are preempted
SMALL_POOL = dict(kv_block_size=4, max_ragged_batch_size=8, max_ragged_sequence_count=4,
                  kv_blocks=9)
PROMPT_LENGTHS = (3, 7, 11, 5)


def continuous_engine(step, tp):
    return zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, max_out_tokens=32, batching="continuous", **SMALL_POOL))


def assert_continuous_records_as_static(tp, group):
    """Sampled answers (temperature 1, seeds 4 and 5) of prompts of PROMPT_LENGTHS tokens, by
    `generate_group` (`group`) or one `generate` per seed, under continuous batching: the
    same tokens, log-probs and routing record as the static engine's, the record equal to the
    unsharded model's full forward at every fed token and layer, and the pool preempted."""
    step, static, state = engine_and_state(tp)
    engine = continuous_engine(step, tp)
    prompts = [np.random.default_rng(n).integers(0, 61, n).astype(np.int32)
               for n in PROMPT_LENGTHS]
    kw = dict(max_new_tokens=12, temperature=1.0, return_logprobs=True, return_routing=True)
    seeds = [4, 5]
    if group:
        got = list(zip(*engine.generate_group(state, prompts, seeds, **kw)))
        preemptions = engine.stats["preemptions"]
    else:
        got, preemptions = [], 0
        for seed in seeds:
            got.append(engine.generate(state, prompts, seed=seed, **kw))
            preemptions += engine.stats["preemptions"]
    assert engine.batching == "continuous" and preemptions > 0
    for seed, (outputs, drawn, routing) in zip(seeds, got):
        want = static.generate(state, prompts, seed=seed, **kw)
        for out, logp, record, *static_row in zip(outputs, drawn, routing, *want):
            np.testing.assert_array_equal(out, static_row[0])
            np.testing.assert_allclose(logp, static_row[1], rtol=0, atol=1e-5)
            np.testing.assert_array_equal(np.sort(record, -1), np.sort(static_row[2], -1))
        differ, compared = record_mismatches(step, state, outputs, routing)
        assert compared == sum(o.size - 1 for o in outputs) * CONFIG.num_layers
        assert differ == 0


def test_the_continuous_rollout_records_what_the_static_one_does():
    """A group's answers at tp 2 (module docstring; `assert_continuous_records_as_static`)."""
    assert_continuous_records_as_static(tp=2, group=True)


@pytest.mark.slow
def test_the_continuous_rollout_records_answers_asked_one_seed_at_a_time():
    """The same at tp 1, one `generate` per seed (no shared prompt)."""
    assert_continuous_records_as_static(tp=1, group=False)


def test_routing_is_refused_by_name_for_a_model_without_it():
    """A dense model has no routing (the engine's check, `generate` calls it before anything
    runs); an MoE model's (L, k) under either batching."""
    from zeroxla.inference.checks import check_routing

    moe = zeroxla.make_step(models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(0)),
                            zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1))
    assert check_routing(moe.layout.model_def) == (2, 2)
    dense = zeroxla.make_step(models.build("gpt-tiny", seed=0), zeroxla.make_mesh(2, 4),
                              optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="return_routing=True with a GPT"):
        check_routing(dense.layout.model_def)
