"""The Hybrid Engine on a state trained with sequence parallelism (issue 66): ZeRO partitions
every parameter over the data axes and the sequence devices ("node", "local", "sequence"), which
for parameters are data devices like any other, so the engine reads them as it reads a
state trained without a sequence axis. Reference: greedy decoding by the unsharded trained model
(`gathered_model`, a full forward per token, no KV cache). The engine refuses a layout it cannot
read when it is built, not at the first generation."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zeroxla
from inference_helpers import batches, greedy_reference, prompts_of
from zeroxla.inference.layout import tensor_parallel_layout
from zeroxla.inference.reshard import check_storage
from zeroxla.models import GPT, GPTConfig

NEW = 6


@functools.cache
def _trained_with_sequence_axis():
    """One optimizer step of the tiny GPT on node 1 x local 2 x sequence 2 (4 devices), every
    leaf partitioned (threshold 0), so every leaf is stored split over the sequence axis."""
    mesh = zeroxla.make_mesh(1, 2, sequence=2, devices=jax.devices()[:4])
    step = zeroxla.make_step(GPT(GPTConfig.tiny().replace(init_std=0.2), rngs=nnx.Rngs(0)),
                             mesh, optimizer=optax.adam(3e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state, _ = step(step.init(), next(batches(0, count=1, rows=2)))
    return step, state


def test_greedy_from_a_sequence_parallel_state_is_the_unsharded_models():
    # tp 2 on the 4 devices: storage chunk t dp + l read on inference position (l, t)
    step, state = _trained_with_sequence_axis()
    stored = jax.tree.leaves(state.params["blocks/layers/w_fc"])[0].sharding.spec
    assert "sequence" in jax.tree.leaves(tuple(stored))          # the case under test
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=2, max_out_tokens=16))
    prompts = prompts_of((1, 3, 5))
    outs = engine.generate(state, prompts, max_new_tokens=NEW)
    for out, ref in zip(outs, greedy_reference(state, prompts, NEW)):
        np.testing.assert_array_equal(out, ref)
    assert len({tuple(o[p.size:]) for o, p in zip(outs, prompts)}) > 1, "degenerate model"
    engine.release()


def test_a_storage_split_over_a_non_data_axis_is_refused_by_name():
    # What the engine cannot read (a parameter split over a tensor axis of the training mesh,
    # read onto a tensor-major inference mesh) is refused naming the parameter and the axes.
    step, _ = _trained_with_sequence_axis()
    devices = jax.devices()[:4]
    layout = tensor_parallel_layout(step.layout.model_def, devices, 2)
    mesh = zeroxla.make_mesh(1, 2, tensor=2, devices=devices)
    stored = {"blocks/layers/w_fc": NamedSharding(mesh, P(None, ("node", "local", "tensor")))}
    with pytest.raises(ValueError, match=r"parameter 'blocks/layers/w_fc' is stored split over "
                                         r"mesh axes \('node', 'local', 'tensor'\)"):
        check_storage(stored, layout)
    check_storage(step.layout.state_shardings.params, layout)     # the sequence axis: data
