"""The Hybrid Engine against the unsharded model, and what it must leave untouched."""

import gc

import jax
import numpy as np
import pytest

from inference_helpers import batches, greedy_reference, prompts_of, train
from zeroxla.inference import HybridEngine, HybridEngineConfig

# Compiles many steps: in the full suite, not in the daily `-m "not slow"` subset.
pytestmark = pytest.mark.slow

NEW = 8


@pytest.mark.parametrize("name,tp", [
    ("gpt-tiny", 1), ("gpt-tiny", 2), ("gpt-tiny", 4), ("llama-tiny", 1), ("llama-tiny", 2),
    pytest.param("llama-small", 4, marks=pytest.mark.slow),
    pytest.param("llama-small", 8, marks=pytest.mark.slow)])
def test_greedy_matches_unsharded_model(trained, name, tp):
    step, state = trained(name)
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=tp, max_out_tokens=32))
    prompts = prompts_of()
    outs = engine.generate(state, prompts, max_new_tokens=NEW)
    expected = greedy_reference(state, prompts, NEW)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out[:prompt.size], prompt)
        np.testing.assert_array_equal(out, ref)
    assert len({tuple(o[p.size:]) for o, p in zip(outs, prompts)}) > 1, "degenerate model"
    assert engine.layout.kv_repeat == (2 if (name, tp) == ("llama-small", 8) else 1)


def test_train_generate_train_is_bitwise_train_train(trained):
    step, _ = trained("gpt-tiny")

    def losses(generate):
        state = step.init()
        engine = HybridEngine(step.layout,
                              HybridEngineConfig(inference_tp_size=2, max_out_tokens=16))
        out = []
        for i, batch in enumerate(batches(5, count=3)):
            if generate and i:
                engine.generate(state, prompts_of(), max_new_tokens=4, temperature=1.0, seed=i)
            state, metrics = step(state, batch)
            out.append(np.asarray(metrics["loss"]))
        return np.array(out)

    np.testing.assert_array_equal(losses(True), losses(False))


def test_pinned_parameters_follow_optimizer_steps(trained):
    step, _ = trained("llama-tiny")
    state = train(step, 1)
    pinned = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    fresh = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32,
                                                  pin_parameters=False))
    prompts = prompts_of()
    first = pinned.generate(state, prompts, max_new_tokens=NEW)
    again = pinned.generate(state, prompts, max_new_tokens=NEW)
    assert pinned.reshards == 1
    for a, b, c in zip(first, again, fresh.generate(state, prompts, max_new_tokens=NEW)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for batch in batches(9, count=2):
        state, _ = step(state, batch)
    after = pinned.generate(state, prompts, max_new_tokens=NEW)
    assert pinned.reshards == 2
    for out, ref in zip(after, greedy_reference(state, prompts, NEW)):
        np.testing.assert_array_equal(out, ref)
    assert any(not np.array_equal(a, b) for a, b in zip(first, after)), "weights did not move"


def live_bytes():
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_release_returns_to_training_memory(trained):
    step, state = trained("gpt-tiny")
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=4, max_out_tokens=32))
    engine.generate(state, prompts_of(), max_new_tokens=2)        # compile outside the count
    engine.release()
    before = live_bytes()
    engine.generate(state, prompts_of(), max_new_tokens=NEW)
    during = live_bytes()
    engine.release()
    assert during > before                 # the pinned copy and the kept cache were live
    assert live_bytes() == before

    transient = HybridEngine(step.layout, HybridEngineConfig(
        inference_tp_size=4, max_out_tokens=32, release_inference_cache=True,
        pin_parameters=False))
    transient.generate(state, prompts_of(), max_new_tokens=NEW)
    assert live_bytes() == before          # nothing kept between calls


def test_eos_cuts_and_top_k_one_is_greedy(trained):
    step, state = trained("gpt-tiny")
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    prompts = prompts_of()
    greedy = engine.generate(state, prompts, max_new_tokens=NEW)
    top1 = engine.generate(state, prompts, max_new_tokens=NEW, temperature=0.7, top_k=1, seed=3)
    for a, b in zip(greedy, top1):
        np.testing.assert_array_equal(a, b)
    eos = int(greedy[1][prompts[1].size + 2])          # row 1's third new token
    cut = engine.generate(state, prompts, max_new_tokens=NEW, eos_id=eos)
    for prompt, full, out in zip(prompts, greedy, cut):
        new = full[prompt.size:]
        hits = np.flatnonzero(new == eos)
        stop = prompt.size + (hits[0] + 1 if hits.size else NEW)
        np.testing.assert_array_equal(out, full[:stop])
    assert cut[1].size == prompts[1].size + 3 or eos in greedy[1][prompts[1].size:][:2]
    assert [o.size for o in engine.generate(state, prompts, max_new_tokens=0)] == \
        [p.size for p in prompts]


@pytest.mark.slow
def test_frozen_base_stored_as_int8_codes(trained):
    """quantized_nontrainable_weights: the frozen leaves live as int8 codes; the inference copy
    is built from their dequantized values, the same ones `gathered_model` sees."""
    import optax

    import zeroxla
    from inference_helpers import MODELS

    step = zeroxla.make_step(
        MODELS["gpt-tiny"](), zeroxla.make_mesh(2, 4), optimizer=optax.adam(3e-3),
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                  quantized_nontrainable_weights=True),
        trainable=lambda path, _: "w_fc" in path or "w_proj" in path)
    assert any(leaf.params_quantized for leaf in step.layout.plan.leaves)
    state = train(step, 2)
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    prompts = prompts_of()
    for out, ref in zip(engine.generate(state, prompts, max_new_tokens=NEW),
                        greedy_reference(state, prompts, NEW)):
        np.testing.assert_array_equal(out, ref)
