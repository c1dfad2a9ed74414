"""The per-stack forward/backward with explicit residuals (what the pipeline executor calls per
micro-batch) equals `jax.vjp` of the plain, unsharded layer loop.

Inside `shard_map` on 2 x 4 devices each device holds its batch rows and a padded 1/8 of every
layer's weights; `GatheredStack.forward` gathers a layer at a time and returns residuals,
`GatheredStack.backward` re-gathers, differentiates and reduce-scatters. The reference is
`jax.vjp` of the same layers written with whole arrays on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from zeroxla.collectives.zero import ZeroCollectives
from zeroxla.engine.gather import GatheredStack
from zeroxla.sharding.mesh import MeshAxes, make_mesh
from zeroxla.sharding.plan import make_plan

L, B, D = 3, 16, 12          # 12 does not divide 8: the weights are padded when partitioned


def layer(full, carry, consts, x_i):
    """carry [b, D] -> tanh(carry @ w + b) * scale + x_i; y_i = per-row sum of the new carry."""
    w, b = full
    new = jnp.tanh(carry @ w + b) * consts["scale"] + x_i
    return new, new.sum(axis=-1)                                  # y_i [b]


def reference(w, b, carry, consts, xs):
    ys = []
    for i in range(L):
        carry, y = layer((w[i], b[i]), carry, consts, xs[i])
        ys.append(y)
    return carry, jnp.stack(ys)


def stack_plan():
    """(a 2 x 4 mesh, its axes, the stacked leaves w [L, D, D] and b [L, D] at stage 3, every
    leaf partitioned)."""
    mesh = make_mesh(2, 4)
    axes = MeshAxes.of(mesh)
    plan = make_plan({"w": (L, D, D), "b": (L, D)},
                     {"w": ("layers", "embed", "mlp"), "b": ("layers", "mlp")},
                     stage=3, axes=axes, persistence_threshold=0)
    return mesh, axes, (plan["w"], plan["b"])


def inputs(seed):
    """w [L, D, D], b [L, D], the carry [B, D], consts, xs [L, B, D] and the cotangents of the
    carry [B, D] and ys [L, B], drawn from `seed`."""
    keys = jax.random.split(jax.random.key(seed), 6)
    return (jax.random.normal(keys[0], (L, D, D)) / np.sqrt(D),
            jax.random.normal(keys[1], (L, D)) * 0.1, jax.random.normal(keys[2], (B, D)),
            {"scale": jnp.float32(0.7)}, jax.random.normal(keys[3], (L, B, D)) * 0.1,
            jax.random.normal(keys[4], (B, D)), jax.random.normal(keys[5], (L, B)))


def test_stack_forward_backward_equal_vjp_of_the_unsharded_loop():
    mesh, axes, leaves = stack_plan()
    assert all(leaf.params_partitioned and leaf.padded_size == 16 for leaf in leaves)
    stack = GatheredStack(layer, leaves, ZeroCollectives(axes), prefetch=True)

    w, b, carry, consts, xs, d_carry, d_ys = inputs(0)

    data = P(axes.data)
    rows = P(None, axes.data)

    def run(shards, carry, consts, xs, d_carry, d_ys):
        out_carry, ys, residuals = stack.forward(list(shards), carry, consts, xs)
        d_shards, d_carry_in, d_consts, d_xs = stack.backward(residuals, d_carry, d_ys)
        d_consts = jax.tree.map(lambda g: lax.psum(g, axes.data), d_consts)
        return out_carry, ys, tuple(d_shards), d_carry_in, d_consts, d_xs

    specs = tuple(leaf.param_spec for leaf in leaves)
    sharded = jax.jit(jax.shard_map(
        run, mesh=mesh, in_specs=(specs, data, P(), rows, data, rows),
        out_specs=(data, rows, specs, data, P(), rows), check_vma=False))
    stored = (leaves[0].pad(w), leaves[1].pad(b))
    out_carry, ys, d_shards, d_carry_in, d_consts, d_xs = sharded(
        stored, carry, consts, xs, d_carry, d_ys)

    @jax.jit                                                      # one program, not op by op
    def reference_vjp(w, b, carry, consts, xs, d_carry, d_ys):
        outputs, vjp = jax.vjp(reference, w, b, carry, consts, xs)
        return outputs, vjp((d_carry, d_ys))

    (want_carry, want_ys), (dw, db, dc, dk, dx) = reference_vjp(w, b, carry, consts, xs,
                                                                d_carry, d_ys)
    np.testing.assert_allclose(out_carry, want_carry, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ys, want_ys, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(leaves[0].unpad(d_shards[0]), dw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(leaves[1].unpad(d_shards[1]), db, rtol=1e-4, atol=1e-5)
    padding = lax.slice_in_dim(d_shards[0], D, None, axis=leaves[0].shard_dim)
    assert float(jnp.abs(padding).max()) == 0.0        # the pad rows get no gradient
    np.testing.assert_allclose(d_carry_in, dc, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_consts["scale"], dk["scale"], rtol=1e-4)
    np.testing.assert_allclose(d_xs, dx, rtol=1e-4, atol=1e-5)


def counted_layer(full, carry, consts, x_i):
    """`layer` on a carry {"h": [b, D], "layer": int32 counter, "cache": None}: an integer leaf
    (no cotangent, float0 from autodiff) and an empty optional field (no leaf at all)."""
    h, y = layer(full, carry["h"], consts, x_i)
    return {"h": h * (1.0 + 0.1 * carry["layer"]), "layer": carry["layer"] + 1,
            "cache": carry["cache"]}, y


def test_a_carry_with_a_counter_and_an_empty_field_differentiates_as_the_unsharded_loop():
    """The backward hands each layer the float0 cotangent of the counter and keeps the empty
    field empty: the gradients equal `jax.vjp` of the same loop on one device."""
    mesh, axes, leaves = stack_plan()
    stack = GatheredStack(counted_layer, leaves, ZeroCollectives(axes), prefetch=True)
    w, b, h, consts, xs, d_h, d_ys = inputs(1)

    def run(shards, h, consts, xs, d_h, d_ys):
        carry = {"h": h, "layer": jnp.int32(0), "cache": None}
        out, ys, residuals = stack.forward(list(shards), carry, consts, xs)
        d_out = {"h": d_h, "layer": np.zeros((), jax.dtypes.float0), "cache": None}
        d_shards, d_carry, _, _ = stack.backward(residuals, d_out, d_ys)
        return out["h"], out["layer"], ys, tuple(d_shards), d_carry["h"]

    data, rows = P(axes.data), P(None, axes.data)
    specs = tuple(leaf.param_spec for leaf in leaves)
    sharded = jax.jit(jax.shard_map(
        run, mesh=mesh, in_specs=(specs, data, P(), rows, data, rows),
        out_specs=(data, P(), rows, specs, data), check_vma=False))
    out_h, count, ys, d_shards, d_h_in = sharded((leaves[0].pad(w), leaves[1].pad(b)), h,
                                                 consts, xs, d_h, d_ys)

    def unsharded(w, b, h):
        carry, ys = {"h": h, "layer": jnp.int32(0), "cache": None}, []
        for i in range(L):
            carry, y = counted_layer((w[i], b[i]), carry, consts, xs[i])
            ys.append(y)
        return carry["h"], jnp.stack(ys)

    @jax.jit                                                      # one program, not op by op
    def unsharded_vjp(w, b, h, d_h, d_ys):
        outputs, vjp = jax.vjp(unsharded, w, b, h)
        return outputs, vjp((d_h, d_ys))

    (want_h, want_ys), (dw, db, dh) = unsharded_vjp(w, b, h, d_h, d_ys)
    assert int(count) == L
    np.testing.assert_allclose(out_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ys, want_ys, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(leaves[0].unpad(d_shards[0]), dw, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(leaves[1].unpad(d_shards[1]), db, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_h_in, dh, rtol=1e-4, atol=1e-5)
