"""`zeroxla.hlo` against programs whose collectives are known, on the 2-node x 4-local mesh.

Each shard_map program works on x: f32[32,16] sharded over ("node","local"), i.e. a f32[4,16]
block of 256 bytes per device.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroxla.analysis import hlo
from zeroxla.sharding.mesh import DATA_AXES, LOCAL_AXIS, NODE_AXIS, make_mesh

BLOCK = 4 * 16 * 4  # f32[4,16] per device
ALL = ((0, 1, 2, 3, 4, 5, 6, 7),)
LOCAL = ((0, 1, 2, 3), (4, 5, 6, 7))
NODE = ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.fixture(scope="module")
def mesh(devices):
    return make_mesh(2, 4)


def shard_mapped(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))


def compiled_text(fn, *args):
    return fn.lower(*args).compile().as_text()


def only(found):
    assert len(found) == 1, found
    return found[0]


X = jnp.ones((32, 16), jnp.float32)


# -- shapes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, leaves, num_bytes", [
    ("f32[8,16]{1,0}", ("f32[8,16]",), 512),
    ("bf16[3]{0:T(128)(2,1)}", ("bf16[3]",), 6),
    ("pred[]", ("pred[]",), 1),
    ("(s32[], f32[1,16]{1,0})", ("s32[]", "f32[1,16]"), 68),
    ("((f32[16,16]{1,0}), f32[2,16]{1,0}, u32[], u32[])",
     ("f32[16,16]", "f32[2,16]", "u32[]", "u32[]"), 1024 + 128 + 8),
    ("s4[5]{0}", ("s4[5]",), 3),
    ("f8e4m3fn[2,8]", ("f8e4m3fn[2,8]",), 16),
    ("f32[<=16]{0}", ("f32[16]",), 64),
])
def test_parse_shape_flattens_tuples_and_sizes_bytes(text, leaves, num_bytes):
    shapes = hlo.parse_shape(text)
    assert tuple(map(str, shapes)) == leaves
    assert sum(s.num_bytes for s in shapes) == num_bytes


# -- replica groups ---------------------------------------------------------------------------


def test_explicit_replica_groups():
    assert hlo.parse_replica_groups("{{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert hlo.parse_replica_groups("{}") == ()


@pytest.mark.parametrize("text, groups", [
    ("[1,8]<=[8]", ALL),
    ("[2,4]<=[8]", LOCAL),
    ("[4,2]<=[2,4]T(1,0)", NODE),
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("[4,2]<=[2,2,2]T(2,0,1)", ((0, 2), (4, 6), (1, 3), (5, 7))),
])
def test_iota_replica_groups_by_hand(text, groups):
    assert hlo.parse_replica_groups(text) == groups


def xla_expanded_groups(text):
    """XLA's own expansion of `replica_groups=text`: parse an HLO module with it and convert it
    to StableHLO, which writes the groups out as a dense tensor."""
    try:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib import _jax, xla_client
        from jax._src.lib.mlir import ir

        module = xla_client.hlo.hlo_module_from_text(
            "HloModule m, num_partitions=8\n\nENTRY %main (p: f32[1,16]) -> f32[4,16] {\n"
            "  %p = f32[1,16]{1,0} parameter(0)\n"
            f"  ROOT %ag = f32[4,16]{{1,0}} all-gather(%p), channel_id=1, replica_groups={text}, "
            "dimensions={0}, use_global_device_ids=true\n}\n")
        stablehlo = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
        with jax_mlir.make_ir_context():
            printed = str(ir.Module.parse(stablehlo))
    except (ImportError, AttributeError) as error:
        pytest.skip(f"jax internals moved: {error}")
    dense = re.search(r"replica_groups = dense<(.*?)> : tensor", printed).group(1)
    return tuple(tuple(group) for group in json.loads(dense))


@pytest.mark.parametrize("text", ["[2,4]<=[8]", "[4,2]<=[2,4]T(1,0)", "[2,4]<=[4,2]T(1,0)",
                                  "[4,2]<=[2,2,2]T(2,0,1)", "[2,4]<=[2,2,2]T(1,0,2)"])
def test_iota_replica_groups_match_xla(text):
    assert hlo.parse_replica_groups(text) == xla_expanded_groups(text)


@pytest.mark.parametrize("text, groups", [
    ("mesh['x'=2,'y'=4] {'y'}", LOCAL),
    ("mesh['x'=2,'y'=4] {'x'}", NODE),
    ("mesh['x'=2,'y'=4] {'x','y'}", ALL),
    ("mesh['x'=2,'y'=4] {'y','x'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    # A sub-axis 'a':(pre)size is `size` devices after a major part of `pre` (Shardy).
    ("mesh['a'=8] {'a':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=8] {'a':(4)2}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'x'}", LOCAL),
    ("mesh['x'=2,'y'=4], device_ids=([2,2,2]T(1,0,2)) {'y':(2)2}",
     ((0, 1), (4, 5), (2, 3), (6, 7))),
    # The same pairs as jax 0.12's XLA spells them: the program's mesh, no device_ids.
    ("mesh['node'=2,'local'=4] {'local':(2)2}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['x'=2,'y'=4], device_ids=(0,1,4,5,2,3,6,7) {'x'}", ((0, 2), (1, 3), (4, 6), (5, 7))),
])
def test_mesh_axes_replica_groups(text, groups):
    assert hlo.parse_replica_groups(text) == groups


def test_iota_sharding_of_a_real_program_matches_jax_placement(mesh):
    """The iota `devices=[4,2]<=[2,4]T(1,0)` that XLA prints for P("local","node") puts, at
    tile (i, j), the position in mesh.devices.flat of the device JAX gives block (i, j).

    Read from the program's HLO as JAX hands it to XLA (`dialect="hlo"`, before partitioning):
    both jax 0.10 and 0.12 print the parameter's sharding there. The compiled (partitioned)
    program of jax 0.10 repeats it on its per-device parameter; 0.12's does not."""
    sharding = NamedSharding(mesh, P(LOCAL_AXIS, NODE_AXIS))
    text = jax.jit(lambda a: a * 2, in_shardings=sharding).lower(X).as_text(dialect="hlo")
    module = hlo.parse_module(text)
    [param] = [i for i in module.computations[module.entry].instructions
               if i.opcode == "parameter"]
    assert param.attrs["sharding"] == "{devices=[4,2]<=[2,4]T(1,0)}"
    tiles = hlo.iota_array((4, 2), (2, 4), (1, 0))
    flat = list(mesh.devices.flat)
    for device, index in sharding.devices_indices_map(X.shape).items():
        i, j = index[0].start // 8, index[1].start // 8
        assert flat[tiles[i, j]] == device


# -- shard_map collectives ----------------------------------------------------------------------


CASES = {
    "all_gather node+local": (lambda a: lax.all_gather(a, DATA_AXES, tiled=True),
                              P(DATA_AXES), P(), "all-gather", ALL, BLOCK, 8 * BLOCK),
    "all_gather local": (lambda a: lax.all_gather(a, LOCAL_AXIS, tiled=True),
                         P(DATA_AXES), P(NODE_AXIS), "all-gather", LOCAL, BLOCK, 4 * BLOCK),
    "all_gather node": (lambda a: lax.all_gather(a, NODE_AXIS, tiled=True),
                        P(DATA_AXES), P(LOCAL_AXIS), "all-gather", NODE, BLOCK, 2 * BLOCK),
    "psum_scatter": (lambda a: lax.psum_scatter(a, DATA_AXES, tiled=True),
                     P(), P(DATA_AXES), "reduce-scatter", ALL, 8 * BLOCK, BLOCK),
    "psum local": (lambda a: lax.psum(a, LOCAL_AXIS), P(DATA_AXES), P(DATA_AXES),
                   "all-reduce", LOCAL, BLOCK, BLOCK),
    "all_to_all local": (lambda a: lax.all_to_all(a, LOCAL_AXIS, 0, 0, tiled=True),
                         P(DATA_AXES), P(DATA_AXES), "all-to-all", LOCAL, BLOCK, BLOCK),
}


@pytest.mark.parametrize("case", CASES)
def test_shard_map_collective(mesh, case):
    fn, in_spec, out_spec, kind, groups, operand_bytes, result_bytes = CASES[case]
    c = only(hlo.collectives(shard_mapped(mesh, fn, in_spec, out_spec).lower(X).compile()))
    assert (c.kind, c.device_groups, c.replica_groups) == (kind, groups, groups)
    assert (c.operand_bytes, c.result_bytes) == (operand_bytes, result_bytes)
    assert c.payload_bytes == max(operand_bytes, result_bytes)
    assert c.multiplier == 1 and not c.is_async
    assert c.computation.startswith("main")


def test_all_to_all_is_tuple_shaped(mesh):
    fn, in_spec, out_spec, *_ = CASES["all_to_all local"]
    c = only(hlo.collectives(shard_mapped(mesh, fn, in_spec, out_spec).lower(X).compile()))
    assert tuple(map(str, c.operands)) == ("f32[1,16]",) * 4
    assert tuple(map(str, c.results)) == ("f32[1,16]",) * 4
    assert c.group_mode == "cross_partition"  # no use_global_device_ids on all-to-all


def test_ppermute_pairs(mesh):
    ring = [(i, (i + 1) % 4) for i in range(4)]
    fn = shard_mapped(mesh, lambda a: lax.ppermute(a, LOCAL_AXIS, ring), P(DATA_AXES),
                      P(DATA_AXES))
    c = only(hlo.collectives(compiled_text(fn, X)))
    assert c.kind == "collective-permute"
    assert c.device_pairs == c.source_target_pairs == (
        (0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4))
    assert c.payload_bytes == BLOCK and c.device_groups == ()


def test_op_name_comes_from_metadata(mesh):
    def gather(a):
        with jax.named_scope("zero_fwd_gather"):
            return lax.all_gather(a, DATA_AXES, tiled=True)

    c = only(hlo.collectives(compiled_text(shard_mapped(mesh, gather, P(DATA_AXES), P()), X)))
    assert c.op_name == "jit(gather)/shard_map/zero_fwd_gather/all_gather"


def test_groups_are_mesh_positions_not_device_ids(devices):
    """With the devices of the mesh shuffled, the HLO still names positions 0..7 of
    mesh.devices.flat, and executing it gathers exactly over those positions."""
    mesh = make_mesh(2, 4, devices=[devices[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)])
    fn = shard_mapped(mesh, lambda a: lax.all_gather(a, LOCAL_AXIS, tiled=True), P(DATA_AXES),
                      P(NODE_AXIS))
    x = jnp.arange(8.0)
    c = only(hlo.collectives(fn.lower(x).compile()))
    assert c.device_groups == LOCAL
    flat = list(mesh.devices.flat)
    for shard in fn(x).addressable_shards:
        position = flat.index(shard.device)
        group = next(g for g in c.device_groups if position in g)
        np.testing.assert_array_equal(shard.data, np.asarray(group, dtype=np.float32))


def test_collectives_from_the_spmd_partitioner_use_mesh_axes_form(mesh):
    """jit with shardings (no shard_map): XLA prints mesh-axes groups, and the decoded groups
    agree with what executing the resharding P("local","node") -> P("node","local") does.

    The partitioner runs it as an all-to-all within pairs of devices, then a collective-permute.
    jax 0.10 prints the all-to-all's groups as `mesh['axis_0'=2,'axis_1'=4],
    device_ids=([2,2,2]T(1,0,2)) {'axis_1':(2)2}`, i.e. ((0,1),(4,5),(2,3),(6,7)); jax 0.12 as
    `mesh['node'=2,'local'=4] {'local':(2)2}`, the same pairs listed ((0,1),(2,3),(4,5),(6,7)).
    The order of the groups means nothing to XLA, so the check is where the data goes: the
    devices whose blocks end on device t are the all-to-all group of t's permute source."""
    in_sharding = NamedSharding(mesh, P(LOCAL_AXIS, NODE_AXIS))
    fn = jax.jit(lambda a: a * 2, in_shardings=in_sharding,
                 out_shardings=NamedSharding(mesh, P(NODE_AXIS, LOCAL_AXIS)))
    text = compiled_text(fn, X)
    assert "replica_groups=mesh[" in text
    all_to_all, permute = hlo.collectives(text)            # in the scheduled program's order
    assert (all_to_all.kind, permute.kind) == ("all-to-all", "collective-permute")
    assert all_to_all.operand_bytes == X.nbytes // 8            # each device's whole block
    flat = list(mesh.devices.flat)
    owner = np.zeros(X.shape, np.float32)   # owner[r, c]: the position holding X[r, c]
    for device, index in in_sharding.devices_indices_map(X.shape).items():
        owner[index] = flat.index(device)
    received = {flat.index(shard.device): set(np.asarray(shard.data).astype(int).ravel() // 2)
                for shard in fn(owner).addressable_shards}
    group_of = {p: set(group) for group in all_to_all.device_groups for p in group}
    assert sorted(group_of) == list(range(8)) and len(all_to_all.device_groups) == 4
    assert sorted(t for _, t in permute.device_pairs) == list(range(8))
    assert {t: group_of[s] for s, t in permute.device_pairs} == received

    summed = jax.jit(lambda a: a.sum(0), in_shardings=NamedSharding(mesh, P(LOCAL_AXIS, NODE_AXIS)),
                     out_shardings=NamedSharding(mesh, P()))
    reduce = next(c for c in hlo.collectives(compiled_text(summed, X)) if c.kind == "all-reduce")
    assert reduce.device_groups == LOCAL  # the sum runs over the dim sharded by "local"


# -- loops: multipliers -------------------------------------------------------------------------


def scan_of_gathers(a):
    def body(carry, _):
        return carry + lax.all_gather(carry, DATA_AXES, tiled=True)[:4], None
    return lax.scan(body, a, None, length=5)[0]


def nested_scans(a):
    def inner(carry, _):
        return carry + lax.all_gather(carry, LOCAL_AXIS, tiled=True)[:4], None

    def outer(carry, _):
        return lax.scan(inner, carry, None, length=4)[0], None
    return lax.scan(outer, a, None, length=3)[0]


def fori_of_psums(a):
    return lax.fori_loop(0, 6, lambda i, c: c + lax.psum(c, NODE_AXIS), a)


LOOPS = {"scan": (scan_of_gathers, "all-gather", 5, 8 * BLOCK),
         "nested scan": (nested_scans, "all-gather", 12, 4 * BLOCK),
         "fori_loop": (fori_of_psums, "all-reduce", 6, BLOCK)}


@pytest.fixture(scope="module")
def loop_texts(mesh):
    return {name: compiled_text(shard_mapped(mesh, fn, P(DATA_AXES), P(DATA_AXES)), X)
            for name, (fn, *_) in LOOPS.items()}


@pytest.mark.parametrize("loop", LOOPS)
def test_loop_multiplier(loop_texts, loop):
    _, kind, multiplier, payload = LOOPS[loop]
    assert '"known_trip_count"' in loop_texts[loop]
    c = only(hlo.collectives(loop_texts[loop]))
    assert (c.kind, c.multiplier, c.payload_bytes) == (kind, multiplier, payload)
    assert "/while/body/" in c.op_name and not c.computation.startswith("main")


@pytest.mark.parametrize("loop", LOOPS)
def test_trip_count_inferred_from_condition_without_backend_config(loop_texts, loop):
    text = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", loop_texts[loop])
    assert "known_trip_count" not in text
    assert only(hlo.collectives(text)).multiplier == LOOPS[loop][2]


def test_dynamic_trip_count_raises(mesh):
    def dynamic(a, n):
        return lax.fori_loop(0, n[0], lambda i, c: c + lax.psum(c, NODE_AXIS), a)

    fn = shard_mapped(mesh, dynamic, (P(DATA_AXES), P()), P(DATA_AXES))
    text = compiled_text(fn, X, jnp.array([3]))
    with pytest.raises(hlo.UnknownTripCountError, match="known_trip_count"):
        hlo.collectives(text)


def test_dynamic_loop_without_collectives_is_fine(mesh):
    def dynamic(a, n):
        a = lax.fori_loop(0, n[0], lambda i, c: c * 2, a)
        return lax.psum(a, NODE_AXIS)

    fn = shard_mapped(mesh, dynamic, (P(DATA_AXES), P()), P(DATA_AXES))
    assert only(hlo.collectives(compiled_text(fn, X, jnp.array([3])))).multiplier == 1


# -- hand-written modules: async pairs and the call graph ---------------------------------------

ASYNC_HLO = """\
HloModule async_collectives, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_all_to_all (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%p), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, metadata={op_name="jit(f)/zero_grad_reduce/all_to_all"}
}

ENTRY %main (param: f32[2,16]) -> (f32[16,16], f32[2,16], f32[2,16], f32[8,16], f32[2,16]) {
  %param = f32[2,16]{1,0} parameter(0)
  %ag-start = (f32[2,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%param), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/zero_fwd_gather/all_gather"}
  %ag-done = f32[16,16]{1,0} all-gather-done(%ag-start)
  %ar-start = f32[2,16]{1,0} all-reduce-start(%param), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ar-done = f32[2,16]{1,0} all-reduce-done(%ar-start)
  %rs-start = ((f32[16,16]{1,0}), f32[2,16]{1,0}) reduce-scatter-start(%ag-done), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %rs-update = ((f32[16,16]{1,0}), f32[2,16]{1,0}) reduce-scatter-update(%rs-start)
  %rs-done = f32[2,16]{1,0} reduce-scatter-done(%rs-update)
  %a2a-in = f32[8,16]{1,0} slice(%ag-done), slice={[0:8], [0:16]}
  %a2a-start = ((f32[8,16]{1,0}), f32[8,16]{1,0}) async-start(%a2a-in), calls=%wrapped_all_to_all
  %a2a-done = f32[8,16]{1,0} async-done(%a2a-start), calls=%wrapped_all_to_all
  %cp-start = (f32[2,16]{1,0}, f32[2,16]{1,0}, u32[], u32[]) collective-permute-start(%param), channel_id=5, source_target_pairs={{0,4},{4,0}}
  %cp-done = f32[2,16]{1,0} collective-permute-done(%cp-start)
  ROOT %out = (f32[16,16]{1,0}, f32[2,16]{1,0}, f32[2,16]{1,0}, f32[8,16]{1,0}, f32[2,16]{1,0}) tuple(%ag-done, %ar-done, %rs-done, %a2a-done, %cp-done)
}
"""

EXPECTED_ASYNC = {  # kind: (operand bytes, result bytes, device groups or pairs)
    "all-gather": (128, 1024, ALL),
    "all-reduce": (128, 128, NODE),
    "reduce-scatter": (1024, 128, ALL),
    "all-to-all": (512, 512, LOCAL),
    "collective-permute": (128, 128, ((0, 4), (4, 0))),
}


def reparsed_by_xla(text):
    """`text` parsed and printed back by XLA (which sugars async-start into all-to-all-start)."""
    try:
        from jax._src.lib import xla_client

        return xla_client.hlo.hlo_module_from_text(text).to_string()
    except (ImportError, AttributeError) as error:
        pytest.skip(f"jax internals moved: {error}")


@pytest.mark.parametrize("printer", ["hand-written", "xla"])
def test_async_pairs_count_once(printer):
    text = ASYNC_HLO if printer == "hand-written" else reparsed_by_xla(ASYNC_HLO)
    found = hlo.collectives(text)
    assert sorted(c.kind for c in found) == sorted(EXPECTED_ASYNC)
    for c in found:
        operand_bytes, result_bytes, ids = EXPECTED_ASYNC[c.kind]
        assert (c.operand_bytes, c.result_bytes) == (operand_bytes, result_bytes), c
        assert (c.device_pairs or c.device_groups) == ids
        assert c.is_async and c.multiplier == 1
    by_kind = {c.kind: c for c in found}
    assert by_kind["all-gather"].op_name == "jit(f)/zero_fwd_gather/all_gather"
    assert by_kind["all-gather"].payload_bytes == 1024


CALLS_HLO = """\
HloModule call_graph, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%shared (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  ROOT %shared-ar = f32[4]{0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
}

%body (state: (s32[], f32[4])) -> (s32[], f32[4]) {
  %state = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %v = f32[4]{0} get-tuple-element(%state), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %called = f32[4]{0} call(%v), to_apply=%shared
  ROOT %out = (s32[], f32[4]{0}) tuple(%next, %called)
}

%cond (state.1: (s32[], f32[4])) -> pred[] {
  %state.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

%then (t: f32[4]) -> f32[4] {
  %t = f32[4]{0} parameter(0)
  ROOT %then-cp = f32[4]{0} collective-permute(%t), channel_id=2, source_target_pairs={{0,1}}
}

%else (e: f32[4]) -> f32[4] {
  %e = f32[4]{0} parameter(0)
  ROOT %else-neg = f32[4]{0} negate(%e)
}

%unused (u: f32[4]) -> f32[4] {
  %u = f32[4]{0} parameter(0)
  ROOT %unused-ar = f32[4]{0} all-reduce(%u), channel_id=3, replica_groups={}, use_global_device_ids=true, to_apply=%add
}

ENTRY %main (p: f32[4], flag: pred[]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %flag = pred[] parameter(1)
  %first = f32[4]{0} call(%p), to_apply=%shared
  %second = f32[4]{0} call(%first), to_apply=%shared
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %second)
  %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %looped = f32[4]{0} get-tuple-element(%loop), index=1
  ROOT %branch = f32[4]{0} conditional(%flag, %looped, %looped), true_computation=%then, false_computation=%else
}
"""


def test_call_graph_multipliers():
    """%shared runs twice from ENTRY and 3 times from the loop body: one instruction, 5 runs.
    A conditional branch counts once; a computation nobody calls does not count."""
    reparsed_by_xla(CALLS_HLO)  # the text is valid HLO
    found = {c.name: c for c in hlo.collectives(CALLS_HLO)}
    assert set(found) == {"shared-ar", "then-cp"}
    assert found["shared-ar"].multiplier == 5
    assert found["then-cp"].multiplier == 1


def test_group_modes_map_to_flattened_ids():
    # pmap-style: 8 replicas, 1 partition, no channel_id -> ids are replica ids.
    text = CALLS_HLO.replace("num_partitions=8", "replica_count=8").replace(
        "channel_id=1, ", "").replace(", use_global_device_ids=true, to_apply=%add\n}\n\n%body",
                                      ", to_apply=%add\n}\n\n%body")
    shared = next(c for c in hlo.collectives(text) if c.name == "shared-ar")
    assert shared.group_mode == "cross_replica" and shared.device_groups == ALL
    # 2 replicas x 4 partitions, channel_id without use_global_device_ids: replica groups.
    text = CALLS_HLO.replace("num_partitions=8", "num_partitions=4, replica_count=2").replace(
        "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true",
        "replica_groups={{0},{1}}")
    shared = next(c for c in hlo.collectives(text) if c.name == "shared-ar")
    assert shared.group_mode == "cross_replica_and_partition"
    assert shared.device_groups == LOCAL


def test_not_hlo_raises():
    with pytest.raises(hlo.HloParseError, match="HloModule"):
        hlo.collectives("module @main { func.func @f() }")
