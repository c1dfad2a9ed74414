"""A weight gradient reduce-scattered in its backward dot's dim order
(`zeroxla.collectives.dot_layout`, `zeroxla.engine.cotangent_layout`): the same shard as the
plain reduce-scatter of the transposed gradient (numpy float64 reference), the pullback's values
unchanged, and on XLA:CPU the weight-gradient dots of a ZeRO-3 step left to the dot library."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import zeroxla
from zeroxla import models
from zeroxla.collectives.dot_layout import Permuted, as_array, reduce_scatter_permuted
from zeroxla.engine.cotangent_layout import pull_permuted

N = 8


@pytest.mark.parametrize("natural_shape, permutation, dim, pad", [
    ((24, 16), (1, 0), 0, 0),          # W[16, 24] from dot [24, 16]: scatter W's dim 0
    ((24, 16), (1, 0), 1, 0),
    ((5, 16), (1, 0), 1, 3),           # W[16, 5], dim 1 padded 5 -> 8
    ((4, 6, 16), (2, 0, 1), 2, 2),     # W[16, 4, 6] from dot [4, 6, 16]
])
def test_shard_is_the_reduce_scatter_of_the_transposed_sum(natural_shape, permutation, dim, pad):
    rng = np.random.default_rng(0)
    per_device = rng.standard_normal((N, *natural_shape))             # each device's cotangent
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x):
        grad = Permuted(x[0], permutation)
        return reduce_scatter_permuted(
            grad, dim, pad, lambda a, d: lax.psum_scatter(a, "data", scatter_dimension=d,
                                                          tiled=True))[None]
    shards = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        jnp.asarray(per_device, jnp.float32))

    total = np.transpose(per_device.sum(0), permutation)              # float64, weight order
    widths = [(0, 0)] * total.ndim
    widths[dim] = (0, pad)
    expected = np.split(np.pad(total, widths), N, axis=dim)
    np.testing.assert_allclose(np.asarray(shards), np.stack(expected), rtol=1e-5, atol=1e-5)


def _mlp(params, x):
    w_in, w_out, table = params                   # W[D, F] (x @ W), W[F, D], a [V, D] head
    h = jnp.tanh(jnp.einsum("btd,df->btf", x, w_in))
    y = jnp.einsum("btf,fd->btd", h, w_out)
    return jnp.einsum("btd,vd->btv", y, table)


def test_pull_permuted_keeps_the_pullback_values():
    rng = np.random.default_rng(1)
    params = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((8, 16), (16, 8), (5, 8))]
    x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    out, pullback = jax.vjp(_mlp, params, x)
    cotangent = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    expected_w, expected_x = pullback(cotangent)
    permuted = []

    def pulled(c):
        w, dx = pull_permuted(pullback, c)
        permuted.extend(isinstance(g, Permuted) for g in w)
        return [as_array(g) for g in w], dx
    got_w, got_x = jax.jit(pulled)(cotangent)
    # x @ W makes its weight gradient as dot [F, D] then a transpose; the head's [V, D] comes
    # straight out of its dot.
    assert permuted == [True, True, False]
    # The same sums; XLA may run the untransposed dot with another kernel (its own rounding).
    for got, expected in zip(got_w, expected_w):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(expected_x), rtol=1e-5, atol=1e-5)


def _unfused_dots(compiled_text: str) -> list[str]:
    """op_names of the dots XLA:CPU left outside a fusion (run by Eigen, not its dot library)."""
    return [re.search(r'op_name="([^"]*)"', line).group(1)
            for line in compiled_text.splitlines()
            if re.search(r"= \S+ dot\(", line) and "ROOT" not in line]


def test_cpu_zero3_weight_gradient_dots_stay_in_the_dot_library():
    """gpt-tiny's weight-gradient dots (named ".../transpose" when XLA folded the transpose
    into them) are not among the dots XLA:CPU runs outside its dot library (checked for jax
    0.10.2's XLA: a later XLA may fuse differently; then re-measure `benchmarks/zero.py`)."""
    step = zeroxla.make_step(lambda: models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=1000))
    tokens = np.zeros((16, 64), np.int32)
    text = step.compile(step.init(), {"inputs": tokens, "targets": tokens}).as_text()
    folded = [name for name in _unfused_dots(text) if name.endswith("/transpose")]
    assert folded == [], folded
