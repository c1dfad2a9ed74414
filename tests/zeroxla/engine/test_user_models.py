"""Bring your own model: ordinary Flax NNX patterns train under ZeRO-3 exactly as on one device.

Every model here is written the way a Flax user writes one, not for zeroxla: blocks in a plain
list, a tuple, a dict or `nnx.List`, activations passed by keyword, weights tied by a shared
`nnx.Embed` or a shared `nnx.Param`, a parameter owned by the root module, BatchNorm, Dropout
with RNG streams held in the model or passed at call time. On 8 devices (2 nodes x 4) at stage 3
with the persistence threshold at 0 (every parameter partitioned), each is compared with plain
single-device training (`reference.train_single_device`, or the BatchNorm reference below) from
the same initial parameters on the same batches: losses rtol 1e-5, SGD parameters rtol 1e-4 +
atol 1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params, token_batches, train_single_device
from zeroxla.checkpoint import manager as checkpoint

V, D = 32, 16                   # vocabulary, width
CONFIG = zeroxla.ZeroConfig(stage=3, persistence_threshold=0)


# ------------------------------------------------------------------------------------------------
# Models, as users write them.
class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x, *, scale=1.0):                   # x: [B, T, d]
        h = self.up(inputs=self.norm(x))                   # activations passed by keyword
        return x + scale * self.down(inputs=jax.nn.gelu(h))


CONTAINERS = {"nnx.List": nnx.List, "list": nnx.data,
              "tuple": lambda blocks: nnx.data(tuple(blocks)),
              "dict": lambda blocks: nnx.data({f"b{i}": b for i, b in enumerate(blocks)})}


class ContainerLM(nnx.Module):
    """Blocks held in a Python container, called with keyword activations."""

    def __init__(self, container, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = CONTAINERS[container]([Block(D, rngs) for _ in range(3)])
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        blocks = self.blocks.values() if isinstance(self.blocks, dict) else self.blocks
        for block in blocks:
            x = block(x=x, scale=0.5)
        return self.out(x)


class EmbedTiedLM(nnx.Module):
    """Input and output embeddings tied by one shared `nnx.Embed` (a submodule used twice)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block = Block(D, rngs)
        self.unembed = self.embed

    def __call__(self, tokens):
        return self.unembed.attend(self.block(self.embed(tokens)))


class Head(nnx.Module):
    def __init__(self, weight):
        self.weight = weight

    def __call__(self, x):
        return x @ self.weight[...].T


class ParamTiedLM(nnx.Module):
    """Tied by one `nnx.Param` object held by the root and by the head."""

    def __init__(self, rngs):
        self.wte = nnx.Param(jax.random.normal(rngs.params(), (V, D)) * 0.5)
        self.block = Block(D, rngs)
        self.head = Head(self.wte)

    def __call__(self, tokens):
        return self.head(self.block(self.wte[...][tokens]))


class PositionTable(nnx.Module):
    def __init__(self, seq, d, rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.1)

    def __call__(self, x):
        return x + self.table[...][: x.shape[1]]


class RootParamLM(nnx.Module):
    """A positional table owned by the root module itself (`where="root"`), or the same table
    in a submodule (`where="child"`), or none."""

    def __init__(self, rngs, where="root", seq=32, d=D, layers=3):
        self.where = where
        if where == "root":
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.1)
        elif where == "child":
            self.pos = PositionTable(seq, d, rngs)
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.where == "root":
            x = x + self.pos[...][: tokens.shape[1]]
        elif self.where == "child":
            x = self.pos(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


LANGUAGE_MODELS = {
    **{f"blocks in {name}": (lambda name=name: ContainerLM(name, nnx.Rngs(0)))
       for name in CONTAINERS},
    "tied by a shared nnx.Embed": lambda: EmbedTiedLM(nnx.Rngs(0)),
    "tied by a shared nnx.Param": lambda: ParamTiedLM(nnx.Rngs(0)),
    "root-owned parameter": lambda: RootParamLM(nnx.Rngs(0)),
}


def _train(step, batches, seed=0):
    state, losses = step.init(seed=seed), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def _assert_params_close(got, expected):
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)


# Daily: one container, one way of tying, the root-owned parameter; the rest in the full suite.
DAILY_MODELS = {"blocks in nnx.List", "tied by a shared nnx.Param", "root-owned parameter"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in DAILY_MODELS else pytest.mark.slow)
    for name in LANGUAGE_MODELS])
def test_language_model_matches_single_device(name):
    batches = token_batches(3, 16, 8, vocab=V, seed=1)
    expected_losses, expected = train_single_device(LANGUAGE_MODELS[name](), optax.sgd(0.5),
                                                    batches)
    step = zeroxla.make_step(LANGUAGE_MODELS[name](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.5), config=CONFIG)
    state, losses = _train(step, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _assert_params_close(flat_params(zeroxla.gather_params(state)), expected)
    initial = flat_params(nnx.state(LANGUAGE_MODELS[name](), nnx.Param))
    assert all(np.abs(expected[p] - initial[p]).max() > 1e-5 for p in expected
               if not p.endswith("bias"))            # every weight trained


def test_model_committed_to_one_device_trains_as_on_one_device():
    """A model whose arrays are committed to one device (what `gathered_model` and
    `load_params` return) builds a step on the whole mesh and trains as on one device."""
    name = next(iter(LANGUAGE_MODELS))
    batches = token_batches(2, 16, 8, vocab=V, seed=2)
    expected_losses, expected = train_single_device(LANGUAGE_MODELS[name](), optax.sgd(0.5),
                                                    batches)
    model = LANGUAGE_MODELS[name]()
    graphdef, values = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_put(values, jax.devices()[3]))
    assert all(x.committed for x in jax.tree.leaves(nnx.state(model)))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.5),
                             config=CONFIG)
    state, losses = _train(step, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _assert_params_close(flat_params(zeroxla.gather_params(state)), expected)


TIED = ["tied by a shared nnx.Embed", "tied by a shared nnx.Param"]


@pytest.mark.parametrize("accumulation", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("name", TIED)
def test_tied_weight_at_stage_2_matches_single_device(name, accumulation):
    """ZeRO-2 reduce-scatters a weight used by two calls (the shared `nnx.Embed`, called as
    `embed` and `attend`; the shared `nnx.Param`, read by the root and the head) once, after
    autodiff has summed both uses; the model trains as on one device, with micro-batches too."""
    batches = token_batches(3, 16, 8, vocab=V, seed=1)
    expected_losses, expected = train_single_device(LANGUAGE_MODELS[name](), optax.sgd(0.5),
                                                    batches)
    step = zeroxla.make_step(LANGUAGE_MODELS[name](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.5),
                             config=CONFIG.replace(stage=2,
                                                   gradient_accumulation_steps=accumulation))
    state, losses = _train(step, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _assert_params_close(flat_params(zeroxla.gather_params(state)), expected)


@pytest.mark.parametrize("name", [pytest.param(TIED[0], marks=pytest.mark.slow), TIED[1]])
def test_tied_weight_is_reduce_scattered_once_at_stage_2(name):
    """Under bf16 the gradient reduce-scatter is a 16-bit all-to-all (XLA:CPU's wire format),
    which XLA cannot merge: its bytes are every partitioned gradient's, the tied one once."""
    from zeroxla.analysis.comm_report import comm_report

    step = zeroxla.make_step(LANGUAGE_MODELS[name](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.5),
                             config=CONFIG.replace(stage=2, compute_dtype="bfloat16"))
    report = comm_report(step, step.init(), token_batches(1, 16, 8, vocab=V)[0])
    scattered = [leaf for leaf in step.layout.plan.trainable_leaves if leaf.optimizer_partitioned]
    assert len(scattered) == len(step.layout.plan.trainable_leaves)       # threshold 0: all of them
    assert report.all_to_all_bytes() == sum(2 * leaf.layers * leaf.padded_numel
                                            for leaf in scattered)


@pytest.mark.parametrize("name, alias, canonical", [
    ("tied by a shared nnx.Embed", "unembed/embedding", "embed/embedding"),
    ("tied by a shared nnx.Param", "wte", "head/weight")])
def test_shared_weight_is_one_parameter(name, alias, canonical):
    """One partition and one optimizer state; `describe()` names the alias."""
    step = zeroxla.make_step(LANGUAGE_MODELS[name](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adam(1e-3), config=CONFIG)
    assert canonical in step.layout.plan.paths and alias not in step.layout.plan.paths
    assert f"  {alias} -> {canonical}" in step.layout.plan.describe().splitlines()
    names = step.layout.logical.names        # what checkpoints store
    assert sum(n.endswith("/" + canonical) for n in names) == 3    # parameter, Adam's mu and nu
    assert not any(n.endswith("/" + alias) for n in names)


def _temporaries(model):
    batch = token_batches(1, 64, 32, vocab=V)[0]
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             config=CONFIG)
    return step, step.compile(step.init(), batch).memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_root_owned_parameter_is_gathered_alone():
    """A parameter owned by the root is gathered by itself, not with the whole model (which
    made temporaries grow with the depth): the step's temporaries are no larger than those of
    the same model with the table held in a submodule."""
    d, seq = 128, 32
    root_step, root = _temporaries(RootParamLM(nnx.Rngs(0), "root", seq, d, layers=8))
    _, child = _temporaries(RootParamLM(nnx.Rngs(0), "child", seq, d, layers=8))
    assert root <= child
    assert root_step.layout.plan["pos"].compute_kind() == "gathered alone once per step"


# ------------------------------------------------------------------------------------------------
# BatchNorm: model state, cross-replica statistics.
class BatchNormCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):                                 # [B, 8, 8, 3]
        x = jax.nn.relu(self.bn1(self.conv1(x)))
        x = jax.nn.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(axis=(1, 2)))


def classification_loss(model, batch):
    logits = model(batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _image_batches(num=3, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"images": rng.normal(size=(batch, 8, 8, 3)).astype(np.float32) + 0.5,
             "labels": rng.integers(0, 10, batch).astype(np.int32)} for _ in range(num)]


def _batch_norm_reference(batches, lr):
    """Single-device training on each whole global batch, and the final evaluation loss."""
    graphdef, params, stats = nnx.split(BatchNormCNN(nnx.Rngs(0)), nnx.Param, ...)
    optimizer = optax.sgd(lr)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, stats, opt_state, batch):
        leaves, treedef = jax.tree.flatten(stats)

        def loss(p):
            model = nnx.merge(graphdef, p, jax.tree.unflatten(treedef, leaves))
            return classification_loss(model, batch), nnx.state(model, nnx.Not(nnx.Param))
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value

    losses = []
    for batch in batches:
        params, stats, opt_state, value = step(params, stats, opt_state, batch)
        losses.append(float(value))
    model = nnx.merge(graphdef, params, stats)
    model.eval()
    return losses, flat_params(params), flat_params(stats), float(
        nnx.jit(classification_loss)(model, batches[0]))          # one program, not op by op


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_batch_norm_matches_single_device_on_the_global_batch(stage, tmp_path):
    batches = _image_batches()
    expected_losses, expected, expected_stats, expected_eval = _batch_norm_reference(batches, 0.1)
    step = zeroxla.make_step(BatchNormCNN(nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1), loss_fn=classification_loss,
                             config=CONFIG.replace(stage=stage))
    state, losses = _train(step, batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _assert_params_close(flat_params(zeroxla.gather_params(state)), expected)
    assert state.model_state.keys() == expected_stats.keys() == {
        "bn1/mean", "bn1/var", "bn2/mean", "bn2/var"}
    for path, value in expected_stats.items():
        np.testing.assert_allclose(np.asarray(state.model_state[path]), value, rtol=1e-5,
                                   atol=1e-6, err_msg=path)
    # use_running_average=True for evaluation: eval_loss runs the model in eval mode.
    np.testing.assert_allclose(float(step.eval_loss(state, batches[0])), expected_eval,
                               rtol=1e-5)
    # The statistics are checkpointed and restored.
    checkpoint.save(tmp_path, state, layout=step.layout)
    restored = checkpoint.restore(tmp_path, step).state
    for path in expected_stats:
        np.testing.assert_array_equal(np.asarray(restored.model_state[path]),
                                      np.asarray(state.model_state[path]))


def test_batch_norm_naming_its_own_axis_is_refused():
    class Named(BatchNormCNN):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.bn1 = nnx.BatchNorm(8, axis_name="batch", rngs=rngs)

    step = zeroxla.make_step(Named(nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             loss_fn=classification_loss, config=CONFIG)
    with pytest.raises(ValueError, match=r"BatchNorm at bn1 has axis_name='batch'"):
        step(step.init(), _image_batches(1)[0])


# ------------------------------------------------------------------------------------------------
# Dropout: one seed, a stream per step, device and micro-batch.
class HeldRngsBlock(nnx.Module):
    """Owns a partitioned weight directly and a Dropout holding its own RNG stream."""

    def __init__(self, rate, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.3)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(x @ self.w[...])


class CallRngsBlock(nnx.Module):
    """Owns a partitioned weight directly; the Rngs come with each call."""

    def __init__(self, rate, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.3)
        self.drop = nnx.Dropout(rate)

    def __call__(self, x, rngs=None):
        return x + self.drop(x @ self.w[...], rngs=rngs)


class DropoutLM(nnx.Module):
    def __init__(self, rate, held, rngs):
        self.held = held
        self.embed = nnx.Embed(V, D, rngs=rngs)
        block = HeldRngsBlock if held else CallRngsBlock
        self.blocks = nnx.List([block(rate, rngs) for _ in range(2)])
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens, rngs=None):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x) if self.held else b(x, rngs=rngs)
        return self.out(x)


def _token_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def loss_with_rngs(model, batch, rngs):
    """A loss that takes `rngs`: the step passes this device's and micro-batch's stream."""
    return _token_loss(model(batch["inputs"], rngs=rngs), batch)


def _dropout_run(held, rate, seed, accumulation=1):
    kwargs = {} if held else {"loss_fn": loss_with_rngs}
    step = zeroxla.make_step(DropoutLM(rate, held, nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.5),
                             config=CONFIG.replace(gradient_accumulation_steps=accumulation),
                             **kwargs)
    return _train(step, token_batches(3, 16, 8, vocab=V, seed=1), seed=seed)


@pytest.mark.parametrize("held", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["rngs held by the model", "rngs at call"])
def test_dropout_is_reproducible_from_the_seed(held):
    _, first = _dropout_run(held, 0.3, seed=0)
    _, again = _dropout_run(held, 0.3, seed=0)
    _, other = _dropout_run(held, 0.3, seed=1)
    _, off = _dropout_run(held, 0.0, seed=0)
    assert first == again
    assert all(abs(a - b) > 1e-4 for a, b in zip(first[1:], other[1:]))
    assert all(abs(a - b) > 1e-4 for a, b in zip(first, off))


@pytest.mark.parametrize("held", [True, False], ids=["rngs held by the model", "rngs at call"])
def test_dropout_rate_zero_equals_single_device(held):
    batches = token_batches(3, 16, 8, vocab=V, seed=1)
    loss = (lambda m, b: _token_loss(m(b["inputs"]), b))
    expected_losses, expected = train_single_device(DropoutLM(0.0, held, nnx.Rngs(0)),
                                                    optax.sgd(0.5), batches, loss_fn=loss)
    state, losses = _dropout_run(held, 0.0, seed=0)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _assert_params_close(flat_params(zeroxla.gather_params(state)), expected)


class MaskProbe(nnx.Module):
    """loss = mean over examples of dropout(ones[F]) . w: d loss / d w is the mean of the
    examples' masks (times 1 / keep), so one SGD step from w = 0 with lr 1 writes
    -mean(masks) / keep into w. With one example per device, element j of 8 * keep * (-w) is
    the number of devices whose mask kept element j."""

    def __init__(self, features, rate, rngs):
        self.w = nnx.Param(jnp.zeros((features,)))
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):                                  # x: [B, 1]
        return self.drop(jnp.ones((x.shape[0], self.w.shape[0]))) @ self.w[...]


@pytest.mark.parametrize("accumulation", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_dropout_masks_differ_across_devices_and_micro_batches(accumulation):
    rate, features = 0.5, 512
    pieces = 8 * accumulation                              # one example per device and micro-batch
    step = zeroxla.make_step(MaskProbe(features, rate, nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(1.0), loss_fn=lambda m, b: m(b["x"]).mean(),
                             config=CONFIG.replace(gradient_accumulation_steps=accumulation))
    state, _ = step(step.init(seed=0), {"x": np.zeros((pieces, 1), np.float32)})
    w = np.asarray(zeroxla.gather_params(state)["w"][...])
    kept = -w * pieces * (1 - rate)                         # pieces keeping each element
    np.testing.assert_allclose(kept, np.rint(kept), atol=1e-4)
    counts = np.bincount(np.rint(kept).astype(int), minlength=pieces + 1)
    # Identical masks on every piece would give counts only at 0 and `pieces`. Independent
    # masks give Binomial(pieces, 1/2) counts: most elements are kept by some pieces, not all.
    assert counts[1:pieces].sum() > 0.9 * features
    mean = (np.arange(pieces + 1) * counts).sum() / features
    assert abs(mean - pieces * (1 - rate)) < 0.25


# ------------------------------------------------------------------------------------------------
# Bad input is named.
def test_token_ids_outside_the_vocabulary_are_named():
    step = zeroxla.make_step(ContainerLM("list", nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             config=CONFIG)
    state = step.init()
    batch = token_batches(1, 16, 8, vocab=V)[0]
    batch["targets"] = batch["targets"].copy()
    batch["targets"][0, 0] = V
    with pytest.raises(ValueError, match=rf"batch\['targets'\] has token ids in \[0, {V}\]; "
                                         rf"accepted: \[0, {V}\)"):
        step(state, batch)


@pytest.mark.parametrize("field, value", [("stage", True), ("persistence_threshold", "0"),
                                          ("prefetch", 1), ("compute_dtype", jnp.float32)])
def test_config_types_are_named(field, value):
    with pytest.raises(ValueError, match=rf"ZeroConfig.{field}="):
        zeroxla.ZeroConfig(**{field: value})
