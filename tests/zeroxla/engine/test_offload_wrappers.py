"""optax wrappers under ZeRO-Offload: `optax.MultiSteps` (accumulate k gradients, then apply)
and `optax.apply_if_finite` (skip a step whose gradient is not finite) with the optimizer
offloaded (stages 1-3) or the parameters (stage 3) train as plain single-device optax does.

Their `lax.cond` does not trace under `compute_on("device_host")` on JAX 0.10 nor 0.12 (what a
branch makes there is typed for device memory, what it passes through for host memory), so the
step runs their update on the device between explicit transfers, says so in `describe()` and a
warning naming the wrapper, and the program lowered for a GPU has no host computation. Other
wrappers people chain (clipping, `inject_hyperparams`, `masked`, `multi_transform`) run where
they trace, host or device, and train as on one device too; `optax.lookahead`, which needs its
own parameter structure, is refused by name when the step is built.

The model is a small plain nnx MLP (odd widths: its partitions are padded; its last bias stays
replicated below the persistence threshold) on the 2x4 mesh; the reference is single-device
optax (`reference.train_single_device`) on the same batches.
"""

import functools
import re
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params, train_single_device
from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.engine.optimizer import OptimizerError

THRESHOLD = 20            # every kernel and the hidden biases partitioned; the 10-wide bias not
POISONED = 1              # apply_if_finite's runs: the second batch has an inf input


def mlp():
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(12, 45, rngs=rngs), jax.nn.gelu,
                          nnx.Linear(45, 45, rngs=rngs), jax.nn.gelu,
                          nnx.Linear(45, 10, rngs=rngs))


def classification_loss(model, batch):
    logits = model(batch["x"])                                          # [B, 10]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batches(poisoned=None, num=4):
    """`num` batches of 16; batch `poisoned` has an inf input, so its loss and every gradient
    are NaN on any device."""
    rng = np.random.default_rng(5)
    batches = [{"x": rng.normal(size=(16, 12)).astype(np.float32),
                "y": rng.integers(0, 10, 16).astype(np.int32)} for _ in range(num)]
    if poisoned is not None:
        batches[poisoned]["x"][3, 0] = np.inf
    return batches


WRAPPERS = {
    "multisteps": (lambda: optax.MultiSteps(optax.adamw(3e-3), every_k_schedule=2),
                   "optax.MultiSteps", None),
    "apply_if_finite": (lambda: optax.apply_if_finite(optax.adamw(3e-3),
                                                      max_consecutive_errors=2),
                        "optax.apply_if_finite", POISONED),
}
OFFLOADS = {
    "optimizer-1": dict(stage=1, offload_optimizer="cpu"),
    "optimizer-2": dict(stage=2, offload_optimizer="cpu"),
    "optimizer-3": dict(stage=3, offload_optimizer="cpu"),
    "param-3": dict(stage=3, offload_param="cpu"),
    "both-3": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
}
DAILY = {("multisteps", "param-3"), ("apply_if_finite", "optimizer-2")}   # the rest: slow


@functools.cache
def _reference(name):
    factory, _, poisoned = WRAPPERS[name]
    return train_single_device(mlp(), factory(), _batches(poisoned),
                               loss_fn=classification_loss)


def _make_step(optimizer, offload):
    return zeroxla.make_step(mlp(), zeroxla.make_mesh(2, 4), optimizer=optimizer,
                             loss_fn=classification_loss,
                             config=zeroxla.ZeroConfig(persistence_threshold=THRESHOLD,
                                                       **OFFLOADS[offload]))


def _train(step, batches):
    """`step` over `batches`: its final state, the losses and the parameters after each step."""
    state, losses, params = step.init(), [], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        params.append(flat_params(zeroxla.gather_params(state)))
    return state, losses, params


def _assert_like_reference(losses, got, expected_losses, expected):
    """Losses (rtol 1e-5; NaN where the reference's is NaN) and parameters (rtol 1e-4, atol
    1e-6: the offload tests' tolerance) as the reference's, and every parameter moved."""
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    initial = flat_params(nnx.state(mlp(), nnx.Param))
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert np.abs(expected[path] - initial[path]).max() > 1e-3, path


@pytest.mark.parametrize("name,offload", [
    pytest.param(name, o, id=f"{name}-{o}", marks=() if (name, o) in DAILY else pytest.mark.slow)
    for name in WRAPPERS for o in OFFLOADS])
def test_wrapper_under_offload_trains_like_single_device(name, offload):
    """Each wrapper under each offload option: the update runs on the device (named, with
    JAX's reason), the offloaded state stays in host memory between steps, and the run equals
    single-device optax. apply_if_finite's second batch is not finite: that step is skipped
    exactly as optax skips it (NaN loss, parameters bit-identical to the step before, one
    rejected step counted), and the steps after it train as the reference's."""
    factory, wrapper, poisoned = WRAPPERS[name]
    with pytest.warns(UserWarning, match=rf"runs on the device with explicit transfers, not on "
                                         rf"the host: {wrapper} does not trace under "
                                         r"compute_on\('device_host'\).*cond branches"):
        step = _make_step(factory(), offload)
    assert not step.update_placement.on_host
    assert f"update runs on device (explicit host<->device transfers around the update: " \
           f"{wrapper} does not trace" in step.describe()
    state, losses, params = _train(step, _batches(poisoned))
    expected_losses, expected = _reference(name)
    _assert_like_reference(losses, params[-1], expected_losses, expected)
    opt_kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    assert opt_kinds == ({"unpinned_host"} if "offload_optimizer" in OFFLOADS[offload]
                         else {"device"})
    partitioned = [state.params[leaf.path] for leaf in state.plan.leaves
                   if leaf.params_partitioned]
    assert bool(partitioned) == (OFFLOADS[offload]["stage"] == 3)
    if "offload_param" in OFFLOADS[offload]:
        assert {x.sharding.memory_kind for x in partitioned} == {"pinned_host"}
    if poisoned is not None:
        assert np.isnan(losses).tolist() == [i == poisoned for i in range(len(losses))]
        for path, value in params[poisoned - 1].items():
            np.testing.assert_array_equal(params[poisoned][path], value, err_msg=path)
        assert (int(state.opt_state.notfinite_count), int(state.opt_state.total_notfinite)) == (
            0, 1)


# name -> (factory, where its update runs under offload_param: the failing transformation, or
# None for the host)
OTHERS = {
    "clip_chain": (lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3)),
                   "optax.clip_by_global_norm"),
    "inject_hyperparams": (lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 4)), None),
    "masked": (lambda: optax.chain(optax.masked(optax.add_decayed_weights(0.1),
                                                lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                                   optax.adam(3e-3)), None),
    "multi_transform": (lambda: optax.multi_transform(
        {"adam": optax.adam(3e-3), "sgd": optax.sgd(0.1)},
        lambda p: jax.tree.map(lambda x: "adam" if x.ndim > 1 else "sgd", p)), None),
    "multisteps_of_clip": (lambda: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.5),
                                                                optax.adamw(3e-3)),
                                                    every_k_schedule=2),
                           "optax.clip_by_global_norm"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHERS))
def test_other_wrappers_under_parameter_offload_train_like_single_device(name):
    """Wrappers and combinators people chain, under offload_param: where they trace on the
    host the update runs there, else on the device, named by the innermost transformation
    that does not trace (MultiSteps of a clipping chain: the clipping, inside the skip
    branch's shape evaluation); either way as single-device optax."""
    factory, refused_by = OTHERS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = _make_step(factory(), "param-3")
    placement = step.update_placement
    assert placement.on_host == (refused_by is None)
    assert placement.refused_by.startswith(refused_by or "")
    assert any(refused_by in str(w.message) for w in caught) == (refused_by is not None)
    _, losses, params = _train(step, _batches())
    expected_losses, expected = train_single_device(mlp(), factory(), _batches(),
                                                    loss_fn=classification_loss)
    _assert_like_reference(losses, params[-1], expected_losses, expected)


def _placements(text):
    """(memory kind, shape) of every `annotate_device_placement` (a `jax.device_put` between
    memory kinds, or a result's memory kind) in a lowered StableHLO module."""
    found = re.findall(r'annotate_device_placement.*?_xla_buffer_placement = "(\w+)".*?'
                       r': \(tensor<([0-9x]*?)x?[a-z]+\d*>', text)
    return {(kind, tuple(int(d) for d in dims.split("x") if d)) for kind, dims in found}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_the_gpu_program_updates_on_the_device_between_transfers(name):
    """Lowered for a GPU (lowering only: XLA:CPU ignores memory kinds), the step with the
    wrapper under optimizer and parameter offload has no host computation; each partitioned
    leaf's padded partitions come to the device for the update (`offload.resident`), and go
    back after it: the parameter to pinned host memory, its optimizer moments to unpinned
    (`offload.offloaded`). The abstract state is enough: nothing runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = _make_step(WRAPPERS[name][0](), "both-3")
    state = jax.eval_shape(step.init)
    text = lower_for_cuda(step, state, _batches()[0]).as_text()
    assert "_xla_compute_type" not in text
    placements = _placements(text)
    partitioned = [leaf for leaf in step.layout.plan.leaves if leaf.params_partitioned]
    assert partitioned
    for leaf in partitioned:
        for kind in ("device", "pinned_host", "unpinned_host"):
            assert (kind, leaf.param_shape) in placements, (leaf.path, kind)


def test_lookahead_is_refused_by_name_before_compile():
    """optax.lookahead updates `LookaheadParams(fast, slow)`, not the model's parameters: the
    step is refused when it is built (nothing compiled), naming the transformation and why,
    with or without offload."""
    for offload in ({}, {"offload_param": "cpu"}):
        with pytest.raises(OptimizerError, match=r"optax\.lookahead in it\) cannot run in a ZeRO "
                                                 r"step: .*LookaheadParams\(fast, slow\)"):
            zeroxla.make_step(mlp(), zeroxla.make_mesh(2, 4),
                              optimizer=optax.lookahead(optax.adam(3e-3), sync_period=2,
                                                        slow_step_size=0.5),
                              loss_fn=classification_loss,
                              config=zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD,
                                                        **offload))
