"""Mesh axis roles: ZeRO runs over the data axes ("node", "local") whatever else the mesh has.

A mesh with a pipeline `stage` axis or a `tensor` axis (both unused by the step for now) trains
exactly like single-device optax: the extra axes hold identical replicas.
"""

import numpy as np
import optax
import pytest

import zeroxla
from reference import flat_params, token_batches, train_single_device
from zeroxla import models

MESHES = {
    "stages2_local4": dict(stages=2, nodes=1, local=4),
    "tensor2_nodes2_local2": dict(tensor=2, nodes=2, local=2),
}


# Daily: the tensor-axis mesh at stage 3; the rest in the full suite.
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("mesh_name", [
    pytest.param(name, marks=pytest.mark.slow) if name == "stages2_local4" else name
    for name in MESHES])
def test_zero_over_the_data_axes_matches_single_device(mesh_name, stage):
    batches = token_batches(3, 16, 16, vocab=65, seed=5)
    expected_losses, expected = train_single_device(models.build("gpt-tiny", seed=2),
                                                    optax.sgd(0.5, momentum=0.9), batches)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=2),
                             zeroxla.make_mesh(**MESHES[mesh_name]),
                             optimizer=optax.sgd(0.5, momentum=0.9),
                             config=zeroxla.ZeroConfig(stage=stage, persistence_threshold=500))
    state = step.init()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = flat_params(zeroxla.gather_params(state))
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
    # The extra axis holds identical replicas: every device's shard of a partitioned leaf
    # equals the one at the same data position.
    leaf = state.params["blocks/layers/w_fc"]
    by_index = {}
    for shard in leaf.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        by_index.setdefault(key, []).append(np.asarray(shard.data))
    assert len(by_index) == (4 if stage == 3 else 1)
    for copies in by_index.values():
        assert len(copies) == 2 * (1 if stage == 3 else 4)
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
