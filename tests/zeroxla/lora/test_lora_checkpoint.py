"""A LoRA run's checkpoint: the adapters are stored apart from the base (their own arrays, the
frozen base as its int8 codes), and restore brings the state back bit for bit, training
continuing as it would have (restoring onto other meshes is the checkpoint tests' subject)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeroxla
from reference import flat_params
from test_lora import VOCAB, _batches, _zero3_run
from zeroxla import checkpoint

pytestmark = pytest.mark.slow


def test_adapters_are_stored_apart_and_restore_bit_for_bit(tmp_path):
    step, state, _, _ = _zero3_run("user", 8)
    before = flat_params(zeroxla.gather_params(state))
    path = checkpoint.save(tmp_path, state, layout=step.layout)
    assert path.exists()
    arrays = set(checkpoint.read_metadata(tmp_path, None)["arrays"])
    adapters = {f"{m}/kernel/lora_{ab}" for m in ("up", "down") for ab in "ab"}
    assert {f"params/{p}" for p in adapters} <= arrays
    # The frozen base: its int8 codes and steps, as stored; Adam's moments: the adapters'.
    assert {f"frozen_codes/{m}/kernel/base/{part}" for m in ("up", "down")
            for part in ("data", "scales")} <= arrays
    assert not {a for a in arrays if a.startswith("params/") and "/base" in a}
    assert {a for a in arrays if a.startswith("opt_state/0/mu/")} == {
        f"opt_state/0/mu/{p}" for p in adapters}
    restored = checkpoint.restore(tmp_path, step).state
    got = flat_params(zeroxla.gather_params(restored))
    assert got.keys() == before.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # Training continues from the restored state exactly as from the saved one.
    batch = _batches(VOCAB)[0]
    _, from_restored = step(restored, batch)
    _, from_saved = step(jax.tree.map(jnp.copy, state), batch)   # the cached state stays live
    assert float(from_restored["loss"]) == float(from_saved["loss"])
