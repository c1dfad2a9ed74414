"""Stages 1-2 under bf16/fp16: a float32 master partition plus a replicated 16-bit compute copy
(`zeroxla.engine.plan.MasterWithCopy`), DeepSpeed's bf16/fp16 optimizer layout."""

import jax
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import checkpoint, models
from zeroxla.engine.leaf_plan import MasterWithCopy
from reference import token_batches

BATCHES = token_batches(2, 16, 16, vocab=65)


def _run(stage, dtype="bfloat16"):
    step = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adam(3e-3),
                             config=zeroxla.ZeroConfig(stage=stage, compute_dtype=dtype))
    state = step.init()
    for batch in BATCHES:
        state, _ = step(state, batch)
    return step, state


def test_stage1_master_follows_the_stage0_float32_master():
    """Stage 0 keeps replicated float32 parameters (no copy); stage 1 the float32 partition and
    a bf16 copy. Same bf16 forward/backward and bf16 all-reduce, elementwise Adam: the masters
    agree, and each copy is its master rounded to bf16."""
    _, ref = _run(0)
    step, state = _run(1)
    copies = [leaf for leaf in step.plan.leaves if leaf.has_compute_copy]
    assert copies
    for leaf in step.plan.leaves:
        stored = state.params[leaf.path]
        master = np.asarray(leaf.storage_to_logical(stored))
        assert master.dtype == np.float32
        np.testing.assert_allclose(master, np.asarray(ref.params[leaf.path]), rtol=1e-6,
                                   atol=1e-7)
        if leaf.has_compute_copy:
            assert isinstance(stored, MasterWithCopy)
            np.testing.assert_array_equal(np.asarray(stored.compute),
                                          master.astype(stored.compute.dtype))
    # Not rounded through bf16: most master elements are not bf16 values.
    leaf = copies[0]
    master = np.asarray(leaf.storage_to_logical(state.params[leaf.path]))
    rounded = master.astype(jax.numpy.bfloat16).astype(np.float32)
    assert np.mean(master != rounded) > 0.5


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_keeps_the_float32_master(stage, tmp_path):
    """Saved and restored (same step, and into a float32 stage-3 step): the float32 master
    values come back bit-exactly; the copy is rebuilt as their rounding."""
    step, state = _run(stage)
    logical = {leaf.path: np.asarray(leaf.storage_to_logical(state.params[leaf.path]))
               for leaf in step.plan.leaves}
    checkpoint.save(tmp_path, state, step=step)
    restored = checkpoint.restore(tmp_path, step).state
    for leaf in step.plan.leaves:
        stored = restored.params[leaf.path]
        np.testing.assert_array_equal(np.asarray(leaf.storage_to_logical(stored)),
                                      logical[leaf.path])
        if leaf.has_compute_copy:
            np.testing.assert_array_equal(np.asarray(stored.compute),
                                          logical[leaf.path].astype(stored.compute.dtype))
    fp32 = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adam(3e-3), config=zeroxla.ZeroConfig(stage=3))
    other = checkpoint.restore(tmp_path, fp32).state
    for leaf in fp32.plan.leaves:
        np.testing.assert_array_equal(np.asarray(leaf.storage_to_logical(
            other.params[leaf.path])), logical[leaf.path])
    # And back: the float32 stage-3 state into this step.
    checkpoint.save(tmp_path / "back", other, step=fp32)
    again = checkpoint.restore(tmp_path / "back", step).state
    for leaf in step.plan.leaves:
        np.testing.assert_array_equal(np.asarray(leaf.storage_to_logical(
            again.params[leaf.path])), logical[leaf.path])
