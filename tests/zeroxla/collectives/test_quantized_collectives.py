"""Quantized collectives inside shard_map on the 2 x 4 mesh, against float64 numpy.

Expected values come from `numpy_quant` (DeepSpeed's formulas in float64) and explicit routing
written out here in numpy: no zeroxla quantizer or kernel computes an expected value. Results must
agree to float32 rounding, except where a code of the expected values lies within float32
error of a rounding boundary (`near_tie`: a handful of elements), where float32 may round the
other way and the check allows exactly the steps that can move.
"""

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import zeroxla
from numpy_quant import (
    EPS32,
    quantize64,
    quantize_groups64,
    swizzled_quantize64,
    unpad_groups,
)
from zeroxla.sharding.mesh import DATA_AXES
from zeroxla.collectives.quantized import (
    one_hop_quantized_reduce_scatter,
    quantized_all_gather,
    quantized_reduce_scatter,
    uses_quantized_reduce_scatter,
)

NODES, LOCAL = 2, 4
DEVICES = NODES * LOCAL


@pytest.fixture(scope="module")
def mesh(devices):
    return zeroxla.make_mesh(NODES, LOCAL, devices=devices)


def per_device(mesh, fn, x, check_vma=False):
    """Runs fn on row d of x [8, ...] on device d (node-major); returns the rows [8, ...]."""
    return np.asarray(_mapped(mesh, fn, check_vma)(jnp.asarray(x)))


@functools.lru_cache(maxsize=None)
def _mapped(mesh, fn, check_vma):  # one compiled program per (mesh, fn), reused across seeds
    return jax.jit(jax.shard_map(lambda rows: fn(rows[0])[None], mesh=mesh,
                                 in_specs=P(DATA_AXES), out_specs=P(DATA_AXES),
                                 check_vma=check_vma))


def gaussian(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---- qwZ: quantized all-gather


def all_gather64(shards, *, bits, group_size, symmetric=True):
    """qwZ in float64 numpy: each shard quantized on its own, dequantized, concatenated in
    device order (`lax.all_gather(tiled=True)`'s). Returns (values, slack): slack is one step
    where a code sits within float32 error of a rounding boundary (`near_tie`), else 0."""
    qs = [quantize64(s, bits, group_size, symmetric) for s in shards]
    values = np.concatenate([q.values().reshape(-1) for q in qs])
    slack = np.concatenate([
        unpad_groups(q.near_tie * q.steps[:, None], q.shape, 0).reshape(-1) for q in qs])
    return values, slack


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True)])
def test_all_gather_is_all_gather_of_quantized_shards(mesh, bits, symmetric):
    shards = gaussian((DEVICES, 1000), seed=bits)  # 1000: not a multiple of the group
    kw = dict(bits=bits, group_size=128, symmetric=symmetric)
    got = per_device(mesh, lambda s: quantized_all_gather(s, **kw), shards)
    # Every device holds every shard's own quantize -> dequantize, in all_gather's order (float32
    # rounding of code * step (+ offset): 4 eps of the largest value),
    expected, slack = all_gather64(shards, **kw)
    assert_within(got, expected, 4 * EPS32 * np.abs(shards).max() + slack)
    # so within quantization error of the shards themselves.
    exact = np.broadcast_to(shards.reshape(-1), got.shape)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < {8: 0.01, 4: 0.15}[bits]


def test_all_gather_returns_the_requested_dtype(mesh):
    shards = gaussian((DEVICES, 256), seed=0)
    got = per_device(mesh, lambda s: quantized_all_gather(s, dtype=jnp.bfloat16), shards)
    assert got.dtype == jnp.bfloat16 and got.shape == (DEVICES, DEVICES * 256)


def test_all_gather_over_the_local_axis_only(mesh):
    # hpZ (ZeRO++ §3.2) gathers its secondary partition within a node: device (n, l) gets the
    # quantized shards of node n's four devices.
    shards = gaussian((DEVICES, 256), seed=1)
    got = per_device(mesh, lambda s: quantized_all_gather(s, axis_names="local"), shards)
    assert got.shape == (DEVICES, LOCAL * 256)
    for n in range(NODES):
        node = shards[n * LOCAL:(n + 1) * LOCAL]
        expected, slack = all_gather64(node, bits=8, group_size=512)   # qwZ's defaults
        assert_within(got[n * LOCAL:(n + 1) * LOCAL], expected,
                      4 * EPS32 * np.abs(node).max() + slack)


# ---- qgZ: quantized reduce-scatter


def psum_scatter(x):
    return lax.psum_scatter(x, DATA_AXES, scatter_dimension=0, tiled=True)


def two_hop64(grads, *, bits, group_size):
    """qgZ in float64 numpy, routing written out (ZeRO++ §3.3). Returns (values, slack), each
    [8, chunk]: row d what device d must hold after the reduce-scatter, and how far a float32
    implementation may be off beyond float32 rounding.

    Device d = k * LOCAL + j quantizes its gradient's partitions (n, l) (partition n * LOCAL + l)
    on their own. Hop 1: device (k, l) sums its node's contributions to partitions (n, l) and
    requantizes the sum; hop 2: device (n, l) sums those partial sums from every node k. The
    gradient is zero-padded to a multiple of 8 first, like `psum_scatter`'s input.

    slack: where a code sits within float32 error of a rounding boundary (`near_tie`), float32
    may round the other way: a first-hop code moves its partial sum by one step, which moves
    that element's requantized value by up to that step plus one second-hop step, or, if it can
    change the group's absmax, every value of that group by up to two second-hop steps plus it;
    a near-tie second-hop code moves its element by one second-hop step. Zero elsewhere, which
    is almost everywhere (the tests print how many)."""
    grads = np.pad(grads, [(0, 0), (0, -grads.shape[1] % DEVICES)])
    chunk = grads.shape[1] // DEVICES
    sent = [swizzled_quantize64(g, bits, group_size, NODES, LOCAL) for g in grads]
    by_device = lambda a: np.stack(a).reshape(NODES, LOCAL, *a[0].shape)   # [k, j, ...]
    values = by_device([q.codes * q.steps[..., None] for q in sent])       # [k, j, l, n, G, gs]
    moved = by_device([q.near_tie * q.steps[..., None] for q in sent]).sum(axis=1)
    partial = values.sum(axis=1)                                           # [k, l, n, G, gs]
    codes, steps, _, near = quantize_groups64(partial, bits, symmetric=True, slack=4 + LOCAL)
    step2 = np.broadcast_to(steps[..., None], partial.shape)
    absmax = np.abs(partial).max(axis=-1, keepdims=True)
    group_moved = ((moved > 0) & (np.abs(partial) + moved >= absmax)).any(axis=-1, keepdims=True)
    slack = np.where(group_moved, 2 * step2 + moved.max(axis=-1, keepdims=True),
                     np.where(moved > 0, moved + step2, 0.0) + near * step2)
    total = (codes * steps[..., None]).sum(axis=0)                         # [l, n, G, gs]

    def rows(a):                                                           # device n * LOCAL + l
        return np.swapaxes(a, 0, 1).reshape(DEVICES, -1)[:, :chunk]
    return rows(total), rows(slack.sum(axis=0))


def reduce_scatter_tolerance(grads) -> float:
    """float32 rounding of the sums of 4 (hop 1) and 2 (hop 2) dequantized terms and of their
    steps: a few dozen eps of the largest partial sum."""
    return 32 * EPS32 * np.abs(grads).sum(axis=0).max()


def assert_within(got, expected, tolerance) -> None:
    """|got - expected| <= tolerance elementwise (expected broadcast to got's shape)."""
    got = np.asarray(got, np.float64)
    expected, tolerance = (np.broadcast_to(a, got.shape) for a in (expected, tolerance))
    bad = np.abs(got - expected) > tolerance
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} elements off; first at "
                           f"{np.argwhere(bad)[0].tolist()}: got {got[bad][0]}, "
                           f"expected {expected[bad][0]} +- {tolerance[bad][0]}")


@pytest.mark.parametrize("bits", [4, 8])
def test_reduce_scatter_lands_in_psum_scatter_layout(mesh, bits):
    grads = gaussian((DEVICES, DEVICES * 1000), seed=bits)  # chunk 1000: not whole groups
    got = per_device(mesh, lambda g: quantized_reduce_scatter(g, bits=bits, group_size=256),
                     grads)
    exact = grads.astype(np.float64).sum(0).reshape(DEVICES, -1)
    assert got.shape == exact.shape
    # The two-hop arithmetic in float64 with explicit routing,
    expected, slack = two_hop64(grads, bits=bits, group_size=256)
    print(f"{int((slack > 0).sum())} of {slack.size} elements near a rounding tie")
    assert_within(got, expected, reduce_scatter_tolerance(grads) + slack)
    # so bounded by quantization error: int8 is close, int4 within ZeRO++'s error budget.
    rel = np.abs(got - exact).mean() / np.abs(exact).mean()
    assert rel < {8: 0.02, 4: 0.25}[bits]


def test_two_hop_error_at_most_1_5x_one_hop(mesh):
    # ZeRO++ §3.3: requantizing after the intra-node sum adds error, but boundedly. For
    # uncorrelated Gaussian gradients the expected ratio is ~sqrt(2) (two int4 roundings of
    # comparable relative size instead of one).
    two, one = [], []
    for seed in range(3):
        grads = gaussian((DEVICES, DEVICES * 2048), seed=seed)
        exact = grads.astype(np.float64).sum(0).reshape(DEVICES, -1)
        two.append(np.abs(per_device(mesh, quantized_reduce_scatter, grads) - exact).mean())
        one.append(np.abs(per_device(mesh, one_hop_quantized_reduce_scatter, grads)
                          - exact).mean())
    assert np.mean(two) <= 1.5 * np.mean(one), (np.mean(two), np.mean(one))


def test_one_hop_lands_in_psum_scatter_layout(mesh):
    # One quantization per contribution (partition p of device d quantized on its own), one sum.
    grads = gaussian((DEVICES, DEVICES * 512), seed=7)
    got = per_device(mesh, lambda g: one_hop_quantized_reduce_scatter(g, bits=8), grads)
    sent = [swizzled_quantize64(g, 8, 256, nodes=1, devices_per_node=DEVICES) for g in grads]
    expected = np.sum([q.values()[:, 0] for q in sent], axis=0)           # [p, chunk]
    slack = np.sum([unpad_groups(q.near_tie * q.steps[..., None], q.shape, 2)[:, 0]
                    for q in sent], axis=0)                               # a step per near tie
    assert_within(got, expected, reduce_scatter_tolerance(grads) + slack)
    exact = grads.astype(np.float64).sum(0).reshape(DEVICES, -1)
    assert np.abs(got - exact).mean() / np.abs(exact).mean() < 0.01


def test_unpadded_gradient_is_padded_like_psum_scatter(mesh):
    grads = gaussian((DEVICES, 4099), seed=3)  # 4099 = 8 * 512 + 3
    got = per_device(mesh, lambda g: quantized_reduce_scatter(g, bits=8, group_size=64), grads)
    assert got.shape == (DEVICES, 513)
    expected, slack = two_hop64(grads, bits=8, group_size=64)
    assert_within(got, expected, reduce_scatter_tolerance(grads) + slack)
    assert not np.any(got[-1, -5:])  # the padding sums to exact zeros


def test_small_tensors_fall_back_to_psum_scatter(mesh):
    assert not uses_quantized_reduce_scatter(8 * 256 - 1, devices=8, group_size=256)
    assert uses_quantized_reduce_scatter(8 * 256, devices=8, group_size=256)
    assert not uses_quantized_reduce_scatter(10**6, devices=1)
    assert uses_quantized_reduce_scatter(100, devices=8, min_size=64)
    grads = gaussian((DEVICES, 8 * 100), seed=5)  # below 8 devices x 256-element groups
    got = per_device(mesh, quantized_reduce_scatter, grads)
    np.testing.assert_array_equal(got, per_device(mesh, psum_scatter, grads))
    exact = grads.astype(np.float64).sum(0).reshape(DEVICES, -1)
    np.testing.assert_allclose(got, exact, rtol=0, atol=8 * EPS32 * np.abs(grads).sum(0).max())


@pytest.mark.parametrize("impl", ["pallas", "jnp"])
def test_kernels_inside_shard_map(mesh, impl):
    """The interpreted Pallas kernels and the jnp path inside shard_map, against numpy."""
    grads = gaussian((DEVICES, DEVICES * 256), seed=11)

    def fn(g):
        return jnp.concatenate([quantized_reduce_scatter(g, group_size=128, impl=impl),
                                quantized_all_gather(g[:256], group_size=128, impl=impl)])

    got = per_device(mesh, fn, grads)
    reduced, reduced_slack = two_hop64(grads, bits=4, group_size=128)
    gathered, gathered_slack = all_gather64(grads[:, :256], bits=8, group_size=128)
    wide = lambda a: np.broadcast_to(a, (DEVICES, a.size))
    assert_within(got, np.concatenate([reduced, wide(gathered)], axis=1),
                  reduce_scatter_tolerance(grads)
                  + np.concatenate([reduced_slack, wide(gathered_slack)], axis=1))


def test_default_path_under_check_vma(mesh):
    """The jnp path (the default off GPU) also type-checks under shard_map's check_vma=True.
    (jax 0.10's Pallas interpreter does not: its kernel constants carry no varying axes.)"""
    grads = gaussian((DEVICES, DEVICES * 256), seed=13)

    def fn(g):
        return jnp.concatenate([quantized_reduce_scatter(g, group_size=128),
                                one_hop_quantized_reduce_scatter(g, group_size=128),
                                quantized_all_gather(g[:256], group_size=128)])

    np.testing.assert_array_equal(per_device(mesh, fn, grads, check_vma=True),
                                  per_device(mesh, fn, grads))
