"""What the offload tests share (tests/zeroxla/engine/test_offload.py, test_param_offload.py):
gpt-tiny on the 2x4 mesh with its biases and norms replicated and its matrices partitioned, a
single-device SGD reference, and fp16 batches whose second step overflows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zeroxla
from reference import flat_params, token_batches, train_single_device
from runs import run_steps
from zeroxla import models
from zeroxla.engine.step import next_token_loss

STEPS, BATCH, SEQ = 3, 16, 16
THRESHOLD = 500            # biases and norms replicated, matrices partitioned and padded


def sgd():
    return optax.sgd(0.5, momentum=0.9)


@functools.cache
def reference():
    """Single-device optax (SGD with momentum, clipping 1.0) on gpt-tiny: (batches, losses,
    final parameters)."""
    batches = token_batches(STEPS, BATCH, SEQ, vocab=65, seed=3)
    losses, params = train_single_device(models.build("gpt-tiny", seed=1), sgd(), batches,
                                         clip=1.0)
    return batches, losses, params


def poisoned_loss(model, batch):
    """The next-token loss times the mean of `batch["poison"]` (inf: an fp16 overflow)."""
    loss = next_token_loss(model, {"inputs": batch["inputs"], "targets": batch["targets"]})
    return loss * jnp.mean(batch["poison"])


def fp16_batches():
    """Three batches for `poisoned_loss`; the second overflows (on one device only)."""
    batches = []
    for i, batch in enumerate(token_batches(3, BATCH, SEQ, vocab=65, seed=5)):
        poison = np.ones(BATCH, np.float32)
        poison[5] = np.inf if i == 1 else 1.0
        batches.append({**batch, "poison": poison})
    return batches


def memory_kinds(tree):
    """The set of memory kinds `tree`'s arrays live in."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@functools.cache
def fp16_run(stage, offload_optimizer="none", offload_param="none"):
    """gpt-tiny under fp16 at `stage`, AdamW, over `fp16_batches` (pinned host memory when the
    optimizer is offloaded): the step, its final state, each step's (params, opt_state) as numpy
    arrays and each step's metrics."""
    config = zeroxla.ZeroConfig(stage=stage, compute_dtype="float16",
                                persistence_threshold=THRESHOLD, initial_scale_power=10,
                                offload_optimizer=offload_optimizer, offload_param=offload_param,
                                offload_pin_memory=offload_optimizer == "cpu")
    step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(3e-3), config=config, loss_fn=poisoned_loss)
    state, snapshots, metrics = step.init(), [], []
    for batch in fp16_batches():
        state, m = step(state, batch)
        snapshots.append(jax.tree.map(np.asarray, (state.params, state.opt_state)))
        metrics.append(jax.tree.map(float, m))
    return step, state, snapshots, metrics


def assert_same_through_the_overflow(offloaded, not_offloaded):
    """Two `fp16_run`s: the same metrics exactly (losses, norms, scales; nan == nan), the same
    final state bit for bit, and the overflowing second step left the state bit-identical."""
    _, _, snapshots, metrics = offloaded
    _, _, dev_snapshots, dev_metrics = not_offloaded
    assert [m["overflow"] for m in metrics] == [0.0, 1.0, 0.0]
    np.testing.assert_equal(metrics, dev_metrics)
    for a, b in zip(jax.tree.leaves(snapshots[-1]), jax.tree.leaves(dev_snapshots[-1])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(snapshots[0]), jax.tree.leaves(snapshots[1])):
        np.testing.assert_array_equal(a, b)


@functools.cache
def sgd_run(stage, offload_optimizer="none", offload_param="none"):
    """The offloaded step on `reference()`'s batches (accumulation 2, clipping 1.0): the step,
    its final state and losses."""
    batches, _, _ = reference()
    config = zeroxla.ZeroConfig(stage=stage, persistence_threshold=THRESHOLD,
                                gradient_accumulation_steps=2, gradient_clipping=1.0,
                                offload_optimizer=offload_optimizer, offload_param=offload_param)
    step = zeroxla.make_step(models.build("gpt-tiny", seed=1), zeroxla.make_mesh(2, 4),
                             optimizer=sgd(), config=config)
    state, losses = run_steps(step, step.init(), batches)
    return step, state, losses


def assert_trains_like_single_device(state, losses):
    """`sgd_run`'s losses (rtol 1e-5) and parameters (rtol 1e-4, atol 1e-6) are single-device
    optax's, and most parameters moved."""
    _, expected_losses, expected = reference()
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = flat_params(zeroxla.gather_params(state))
    initial = flat_params(nnx.state(models.build("gpt-tiny", seed=1), nnx.Param))
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
    assert sum(np.abs(expected[p] - initial[p]).max() > 1e-3 for p in expected) > len(expected) // 2
