"""The sharding plan: a printable table (golden file) and its layout arithmetic."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla import models
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.plan import make_plan

GOLDEN = pathlib.Path(__file__).parent / "golden"
AXES = MeshAxes(("node", "local"), (2, 4))          # 8 data-parallel devices


def _plan(name, stage, threshold):
    model_def, _ = ModelDef.of(models.build(name))
    return make_plan(model_def.shape_dict(), model_def.axes_dict(), stage=stage, axes=AXES,
                     persistence_threshold=threshold)


@pytest.mark.parametrize("name,stage", [("gpt-tiny", 3), ("llama-tiny", 3), ("gpt-tiny", 1)])
def test_describe_matches_golden(name, stage):
    text = _plan(name, stage, 500).describe() + "\n"
    golden = GOLDEN / f"plan_{name}_stage{stage}.txt"
    assert text == golden.read_text(), f"update {golden} if this change is intended:\n{text}"


def test_persistence_threshold_is_per_layer():
    """DeepSpeed applies the threshold per parameter; a stacked leaf is L parameters."""
    plan = _plan("gpt-tiny", 3, 400)
    b_fc = plan["blocks/layers/b_fc"]                  # [2, 240]: 480 elements, 240 per layer
    assert b_fc.numel == 480 and b_fc.unit_numel == 240
    assert not b_fc.params_partitioned
    assert plan["embed/wte"].params_partitioned       # 3900 elements


@pytest.mark.parametrize("shape,stacked,dim", [
    ((65, 60), False, 1),          # neither divides 8: the dim with the least padding (60 -> 64)
    ((128, 60), False, 0),         # the first dim 8 divides
    ((3, 7, 5), True, 1),          # never the layer dim; 7 -> 8 pads 5 per layer, 5 -> 8 pads 21
    ((1,), False, 0)])
def test_partitioned_layout_round_trip(shape, stacked, dim):
    """The stored array keeps the logical shape except along one dim, zero-padded to a multiple
    of the device count; cutting the padding off gives back the logical array."""
    axes = ("layers",) + ("x",) * (len(shape) - 1) if stacked else ("x",) * len(shape)
    plan = make_plan({"w": shape}, {"w": axes}, stage=3, axes=AXES, persistence_threshold=0)
    leaf = plan["w"]
    assert leaf.shard_dim == dim
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 1
    stored = leaf.pad(x)
    assert stored.shape == leaf.padded_shape
    assert stored.shape[dim] % 8 == 0 and 0 <= stored.shape[dim] - shape[dim] < 8
    assert [a for d, a in enumerate(stored.shape) if d != dim] == \
        [a for d, a in enumerate(shape) if d != dim]
    np.testing.assert_array_equal(np.asarray(stored)[tuple(
        slice(None) if d != dim else slice(shape[dim], None) for d in range(len(shape)))], 0)
    np.testing.assert_array_equal(leaf.unpad(stored), x)


def test_stage_decides_what_is_partitioned():
    for stage, params, optimizer in [(0, False, False), (1, False, True), (2, False, True),
                                     (3, True, True)]:
        leaf = _plan("gpt-tiny", stage, 0)["blocks/layers/w_fc"]
        assert (leaf.params_partitioned, leaf.optimizer_partitioned) == (params, optimizer)
