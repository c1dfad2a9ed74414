"""Any Flax NNX model trains under ZeRO-3, gathered per submodule call: an MLP and a CNN."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params, train_single_device
from zeroxla.analysis.comm_report import comm_report


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 16, kernel_size=(3, 3), strides=(2, 2), rngs=rngs)
        self.head = nnx.Linear(16 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):                                   # [B, 8, 8, 3]
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))                       # [B, 4, 4, 16]
        return self.head(x.reshape(x.shape[0], -1))          # [B, 10]


def mlp(rngs):
    return nnx.Sequential(nnx.Linear(12, 96, rngs=rngs), jax.nn.gelu,
                          nnx.Linear(96, 96, rngs=rngs), jax.nn.gelu,
                          nnx.Linear(96, 10, rngs=rngs))


def classification_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batches(shape, num=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(16, *shape)).astype(np.float32),
             "y": rng.integers(0, 10, 16).astype(np.int32)} for _ in range(num)]


@pytest.mark.parametrize("make_model,shape", [(mlp, (12,)), (CNN, (8, 8, 3))],
                         ids=["mlp", "cnn"])
def test_generic_module_matches_single_device(make_model, shape):
    batches = _batches(shape)
    optimizer = optax.sgd(0.3)
    _, expected = train_single_device(make_model(nnx.Rngs(0)), optimizer, batches,
                                      loss_fn=classification_loss)
    step = zeroxla.make_step(make_model(nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optimizer, loss_fn=classification_loss,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=20))
    assert any(leaf.params_partitioned for leaf in step.layout.plan.leaves)
    state = step.init()
    report = comm_report(step, state, batches[0])
    for batch in batches:
        state, _ = step(state, batch)
    got = flat_params(zeroxla.gather_params(state))
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
    # Every partitioned leaf is gathered around its own submodule's call.
    partitioned = sum(4 * leaf.padded_numel for leaf in step.layout.plan.leaves
                      if leaf.params_partitioned)
    assert report.all_gather_bytes("zero_fwd_gather") == pytest.approx(partitioned, rel=0.01)
    assert report.reduce_scatter_bytes() == pytest.approx(partitioned, rel=0.01)


def test_wrapped_model_is_a_copy():
    """The user's model is never modified by the engine."""
    model = mlp(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), loss_fn=classification_loss,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=20))
    state = step.init()
    step(state, _batches((12,), num=1)[0])
    assert type(model.layers[0]) is nnx.Linear
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_factory_builds_state_sharded():
    """With a factory, init creates the parameters inside the sharded computation."""
    step = zeroxla.make_step(lambda: mlp(nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             loss_fn=classification_loss,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=20))
    state = step.init()
    reference = flat_params(nnx.state(mlp(nnx.Rngs(0)), nnx.Param))
    got = flat_params(zeroxla.gather_params(state))
    for path, value in reference.items():
        np.testing.assert_array_equal(got[path], value)
    big = state.params["layers/2/kernel"]
    # [96, 96] split along its first dim over the 8 data devices: 12 rows each
    assert big.sharding.spec == jax.sharding.PartitionSpec(("node", "local"), None)
    assert {s.data.shape for s in big.addressable_shards} == {(96 // 8, 96)}
