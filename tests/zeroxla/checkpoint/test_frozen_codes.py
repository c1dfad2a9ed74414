"""Frozen int8/int4 codes in checkpoints (`zeroxla.checkpoint.codes`): saved as codes, restored
bit-exactly on the same group layout, re-blocked from the stored codes on another one.

The reference for the re-blocking is numpy on an element-index array: zero-pad the shard dim to
a multiple of N, split it into N blocks, flatten each (the plan's documented layout), cut rows
into groups; it never calls the engine's `shards_of` / `from_shards`.
"""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params, token_batches
from zeroxla import checkpoint, models
from zeroxla.checkpoint import codes
from zeroxla.checkpoint.integrity import digest
from zeroxla.checkpoint.listing import META_ITEM
from zeroxla.engine.mesh import MeshAxes, make_mesh
from zeroxla.engine.plan import make_plan
from zeroxla.engine.state import gather_params

VOCAB, D = 64, 256
BATCHES = token_batches(2, 8, 8, vocab=VOCAB, seed=0)


class FrozenBase(nnx.Module):
    """A frozen embedding and projection (every shard a whole number of 2048-element groups on
    8 and on 4 devices) under a trained head."""

    def __init__(self, rngs: nnx.Rngs):
        normal = nnx.initializers.normal
        self.table = nnx.Param(normal(1.0)(rngs.params(), (VOCAB, D)),
                               logical_axes=("vocab", "embed"))
        self.w = nnx.Param(normal(D ** -0.5)(rngs.params(), (D, D)), logical_axes=("embed", "mlp"))
        self.head = nnx.Param(normal(D ** -0.5)(rngs.params(), (D, VOCAB)),
                              logical_axes=("mlp", "vocab"))

    def __call__(self, tokens):                                   # [B, T] -> [B, T, V]
        return jnp.tanh(self.table[tokens] @ self.w) @ self.head


def _step(model_name, mesh, *, bits=8, quantized=True):
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=100, weight_quantization_bits=bits,
                                quantized_nontrainable_weights=quantized)
    if model_name == "base":
        factory, trainable = (lambda: FrozenBase(nnx.Rngs(0))), nnx.PathContains("head")
    else:       # gpt-tiny, d_model 60: padded partitions, groups smaller than 2048
        factory, trainable = (lambda: models.build("gpt-tiny", seed=1)), nnx.PathContains("w_fc")
    return zeroxla.make_step(factory, mesh, optimizer=optax.adamw(1e-2), config=config,
                             trainable=trainable)


def _initial(model_name, bits):
    """A step on the 2 x 4 mesh and its initial state. Not trained: frozen codes are written
    once at init and never again (tests/zeroxla/engine/test_frozen_params.py), and compiling
    the step would dominate these tests."""
    step = _step(model_name, make_mesh(2, 4), bits=bits)
    return step, step.init()


def _codes(state, step):
    return {leaf.path: jax.tree.map(np.asarray, state.params[leaf.path])
            for leaf in step.plan.leaves if leaf.params_quantized}


def _assert_same_codes(got, expected):
    assert got.keys() == expected.keys() and expected
    for path in expected:
        for field in codes.FIELDS:
            np.testing.assert_array_equal(getattr(got[path], field),
                                          getattr(expected[path], field), err_msg=path)


# ---------------------------------------------------------------------------------------------
# The layout logic, against numpy.

def _groups_numpy(leaf, x):
    """x (logical shape) -> [L, N, G, gs] in the leaf's stored group layout: pad the shard dim
    with `fill`, split it into N blocks, flatten each, edge-pad to whole groups."""
    layers = x if leaf.stacked else x[None]
    dim = leaf.shard_dim - (1 if leaf.stacked else 0)
    widths = [(0, 0)] * layers[0].ndim
    widths[dim] = (0, leaf.padded_size - leaf.shape[leaf.shard_dim])
    out = []
    for unit in layers:
        rows = [b.reshape(-1) for b in np.split(np.pad(unit, widths, constant_values=-1),
                                                leaf.data_size, axis=dim)]
        size = leaf.storage_groups * leaf.storage_group_size
        rows = [np.pad(r, (0, size - r.size), mode="edge") for r in rows]
        out.append(np.stack(rows).reshape(leaf.data_size, leaf.storage_groups, -1))
    return np.stack(out)


CASES = [((64, 256), ("vocab", "embed"), 256),     # shard dim 0, groups aligned: all exact
         ((65, 60), ("vocab", "embed"), 64),       # padded, shard dim 1: groups mix
         ((3, 7, 40), ("layers", "embed", "mlp"), 16)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,axes,group", CASES)
def test_reblock_against_numpy(shape, axes, group, bits):
    def plan(mesh_shape):
        return make_plan({"w": shape}, {"w": axes}, stage=3,
                         axes=MeshAxes(("node", "local"), mesh_shape), persistence_threshold=0,
                         frozen={"w"}, frozen_storage_bits=bits, frozen_group_size=group)["w"]
    eight, four = plan((2, 4)), plan((1, 4))
    x = jax.random.normal(jax.random.key(1), shape) * jnp.linspace(0.1, 10, shape[-1])
    stored = jax.jit(eight.logical_to_storage)(x)
    values8 = np.asarray(jax.jit(eight.storage_to_logical)(stored))

    def reblock(source, target, q):
        return jax.jit(lambda d, s: codes.reblock(target, *codes.element_codes(source, d, s)))(
            q.data, q.scales)

    # Same layout: the identity, bit for bit (padding codes included).
    _assert_same_codes({"w": jax.tree.map(np.asarray, reblock(eight, eight, stored))},
                       {"w": jax.tree.map(np.asarray, stored)})

    moved = reblock(eight, four, stored)
    values4 = np.asarray(jax.jit(four.storage_to_logical)(moved))
    # Reference: which stored group each element sat in, and which target group it lands in.
    index = np.arange(np.prod(shape)).reshape(shape)
    src = _groups_numpy(eight, index)                         # [L, 8, G8, gs8] element ids
    dst = _groups_numpy(four, index)                          # [L, 4, G4, gs4]
    src_step = np.full(index.size, np.nan, np.float32)
    scales8 = np.asarray(stored.scales).reshape(src.shape[:3])
    for key in np.ndindex(*src.shape[:3]):
        ids = src[key][src[key] >= 0]
        src_step[ids] = scales8[key]
    qmax = 2 ** (bits - 1) - 1
    exact = mixed = 0
    for key in np.ndindex(*dst.shape[:3]):
        ids = dst[key][dst[key] >= 0]
        if ids.size == 0:
            continue
        flat4, flat8 = values4.reshape(-1)[ids], values8.reshape(-1)[ids]
        if np.unique(src_step[ids]).size == 1:                # one stored step: exact
            exact += 1
            np.testing.assert_array_equal(flat4, flat8)
        else:        # requantized: half a step, + float32 rounding of step and code * step
            mixed += 1
            absmax = np.abs(flat8).max()
            assert np.abs(flat4 - flat8).max() <= absmax / qmax / 2 + absmax * 2.0 ** -22
    # Aligned shards keep every group; padded, column-split ones mix stored groups.
    assert (exact, mixed) == ((64, 0) if shape == (64, 256) else (exact, mixed)) and mixed + exact
    assert (mixed == 0) == (shape == (64, 256)), (exact, mixed)

    # Idempotent: re-blocking the result onto its own layout copies it.
    again = reblock(four, four, moved)
    _assert_same_codes({"w": jax.tree.map(np.asarray, again)},
                       {"w": jax.tree.map(np.asarray, moved)})


# ---------------------------------------------------------------------------------------------
# Checkpoints.

def _saved_codes(directory, step):
    """The frozen codes a checkpoint holds, read back from disk."""
    arrays = checkpoint.StoredArrays(directory)
    found = {}
    for leaf in step.plan.leaves:
        if leaf.params_quantized:
            found[leaf.path] = SimpleNamespace(**{
                f: arrays.read(codes.array_name(leaf.path, f)) for f in codes.FIELDS})
    return found


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_save_restore_save_ten_times_keeps_the_codes(tmp_path, bits):
    step, state = _initial("base", bits)
    original = _codes(state, step)
    assert {p: q.bits for p, q in original.items()} == {"table": bits, "w": bits}
    for i in range(10):
        checkpoint.save(tmp_path / str(i), state, step=step)
        _assert_same_codes(_saved_codes(tmp_path / str(i), step), original)
        state = checkpoint.restore(tmp_path / str(i), step).state
        _assert_same_codes(_codes(state, step), original)


@pytest.mark.slow
def test_restore_onto_four_devices(tmp_path):
    """8 -> 4 devices: every new group lies in one stored group (shard dim 0, whole groups), so
    the values are exact. Saved again on 4 and restored: bit-exact. (Mixed groups, gpt-tiny
    with d_model 60: test_checkpoint.py::test_frozen_leaves_round_trip, within half a step.)"""
    step, state = _initial("base", 8)
    expected = flat_params(gather_params(state))
    checkpoint.save(tmp_path / "8", state, step=step)
    four = _step("base", make_mesh(1, 4, devices=jax.devices()[:4]))
    restored = checkpoint.restore(tmp_path / "8", four).state
    got = flat_params(gather_params(restored))
    assert any(leaf.params_quantized for leaf in four.plan.leaves)
    for path, value in expected.items():        # frozen codes and float leaves alike: exact
        np.testing.assert_array_equal(got[path], value, err_msg=path)
    checkpoint.save(tmp_path / "4", restored, step=four)
    _assert_same_codes(_codes(checkpoint.restore(tmp_path / "4", four).state, four),
                       _codes(restored, four))
    _, metrics = four(restored, BATCHES[0])     # it trains on from there
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_readers_and_float_targets_see_the_stored_values(tmp_path):
    """load_params, StoredArrays (whole and per layer) and a step holding the frozen leaves in
    float32 all get code * step exactly, what gather_params gives."""
    step, state = _initial("gpt", 4)
    expected = flat_params(gather_params(state))
    checkpoint.save(tmp_path, state, step=step)
    loaded = flat_params(nnx.state(checkpoint.load_params(tmp_path), nnx.Param))
    arrays = checkpoint.StoredArrays(tmp_path)
    stacked = [leaf for leaf in step.plan.leaves if leaf.params_quantized and leaf.stacked]
    assert stacked
    for leaf in stacked:
        layers = [arrays.read(f"params/{leaf.path}", i) for i in range(leaf.layers)]
        np.testing.assert_array_equal(np.stack(layers), expected[leaf.path], err_msg=leaf.path)
    as_float = checkpoint.restore(tmp_path, _step("gpt", make_mesh(2, 4), quantized=False))
    restored = flat_params(gather_params(as_float.state))
    for path, value in expected.items():
        np.testing.assert_array_equal(loaded[path], value, err_msg=path)
        np.testing.assert_array_equal(restored[path], value, err_msg=path)


def _rewrite_format(path, number):
    meta_file = path / META_ITEM / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["format"] = number
    meta["digest"] = digest(meta)
    meta_file.write_text(json.dumps(meta))


def test_format_one_floats_restore_into_codes_and_unknown_formats_are_refused(tmp_path):
    """A format-1 checkpoint held frozen leaves as floats: they are quantized once, as at init.
    A format this zeroxla does not know is refused, naming it."""
    floats = _step("base", make_mesh(2, 4), quantized=False)
    state = floats.init()
    path = checkpoint.save(tmp_path, state, step=floats)
    _rewrite_format(path, 1)
    quantized = _step("base", make_mesh(2, 4))
    restored = checkpoint.restore(tmp_path, quantized).state
    _assert_same_codes(_codes(restored, quantized), _codes(quantized.init(), quantized))
    _rewrite_format(path, 3)
    with pytest.raises(checkpoint.CheckpointError, match="format 3; .*reads formats 1, 2"):
        checkpoint.restore(tmp_path, quantized)
