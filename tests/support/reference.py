"""The independent reference: plain single-device optax training of the same model.

No zeroxla code is used here: the model is the user's nnx module, the loss is written out, and
gradient clipping follows DeepSpeed's `clip_grad_norm_` (coef = max_norm / (norm + 1e-6)).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def cross_entropy(model, batch):
    logits = model(batch["inputs"])
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))   # float64 stays float64
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


def train_single_device(model, optimizer, batches, *, clip=0.0, loss_fn=cross_entropy):
    """Trains on device 0; returns (losses, final params as {path: np.ndarray})."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)   # rest: e.g. unused RNG streams
    rest_leaves, rest_def = jax.tree.flatten(rest)
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    # On the device: a host-side step counter would make the second call compile again.
    opt_state = jax.device_put(optimizer.init(params), device)

    def model_of(p):
        return nnx.merge(graphdef, p, jax.tree.unflatten(rest_def, rest_leaves))

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model_of(p), batch))(params)
        if clip > 0:
            norm = optax.tree.norm(grads)
            coef = jnp.minimum(clip / (norm + 1e-6), 1.0)
            grads = jax.tree.map(lambda g: g * coef, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, flat_params(params)


def masked_optimizer(optimizer, trained):
    """`optimizer` on the parameters whose `flat_params` path is in `trained`, zero updates on
    the rest (`optax.multi_transform` with `set_to_zero`): frozen parameters, in plain optax."""
    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda keys, _: "train" if "/".join(
                str(k.key) for k in keys if isinstance(k, jax.tree_util.DictKey)) in trained
            else "frozen", params)

    return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


def flat_params(state):
    """An nnx.State of parameters as {"path/to/leaf": host numpy array}."""
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def token_batches(num, batch_size, seq_len, vocab, seed=0):
    """Random inputs whose targets are a fixed function of them (inputs + 1), so loss can fall."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num):
        inputs = rng.integers(0, vocab, (batch_size, seq_len)).astype(np.int32)
        batches.append({"inputs": inputs, "targets": (inputs + 1) % vocab})
    return batches


def distance_over_travelled(got, expected, initial):
    """How far `got`'s parameters are from the reference run's `expected`, as a fraction of how
    far the reference travelled from `initial` (flat dicts of arrays, same keys): the measure
    for a lower-precision run (bf16) tracking a float32 reference, where elementwise tolerances
    are meaningless for entries the training barely moved."""
    assert got.keys() == expected.keys() == initial.keys()
    travelled = np.sqrt(sum(np.sum((expected[p] - initial[p]) ** 2) for p in expected))
    distance = np.sqrt(sum(np.sum((got[p] - expected[p]) ** 2) for p in expected))
    return distance / travelled
