"""The Hybrid Engine generating from a LoRA model trained under ZeRO-3: the adapters are applied
in the decode program (W + (alpha / r) A @ B formed from the tensor-parallel A, B and W), and the
greedy tokens equal those of the unsharded fused model (`fuse_lora_weight` of the gathered
parameters, a full forward per token, no KV cache); generation leaves the stored state bitwise
unchanged."""

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora, fuse_lora_weight, lora_trainable
from zeroxla.models import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from inference_helpers import batches, greedy_reference, prompts_of  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 8
# 8 query and 4 KV heads: tensor parallelism 1, 2 and 4 all split them.
CONFIG = LlamaConfig(d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128, init_std=0.2)
LORA = LoRAConfig(dim=4, alpha=8.0, only_optimize_lora=True)


def _base():
    return Llama(CONFIG, rngs=nnx.Rngs(1))


@functools.cache
def _step():
    """The ZeRO-3 step (2 x 4, every leaf partitioned) of the LoRA model, adapters alone trained."""
    model = _base()
    convert_linear_layer_to_lora(model, LORA, rngs=nnx.Rngs(2))
    return zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.adam(1e-2),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0),
                             trainable=lora_trainable(LORA))


def test_greedy_tokens_equal_the_fused_unsharded_model_at_tp_1_2_4():
    step = _step()
    state = step.init()
    for batch in batches(0, count=10):
        state, _ = step(state, batch)
    stored = jax.tree.map(np.asarray, state.params)
    prompts = prompts_of()
    expected = greedy_reference(fuse_lora_weight(zeroxla.gathered_model(state)), prompts, NEW)
    untrained = greedy_reference(_base(), prompts, NEW)
    assert any(not np.array_equal(a, b) for a, b in zip(expected, untrained)), \
        "10 LoRA steps did not change the greedy tokens: the test would not see the adapters"
    for tp in (1, 2, 4):
        engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=tp,
                                                              max_out_tokens=32))
        for prompt, out, ref in zip(prompts, engine.generate(state, prompts, max_new_tokens=NEW),
                                    expected):
            np.testing.assert_array_equal(out, ref, err_msg=f"tp={tp}")
        engine.release()
    for path, before in stored.items():              # base codes and adapters: bitwise
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b, err_msg=path),
                     state.params[path], before)


def test_switch_after_adapter_steps_moves_adapters_only():
    """After optimizer steps that change only the adapters, the switch reshards the adapters
    alone (the frozen base found bitwise unchanged), and generation still equals the fused
    unsharded model; a state with another base gets the full reshard."""
    step = _step()
    state = step.init()
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    prompts = prompts_of()
    engine.generate(state, prompts, max_new_tokens=NEW)
    for batch in batches(0, count=5):
        state, _ = step(state, batch)
    outs = engine.generate(state, prompts, max_new_tokens=NEW)
    assert (engine.reshards, engine.trainable_reshards) == (2, 1)
    expected = greedy_reference(fuse_lora_weight(zeroxla.gathered_model(state)), prompts, NEW)
    for out, ref in zip(outs, expected):
        np.testing.assert_array_equal(out, ref)

    # The adapter-only switch's bytes per device (the compiled program's collectives) are at
    # most the adapters' float32 bytes; the full switch's are more than the base's share.
    inputs = engine.reshard_inputs(state)
    trainable = {leaf.path: inputs[leaf.path] for leaf in step.layout.plan.trainable_leaves}
    moved = zeroxla.comm_report(engine.trainable_reshard_program().lower(trainable).compile(),
                                mesh=engine.mesh).traffic().max_total
    adapters = sum(4 * leaf.numel for leaf in step.layout.plan.trainable_leaves)
    full = zeroxla.comm_report(engine.reshard_program(state), mesh=engine.mesh).traffic()
    assert 0 < moved <= adapters < full.max_total

    # Another base under the same plan: found changed, fully resharded, generation follows it.
    path = "blocks/layers/wk/base"
    other = dataclasses.replace(state, params={**state.params,
                                               path: state.params[path] * 2.0})
    outs = engine.generate(other, prompts, max_new_tokens=NEW)
    assert (engine.reshards, engine.trainable_reshards) == (3, 1)
    expected = greedy_reference(fuse_lora_weight(zeroxla.gathered_model(other)), prompts, NEW)
    for out, ref in zip(outs, expected):
        np.testing.assert_array_equal(out, ref)
    engine.release()
