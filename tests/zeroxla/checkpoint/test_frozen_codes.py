"""Frozen int8/int4 codes in checkpoints (`zeroxla.checkpoint.codes`): quantization groups cut
on the logical tensor (`zeroxla.sharding.plan.frozen_code_groups`), so the same codes and steps are
every mesh's; a checkpoint stores them in that logical order and restores them onto any mesh
bit for bit.

The reference for the layouts is numpy on an element-index array: zero-pad the shard dim to a
multiple of N, split it into N blocks, flatten each (the plan's documented layout), cut rows
into groups; it never calls the engine's `shards_of` / `from_shards`.
"""

import functools
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
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.mesh import MeshAxes, make_mesh
from zeroxla.sharding.plan import make_plan
from zeroxla.engine.state import gather_params
from zeroxla.engine.stored import logical_to_storage, storage_to_logical
from zeroxla.pallas_kernels import quantize

VOCAB, D = 64, 256
BATCHES = token_batches(2, 8, 8, vocab=VOCAB, seed=0)


class FrozenBase(nnx.Module):
    """A frozen embedding and projection (rows of 256 elements: groups of 256, shard dim 0 on
    every mesh, no padding) under a trained head."""

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
    else:       # gpt-tiny, d_model 60: groups of 60 and 900, padded partitions (wte's 65
        # rows; wo's 4 heads on 8 devices)
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
            for leaf in step.layout.plan.leaves if leaf.params_quantized}


def _assert_same_codes(got, expected):
    assert got.keys() == expected.keys() and expected
    for path in expected:
        for field in codes.FIELDS:
            np.testing.assert_array_equal(getattr(got[path], field),
                                          getattr(expected[path], field), err_msg=path)




def _logical(state, step):
    """The stored form (`codes.to_logical`) of every frozen leaf's codes in `state`."""
    return {leaf.path: SimpleNamespace(**dict(zip(codes.FIELDS, map(np.asarray, jax.jit(
        lambda q, leaf=leaf: codes.to_logical(leaf, q))(state.params[leaf.path])))))
        for leaf in step.layout.plan.leaves if leaf.params_quantized}


# ---------------------------------------------------------------------------------------------
# The layout logic, against numpy.

MESH_SHAPES = {8: (2, 4), 4: (1, 4), 2: (1, 2)}
HOPS = (8, 4, 8, 2)
STEP_HOPS = (8, 2, 4)      # through whole steps and checkpoints: each hop compiles a mesh's step


def _plan(shape, axes, devices, *, bits, group):
    return make_plan({"w": shape}, {"w": axes}, stage=3,
                     axes=MeshAxes(("node", "local"), MESH_SHAPES[devices]),
                     persistence_threshold=0, frozen={"w"}, frozen_storage_bits=bits,
                     frozen_group_size=group)["w"]


def _groups_numpy(leaf, x):
    """x (logical shape) -> [L, N, G, gs] in the leaf's stored group layout: pad the shard dim
    with -1, split it into N blocks, flatten each, edge-pad to whole groups."""
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


def _row_group_size(shape, stacked, group, bits):
    """The largest divisor of a row (the dims after the first unit dim) not above `group`
    (even under int4)."""
    row = int(np.prod(shape[2 if stacked else 1:]))
    return max(d for d in range(1, min(row, group) + 1)
               if row % d == 0 and (bits == 8 or d % 2 == 0))


CASES = [((64, 256), ("vocab", "embed"), 256),      # shard dim 0, no padding
         ((65, 60), ("vocab", "embed"), 64),        # padded shard dim, groups of a whole row
         ((3, 7, 40), ("layers", "embed", "mlp"), 16),   # stacked, padded, groups of 10
         ((6, 8, 16), ("vocab", "heads", "embed"), 16)]  # shard dim 0 on 2 devices, 1 on 4, 8


def cases_by_bits():
    """Every case at 8 and 4 bits (pytest's own ids); daily each case once, the bits in turn."""
    return [pytest.param(*case, bits, id=f"shape{i}-axes{i}-{case[2]}-{bits}",
                         marks=() if b == i % 2 else pytest.mark.slow)
            for i, case in enumerate(CASES) for b, bits in enumerate((8, 4))]


@pytest.mark.parametrize("shape,axes,group,bits", cases_by_bits())
def test_groups_are_cut_on_the_logical_tensor(shape, axes, group, bits):
    """On every mesh each stored group is one aligned run of `g` elements of the logical unit
    flattened (or all padding), and its codes and step are those of quantizing the logical
    unit itself: the same groups, codes and steps on 8, 4 and 2 devices."""
    stacked = axes[0] == "layers"
    g = _row_group_size(shape, stacked, group, bits)
    x = jax.random.normal(jax.random.key(1), shape) * jnp.linspace(0.1, 10, shape[-1])
    units = x if stacked else x[None]
    unit_numel = units[0].size
    logical = [quantize(u.reshape(-1), bits=bits, group_size=g, impl="jnp") for u in units]
    shard_dims = set()
    for devices in MESH_SHAPES:
        leaf = _plan(shape, axes, devices, bits=bits, group=group)
        assert leaf.params_quantized and leaf.storage_group_size == g
        assert leaf.chunk % g == 0                      # no shard ends inside a group
        shard_dims.add(leaf.shard_dim)
        stored = _to_storage(leaf)(x)
        data = np.asarray(stored.data).reshape(len(units), devices, leaf.storage_groups, -1)
        scales = np.asarray(stored.scales).reshape(data.shape[:3])
        ids = _groups_numpy(leaf, np.arange(x.size).reshape(shape))     # [L, N, G, g]
        seen = set()
        for key in np.ndindex(*ids.shape[:3]):
            group_ids = ids[key]
            if (group_ids < 0).all():                   # padding: codes 0, step 1
                assert (data[key] == 0).all() and scales[key] == 1.0
                continue
            layer, offset = divmod(int(group_ids[0]), unit_numel)
            j = offset // g
            np.testing.assert_array_equal(group_ids, layer * unit_numel + j * g + np.arange(g))
            np.testing.assert_array_equal(data[key], np.asarray(logical[layer].data[j]))
            assert scales[key] == np.asarray(logical[layer].scales[j])
            seen.add((layer, j))
        assert len(seen) == len(units) * unit_numel // g         # every group, once
        # The stored form is the logical quantization, whatever the mesh.
        data_l, scales_l = jax.jit(lambda q, leaf=leaf: codes.to_logical(leaf, q))(stored)
        lead = (len(units),) if stacked else ()
        np.testing.assert_array_equal(
            data_l, np.stack([q.data for q in logical]).reshape(*lead, -1, data.shape[-1]))
        np.testing.assert_array_equal(
            scales_l, np.stack([q.scales for q in logical]).reshape(*lead, -1))
    assert (len(shard_dims) > 1) == (shape == (6, 8, 16)), shard_dims


def _to_storage(leaf):
    """`logical_to_storage` of `leaf`, jitted."""
    return jax.jit(functools.partial(logical_to_storage, leaf))


def _to_logical(leaf):
    """`storage_to_logical` of `leaf`, jitted."""
    return jax.jit(functools.partial(storage_to_logical, leaf))


def _restore(stored, target, data, scales):
    """`codes.restore_codes` without the shardings: stored codes -> the target's storage."""
    bits = stored.storage_bits if isinstance(stored, LeafPlan) else stored.bits
    return jax.jit(lambda d, s: codes.reblock(target, *codes.element_codes(stored, d, s),
                                              source_bits=bits))(data, scales)


def _stored_form(leaf):
    """The stored form a checkpoint's JSON record of `leaf` describes."""
    stored = codes.stored_layout(leaf.path, codes.layout_record(leaf))
    assert stored == codes.LogicalCodes.of(leaf)
    return stored


@pytest.mark.parametrize("shape,axes,group,bits", cases_by_bits())
def test_codes_hop_across_meshes_bit_for_bit(shape, axes, group, bits):
    """8 -> 4 -> 8 -> 2 devices through the stored form: at every hop the codes are exactly what
    quantizing on that mesh gives, the values bit-identical, and the stored form the same."""
    x = jax.random.normal(jax.random.key(2), shape) * jnp.linspace(0.1, 10, shape[-1])
    first = _plan(shape, axes, HOPS[0], bits=bits, group=group)
    state = _to_storage(first)(x)
    values = np.asarray(_to_logical(first)(state))
    stored = jax.jit(lambda q: codes.to_logical(first, q))(state)
    for devices in HOPS[1:]:
        leaf = _plan(shape, axes, devices, bits=bits, group=group)
        state = _restore(_stored_form(first), leaf, *stored)
        _assert_same_codes({"w": jax.tree.map(np.asarray, state)},
                           {"w": jax.tree.map(np.asarray, _to_storage(leaf)(x))})
        np.testing.assert_array_equal(_to_logical(leaf)(state), values)
        again = jax.jit(lambda q, leaf=leaf: codes.to_logical(leaf, q))(state)
        for a, b in zip(again, stored):
            np.testing.assert_array_equal(a, b)
        stored = again


@pytest.mark.parametrize("target_group,target_bits", [(60, 8), (48, 4), (48, 8)])
def test_other_groups_or_fewer_bits_requantize_once(target_group, target_bits):
    """Stored int8 groups of 48, restored into groups of 60 (straddling them) or into int4: the
    values move by at most half the target's step, once; restoring that onto its own layout
    copies it. Into int8 groups of 48 from int4 ones (more bits): exact."""
    shape, axes = (16, 240), ("vocab", "embed")
    source_bits = 4 if target_bits == 8 and target_group == 48 else 8
    source = _plan(shape, axes, 8, bits=source_bits, group=48)
    target = _plan(shape, axes, 4, bits=target_bits, group=target_group)
    assert (source.storage_group_size, target.storage_group_size) == (48, target_group)
    x = jax.random.normal(jax.random.key(3), shape) * jnp.linspace(0.1, 10, shape[-1])
    stored = jax.jit(lambda q: codes.to_logical(source, q))(_to_storage(source)(x))
    values = np.asarray(jax.jit(lambda d, s: jnp.multiply(*codes.element_codes(
        _stored_form(source), d, s)))(*stored))
    moved = _restore(_stored_form(source), target, *stored)
    got = np.asarray(_to_logical(target)(moved))
    if source_bits < target_bits:
        np.testing.assert_array_equal(got, values)
    else:
        qmax = 2 ** (target_bits - 1) - 1
        rows = values.reshape(-1, target_group)            # the target's (logical) groups
        bound = np.abs(rows).max(axis=1, keepdims=True) * (1 / qmax / 2 + 2.0 ** -22)
        assert (np.abs(got.reshape(rows.shape) - rows) <= bound).all()
        assert not np.array_equal(got, values)
    again = jax.jit(lambda q: codes.to_logical(target, q))(moved)
    _assert_same_codes({"w": jax.tree.map(np.asarray, _restore(_stored_form(target), target,
                                                               *again))},
                       {"w": jax.tree.map(np.asarray, moved)})


def test_format_two_shard_layout_still_reads():
    """A format-2 checkpoint stored each device's codes in its shard layout (here the old
    plan's: shard dim 1, groups of 64 cut across rows): its values read exactly, on devices and
    on the host, and restore into today's groups within half a step."""
    record = {"shape": [65, 60], "stacked": False, "data_size": 8, "shard_dim": 1,
              "padded_size": 64, "bits": 8, "group_size": 64}
    old = codes.stored_layout("w", record)
    assert isinstance(old, LeafPlan)
    x = jax.random.normal(jax.random.key(4), (65, 60))
    q = _to_storage(old)(x)
    expected = np.asarray(_to_logical(old)(q))
    got = jax.jit(lambda d, s: jnp.multiply(*codes.element_codes(old, d, s)))(q.data, q.scales)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(
        codes.dequantize_numpy(old, np.asarray(q.data), np.asarray(q.scales)), expected)
    target = _plan((65, 60), ("vocab", "embed"), 4, bits=8, group=64)
    moved = np.asarray(_to_logical(target)(_restore(old, target, q.data, q.scales)))
    bound = np.abs(expected).max(axis=1, keepdims=True) * (1 / 127 / 2 + 2.0 ** -22)
    assert (np.abs(moved - expected) <= bound).all()


def test_rows_without_a_group_stay_float32():
    """A frozen leaf whose rows admit no group of 2 or more (one element per row; an odd row
    under int4) is stored as float32, partitioned as before."""
    plan = make_plan({"vector": (4096,), "odd": (64, 15), "even": (64, 16)}, {}, stage=3,
                     axes=MeshAxes(("node", "local"), (2, 4)), persistence_threshold=0,
                     frozen={"vector", "odd", "even"}, frozen_storage_bits=4,
                     frozen_group_size=2048)
    assert not plan["vector"].params_quantized and plan["vector"].params_partitioned
    assert not plan["odd"].params_quantized and plan["odd"].params_partitioned
    assert plan["even"].params_quantized and plan["even"].storage_group_size == 16


# ---------------------------------------------------------------------------------------------
# Checkpoints.

def _saved_codes(directory, step):
    """The frozen codes a checkpoint holds, read back from disk."""
    arrays = checkpoint.StoredArrays(directory)
    found = {}
    for leaf in step.layout.plan.leaves:
        if leaf.params_quantized:
            found[leaf.path] = SimpleNamespace(**{
                f: arrays.read(codes.array_name(leaf.path, f)) for f in codes.FIELDS})
    return found


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_save_restore_save_ten_times_keeps_the_codes(tmp_path, bits):
    step, state = _initial("base", bits)
    original = _codes(state, step)
    assert {p: step.layout.plan[p].storage_bits for p in original} == {"table": bits, "w": bits}
    for i in range(10):
        checkpoint.save(tmp_path / str(i), state, layout=step.layout)
        _assert_same_codes(_saved_codes(tmp_path / str(i), step), _logical(state, step))
        state = checkpoint.restore(tmp_path / str(i), step).state
        _assert_same_codes(_codes(state, step), original)


@pytest.mark.slow
@pytest.mark.fusion_emitters        # each mesh's own init quantization, bit for bit
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("model_name", ["gpt"])    # the base model's layouts: the layout test
def test_frozen_codes_restore_across_meshes_bit_for_bit(tmp_path, model_name, bits):
    """8 -> 2 -> 4 devices (to fewer, then to more; the layout test above walks 8 -> 4 -> 8 -> 2),
    saving on each mesh and restoring on the next: every parameter's values (frozen codes
    dequantized, float leaves) bit-identical at every hop, each mesh's
    codes exactly those its own step quantizes at init, and the checkpoint's frozen arrays the
    same bytes whichever mesh saved them."""
    meshes = {8: lambda: make_mesh(2, 4), 4: lambda: make_mesh(1, 4, devices=jax.devices()[:4]),
              2: lambda: make_mesh(1, 2, devices=jax.devices()[:2])}
    step, state = _initial(model_name, bits)
    expected = flat_params(gather_params(state))
    first = checkpoint.save(tmp_path / "0", state, layout=step.layout)
    saved = _saved_codes(tmp_path / "0", step)
    for hop, devices in enumerate(STEP_HOPS[1:], start=1):
        step = _step(model_name, meshes[devices](), bits=bits)
        assert step.layout.plan.data_size == devices
        state = checkpoint.restore(tmp_path / str(hop - 1), step).state
        _assert_same_codes(_codes(state, step), _codes(step.init(), step))
        got = flat_params(gather_params(state))
        assert got.keys() == expected.keys()
        for path, value in expected.items():
            np.testing.assert_array_equal(got[path], value, err_msg=f"{devices} devices: {path}")
        path = checkpoint.save(tmp_path / str(hop), state, layout=step.layout)
        _assert_same_codes(_saved_codes(tmp_path / str(hop), step), saved)
        assert (json.loads((path / META_ITEM / "metadata").read_text())["frozen_codes"]
                == json.loads((first / META_ITEM / "metadata").read_text())["frozen_codes"])


@pytest.mark.slow
def test_readers_and_float_targets_see_the_stored_values(tmp_path):
    """load_params, StoredArrays (whole and per layer) and a step holding the frozen leaves in
    float32 all get code * step exactly, what gather_params gives."""
    step, state = _initial("gpt", 4)
    expected = flat_params(gather_params(state))
    checkpoint.save(tmp_path, state, layout=step.layout)
    loaded = flat_params(nnx.state(checkpoint.load_params(tmp_path), nnx.Param))
    arrays = checkpoint.StoredArrays(tmp_path)
    stacked = [leaf for leaf in step.layout.plan.leaves if leaf.params_quantized and leaf.stacked]
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


@pytest.mark.slow
@pytest.mark.fusion_emitters        # restored codes equal the new step's init quantization
def test_format_one_floats_restore_into_codes_and_unknown_formats_are_refused(tmp_path):
    """A format-1 checkpoint held frozen leaves as floats: they are quantized once, as at init.
    A format this zeroxla does not know is refused, naming it."""
    floats = _step("base", make_mesh(2, 4), quantized=False)
    state = floats.init()
    path = checkpoint.save(tmp_path, state, layout=floats.layout)
    _rewrite_format(path, 1)
    quantized = _step("base", make_mesh(2, 4))
    restored = checkpoint.restore(tmp_path, quantized).state
    _assert_same_codes(_codes(restored, quantized), _codes(quantized.init(), quantized))
    _rewrite_format(path, 4)
    with pytest.raises(checkpoint.CheckpointError, match="format 4; .*reads formats 1, 2, 3"):
        checkpoint.restore(tmp_path, quantized)
