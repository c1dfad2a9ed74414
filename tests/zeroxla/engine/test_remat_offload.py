"""remat "offload" (`zeroxla.engine.remat`): the same recompute as "full", the kept inputs in
host memory, so the same losses and parameters; refused by name without host memory."""

import types

import jax
import numpy as np
import optax
import pytest

import zeroxla
from reference import token_batches
from zeroxla import models
from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.engine.remat import check_offload_platform
from test_param_offload import _typed_placements


@pytest.mark.slow
def test_offload_trains_like_full():
    if "pinned_host" not in [m.kind for m in jax.devices()[0].addressable_memories()]:
        with pytest.raises(ValueError, match="ZeroConfig.remat='offload'"):
            check_offload_platform()
        return
    batches = token_batches(2, 16, 16, vocab=65)
    runs = {}
    for remat in ("full", "offload"):
        step = zeroxla.make_step(models.build("llama-tiny", seed=1), zeroxla.make_mesh(2, 4),
                                 optimizer=optax.sgd(0.5),
                                 config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500,
                                                           remat=remat))
        state, losses = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[remat] = (losses, jax.tree.leaves(zeroxla.gather_params(state)))
    np.testing.assert_allclose(runs["offload"][0], runs["full"][0], rtol=1e-6)
    for a, b in zip(runs["offload"][1], runs["full"][1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_device_without_host_memory_is_refused_by_name():
    device = types.SimpleNamespace(platform="fake", id=3, addressable_memories=lambda: [
        types.SimpleNamespace(kind="device")])
    with pytest.raises(ValueError, match=r"ZeroConfig.remat='offload' needs the 'pinned_host'.*"
                                         r"fake device 3.*accepted here: 'full'"):
        check_offload_platform([device])


def test_the_gpu_program_keeps_layer_inputs_in_host_memory():
    """On the CUDA lowering (XLA:CPU ignores memory kinds), remat "offload" moves each kept
    layer input [B / devices, T, D] to `pinned_host` after forward and back to the device for
    backward, and moves nothing else; "full" moves nothing to the host."""
    batch = token_batches(1, 16, 16, vocab=65)[0]
    placed = {}
    for remat in ("full", "offload"):
        step = zeroxla.make_step(models.build("llama-tiny", seed=1, num_layers=4),
                                 zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.5),
                                 config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500,
                                                           remat=remat))
        text = lower_for_cuda(step, step.init(), batch).as_text()
        placed[remat] = _typed_placements(text)
    carry = ("pinned_host", (16 // 8, 16, 60), "f32")          # local rows, T, d_model
    assert [p for p in placed["full"] if p[0] == "pinned_host"] == []
    to_host = [p for p in placed["offload"] if p[0] == "pinned_host"]
    assert to_host and set(to_host) == {carry}
    assert placed["offload"].count(("device",) + carry[1:]) == len(to_host)    # and back
