"""`comm_report` on the 2-node x 4-local mesh: exact per-device bytes, phases, and inputs.

x: f32[32,16] sharded over ("node","local") is a f32[4,16] block of B = 256 bytes per device.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from zeroxla.analysis import hlo
from zeroxla.analysis.comm_report import OTHER, comm_report, phase_of
from zeroxla.sharding.mesh import DATA_AXES, LOCAL_AXIS, NODE_AXIS, make_mesh

B = 4 * 16 * 4
X = jnp.ones((32, 16), jnp.float32)


@pytest.fixture(scope="module")
def mesh(devices):
    return make_mesh(2, 4)


def shard_mapped(mesh, fn, in_specs=P(DATA_AXES), out_specs=P(DATA_AXES)):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))


# -- intra / cross split: exact numbers ---------------------------------------------------------

# name: (fn, in_spec, out_spec, kind, payload S, intra bytes per device, cross bytes per device)
SPLITS = {
    # S = 4B over the 4 devices of a node: 3 peers x S/4, all intra-node.
    "all_gather local": (lambda a: lax.all_gather(a, LOCAL_AXIS, tiled=True), P(DATA_AXES),
                         P(NODE_AXIS), "all-gather", 4 * B, 3 * B, 0),
    # S = 8B over all 8: S/8 to 3 peers in the node and to 4 peers on the other node.
    "all_gather node+local": (lambda a: lax.all_gather(a, DATA_AXES, tiled=True), P(DATA_AXES),
                              P(), "all-gather", 8 * B, 3 * B, 4 * B),
    "all_gather node": (lambda a: lax.all_gather(a, NODE_AXIS, tiled=True), P(DATA_AXES),
                        P(LOCAL_AXIS), "all-gather", 2 * B, 0, B),
    "psum_scatter node+local": (lambda a: lax.psum_scatter(a, DATA_AXES, tiled=True), P(),
                                P(DATA_AXES), "reduce-scatter", 8 * B, 3 * B, 4 * B),
    # An all-reduce counts twice: 2 x S/g x (g-1).
    "psum local": (lambda a: lax.psum(a, LOCAL_AXIS), P(DATA_AXES), P(DATA_AXES), "all-reduce",
                   B, 2 * B * 3 / 4, 0),
    "psum node": (lambda a: lax.psum(a, NODE_AXIS), P(DATA_AXES), P(DATA_AXES), "all-reduce",
                  B, 0, 2 * B / 2),
    "psum node+local": (lambda a: lax.psum(a, DATA_AXES), P(DATA_AXES), P(DATA_AXES),
                        "all-reduce", B, 2 * B * 3 / 8, 2 * B * 4 / 8),
    "all_to_all local": (lambda a: lax.all_to_all(a, LOCAL_AXIS, 0, 0, tiled=True),
                         P(DATA_AXES), P(DATA_AXES), "all-to-all", B, 3 * B / 4, 0),
    "all_to_all node+local": (lambda a: lax.all_to_all(a, DATA_AXES, 1, 1, tiled=True),
                              P(DATA_AXES), P(DATA_AXES), "all-to-all", B, 3 * B / 8,
                              4 * B / 8),
    "ppermute local ring": (lambda a: lax.ppermute(a, LOCAL_AXIS,
                                                   [(i, (i + 1) % 4) for i in range(4)]),
                            P(DATA_AXES), P(DATA_AXES), "collective-permute", B, B, 0),
    "ppermute to other node": (lambda a: lax.ppermute(a, DATA_AXES,
                                                      [(i, (i + 4) % 8) for i in range(8)]),
                               P(DATA_AXES), P(DATA_AXES), "collective-permute", B, 0, B),
}


@pytest.mark.parametrize("case", SPLITS)
def test_intra_cross_split(mesh, case):
    fn, in_spec, out_spec, kind, payload, intra, cross = SPLITS[case]
    report = comm_report(shard_mapped(mesh, fn, in_spec, out_spec), X, mesh=mesh)
    assert [c.kind for c in report.collectives] == [kind]
    assert report.payload_bytes(kind) == payload
    assert (report.intra_node_bytes, report.cross_node_bytes) == (intra, cross)
    traffic = report.bytes_by_kind[kind]
    assert (traffic.intra_node, traffic.cross_node, traffic.total) == (intra, cross, intra + cross)
    # Every device sends the same here, so the busiest one sends the average.
    assert traffic.max_total == intra + cross
    assert report.bytes_by_phase[OTHER] == traffic


def test_average_and_max_differ_when_few_devices_send(mesh):
    """ppermute (0 -> 1) within each node: 2 of 8 devices send B."""
    fn = shard_mapped(mesh, lambda a: lax.ppermute(a, LOCAL_AXIS, [(0, 1)]))
    traffic = comm_report(fn, X, mesh=mesh).traffic()
    assert (traffic.intra_node, traffic.max_intra_node, traffic.max_total) == (B / 4, B, B)
    assert traffic.cross_node == traffic.max_cross_node == 0


def test_loop_iterations_multiply(mesh):
    def scan_of_gathers(a):
        def body(carry, _):
            return carry + lax.all_gather(carry, DATA_AXES, tiled=True)[:4], None
        return lax.scan(body, a, None, length=5)[0]

    report = comm_report(shard_mapped(mesh, scan_of_gathers), X, mesh=mesh)
    assert report.count("all-gather") == 5
    assert report.all_gather_bytes() == 5 * 8 * B
    assert (report.intra_node_bytes, report.cross_node_bytes) == (5 * 3 * B, 5 * 4 * B)


def test_split_uses_mesh_positions_when_devices_are_shuffled(devices):
    mesh = make_mesh(2, 4, devices=[devices[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)])
    fn, in_spec, out_spec, *_ = SPLITS["all_gather local"]
    report = comm_report(shard_mapped(mesh, fn, in_spec, out_spec), X, mesh=mesh)
    assert (report.intra_node_bytes, report.cross_node_bytes) == (3 * B, 0)


def test_mesh_without_node_axis_is_all_intra_node(devices):
    flat = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    fn = jax.jit(jax.shard_map(lambda a: lax.all_gather(a, "data", tiled=True), mesh=flat,
                               in_specs=P("data"), out_specs=P(), check_vma=False))
    report = comm_report(fn, X, mesh=flat)
    assert (report.intra_node_bytes, report.cross_node_bytes) == (7 * B, 0)


# -- phases: named_scope names in op_name -------------------------------------------------------


@pytest.mark.parametrize("op_name, phase", [
    ("jit(step)/shard_map/jvp(zero_fwd_gather)/all_gather", "zero_fwd_gather"),
    ("jit(step)/transpose(jvp(zero_fwd_gather))/zero_grad_reduce/reduce_scatter",
     "zero_grad_reduce"),
    ("jit(step)/transpose(jvp(zero_fwd_gather))/zero_bwd_gather/all_gather", "zero_bwd_gather"),
    ("jit(step)/zero_param_update/psum", "zero_param_update"),
    ("jit(step)/zero_fwd_gathered/all_gather", OTHER),
    ("", OTHER),
])
def test_phase_of(op_name, phase):
    assert phase_of(op_name) == phase


AX = DATA_AXES
LAYERS, D = 3, 16
PARAM_BYTES = LAYERS * D * D * 4  # W: f32[3,16,16], sharded to f32[3,2,16] per device


@jax.custom_vjp
def zero3_layer(w, h):
    """tanh(h @ W) with W gathered in forward and re-gathered in backward (ZeRO-3)."""
    with jax.named_scope("zero_fwd_gather"):
        full = lax.all_gather(w, AX, tiled=True)  # [D, D]
    return jnp.tanh(h @ full)


def _layer_fwd(w, h):
    y = zero3_layer(w, h)
    return y, (w, h, y)


def _layer_bwd(residuals, dy):
    w, h, y = residuals
    dz = dy * (1 - y**2)
    with jax.named_scope("zero_bwd_gather"):
        full = lax.all_gather(w, AX, tiled=True)
    with jax.named_scope("zero_grad_reduce"):
        dw = lax.psum_scatter(h.T @ dz, AX, tiled=True)
    return dw, dz @ full.T


zero3_layer.defvjp(_layer_fwd, _layer_bwd)


def zero3_step(w, x):
    def loss(w):
        h, _ = lax.scan(lambda h, wi: (zero3_layer(wi, h), None), x, w)
        return jnp.sum(h**2)

    grads = jax.grad(loss)(w)
    with jax.named_scope("zero_param_update"):
        norm = lax.psum(jnp.sum(grads**2), AX)
    return w - 0.1 * grads / jnp.sqrt(norm)


@pytest.fixture(scope="module")
def zero3_report(mesh):
    step = shard_mapped(mesh, zero3_step, (P(None, AX), P(AX)), P(None, AX))
    return comm_report(step, jnp.ones((LAYERS, D, D)), jnp.ones((16, D)), mesh=mesh)


def test_named_scopes_reach_op_name_inside_scan_and_custom_vjp(zero3_report):
    phases = {(c.kind, phase_of(c.op_name)): c for c in zero3_report.collectives}
    assert set(phases) == {("all-gather", "zero_fwd_gather"), ("all-gather", "zero_bwd_gather"),
                           ("reduce-scatter", "zero_grad_reduce"),
                           ("all-reduce", "zero_param_update")}
    backward = phases[("reduce-scatter", "zero_grad_reduce")].op_name
    assert "transpose(jvp(" in backward and "/while/body/" in backward
    assert phases[("all-gather", "zero_fwd_gather")].multiplier == LAYERS
    assert phases[("all-gather", "zero_bwd_gather")].multiplier == LAYERS


def test_zero3_payload_is_two_gathers_and_one_scatter_of_the_parameters(zero3_report):
    assert zero3_report.all_gather_bytes() == 2 * PARAM_BYTES
    assert zero3_report.all_gather_bytes("zero_fwd_gather") == PARAM_BYTES
    assert zero3_report.all_gather_bytes("zero_bwd_gather") == PARAM_BYTES
    assert zero3_report.reduce_scatter_bytes() == PARAM_BYTES
    assert zero3_report.reduce_scatter_bytes("zero_grad_reduce") == PARAM_BYTES
    assert zero3_report.all_reduce_bytes("zero_param_update") == 4
    by_phase = zero3_report.bytes_by_phase
    assert list(by_phase) == ["zero_fwd_gather", "zero_bwd_gather", "zero_grad_reduce",
                              "zero_param_update"]
    # Each gather of S = PARAM_BYTES over 8 devices: S/8 to 3 intra and 4 cross peers.
    assert by_phase["zero_fwd_gather"].intra_node == PARAM_BYTES / 8 * 3
    assert by_phase["zero_fwd_gather"].cross_node == PARAM_BYTES / 8 * 4


def test_remat_regather_keeps_the_forward_scope(mesh):
    """Under jax.checkpoint, the backward recomputes the forward gather, and its op_name keeps
    the forward's scope (with `rematted_computation`): the engine must gather explicitly under
    "zero_bwd_gather" (as in a custom_vjp) for the backward gather to be classified as such."""
    def step(w, x):
        def layer(h, wi):
            with jax.named_scope("zero_fwd_gather"):
                full = lax.all_gather(wi, AX, tiled=True)
            return jnp.tanh(h @ full), None

        return jax.grad(lambda w: jnp.sum(lax.scan(jax.checkpoint(layer), x, w)[0]))(w)

    fn = shard_mapped(mesh, step, (P(None, AX), P(AX)), P(None, AX))
    report = comm_report(fn, jnp.ones((LAYERS, D, D)), jnp.ones((16, D)), mesh=mesh)
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert [phase_of(c.op_name) for c in gathers] == ["zero_fwd_gather"] * 2
    assert sum("rematted_computation" in c.op_name for c in gathers) == 1


# -- inputs and outputs -------------------------------------------------------------------------


class Step:
    """An object with `.lower(*args)` that is not a jitted function (a ZeroStep's mesh comes
    from its layout: test_zero3_communication)."""

    def __init__(self, fn):
        self.fn = fn

    def lower(self, *args):
        return self.fn.lower(*args)


def test_accepts_step_lowered_compiled_and_text(mesh):
    fn, in_spec, out_spec, *_ = SPLITS["all_gather node+local"]
    jitted = shard_mapped(mesh, fn, in_spec, out_spec)
    compiled = jitted.lower(X).compile()
    reports = [comm_report(Step(jitted), X, mesh=mesh), comm_report(jitted.lower(X), mesh=mesh),
               comm_report(compiled, mesh=mesh), comm_report(compiled.as_text(), mesh=mesh)]
    for report in reports:
        assert report.to_dict() == reports[0].to_dict()


def test_needs_the_mesh_it_was_compiled_for(mesh, devices):
    fn, in_spec, out_spec, *_ = SPLITS["all_gather local"]
    compiled = shard_mapped(mesh, fn, in_spec, out_spec).lower(X).compile()
    with pytest.raises(ValueError, match="mesh"):
        comm_report(compiled)
    # (make_mesh orders devices by process and id, so the reversed mesh is built directly)
    shuffled = jax.sharding.Mesh(np.asarray(devices[::-1], dtype=object).reshape(2, 4),
                                 (NODE_AXIS, LOCAL_AXIS))
    with pytest.raises(ValueError, match="compiled for devices"):
        comm_report(compiled, mesh=shuffled)
    with pytest.raises(ValueError, match="names device 7"):
        comm_report(compiled.as_text(), mesh=make_mesh(1, 4, devices=devices[:4]))


def test_to_dict_and_table(zero3_report):
    as_dict = json.loads(json.dumps(zero3_report.to_dict()))
    assert as_dict["devices"] == 8 and as_dict["mesh"] == {"node": 2, "local": 4}
    assert as_dict["payload_bytes"]["all-gather"] == 2 * PARAM_BYTES
    assert as_dict["total"]["cross_node"] == zero3_report.cross_node_bytes
    assert len(as_dict["collectives"]) == 4

    table = zero3_report.table()
    print(table)
    rows = table.splitlines()[1:]
    assert len({len(row) for row in rows}) == 1  # fixed width
    assert [row.split()[0] for row in rows[2:-2]] == [
        "zero_fwd_gather", "zero_bwd_gather", "zero_grad_reduce", "zero_param_update"]
    assert rows[-1].startswith("total")


def test_report_rejects_unknown_names(zero3_report):
    with pytest.raises(ValueError, match="kind"):
        zero3_report.payload_bytes("all_gather")
    with pytest.raises(ValueError, match="phase"):
        zero3_report.traffic(phase="forward")


def test_collectives_are_the_raw_records(zero3_report):
    assert all(isinstance(c, hlo.Collective) for c in zero3_report.collectives)
    assert np.isclose(zero3_report.total_bytes,
                      zero3_report.intra_node_bytes + zero3_report.cross_node_bytes)
