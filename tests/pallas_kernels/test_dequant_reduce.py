"""dequant_reduce / dequant_sum against float64 numpy (tests/support/numpy_quant.py), and the
Pallas kernel against its `*_reference` where a kernel runs.

Inputs are quantized in numpy and packed into the storage format, so neither the inputs nor the
expected values pass through zeroxla's quantizer.
"""

import dataclasses

import numpy as np
import jax.numpy as jnp
import pytest

from numpy_quant import (
    EPS32,
    Quantized64,
    assert_codes_match,
    assert_steps_match,
    dequantize_groups64,
    quantize_groups64,
    quantize_rows64,
    swizzled_quantize64,
    to_quantized_array,
    unpack_codes,
    unpad_groups,
)
from zeroxla.pallas_kernels import (
    dequant_reduce,
    dequant_reduce_reference,
    dequant_sum,
    dequant_sum_reference,
    quantize_reference,
)
from zeroxla.pallas_kernels._common import use_pallas

# (N tensors, each tensor's shape, group_size, swizzled): what qgZ's hop 1 receives on a 2x4 mesh
# (4 local peers, each [nodes=2, chunk]), what hop 2 receives (2 nodes, [chunk]), and N = 3.
CASES = [(4, (2, 500), 128, True), (2, (1000,), 256, False), (3, (65, 384), 64, False)]
CASE_IDS = ["hop1-4x2x500", "hop2-2x1000", "3x65x384"]
KINDS = [(4, True), (4, False), (8, True)]
KIND_IDS = ["int4-sym", "int4-asym", "int8-sym"]
NONFINITE = [np.nan, np.inf, -np.inf]
NONFINITE_IDS = ["nan", "+inf", "-inf"]


def stacked_inputs(n, shape, group_size, swizzled, bits, symmetric, seed=0):
    """N quantized tensors stacked on a leading axis, as an all-to-all hands them back."""
    x = np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)
    return stack_quantized(x, group_size, swizzled, bits, symmetric)


def stack_quantized(x, group_size, swizzled, bits, symmetric):
    """x [N, *shape] float32 -> the N tensors quantized in numpy, stacked, in the storage format
    (a `QuantizedArray` with lead [N] or, swizzled, [N, rows])."""
    n, *shape = x.shape
    if swizzled:  # lead [N, rows]: the layout of swizzled_quantize after hop 1
        rows, _ = shape
        q = swizzled_quantize64(x.reshape(-1), bits, group_size, nodes=rows,
                                devices_per_node=n, symmetric=symmetric)
    else:         # lead [N]: each tensor flattened and quantized on its own
        q = quantize_rows64(x.reshape(n, -1), bits, group_size, symmetric)
        q = dataclasses.replace(q, shape=(n, *shape))
    return to_quantized_array(q)


def float64_groups(q) -> np.ndarray:
    """The stacked inputs' values in float64 from their stored codes and float32 steps:
    [N, *lead[1:], G, gs]."""
    return dequantize_groups64(unpack_codes(q.data, q.bits), q.scales, q.offsets)


def float64_sum(q) -> np.ndarray:
    """The exact sum of the N inputs, shape q.shape[1:]."""
    return unpad_groups(float64_groups(q).sum(axis=0), q.shape[1:], len(q.lead) - 1)


def reduced64(q) -> Quantized64:
    """What `dequant_reduce(q)` must return: the exact sum of the N inputs, requantized in
    float64. The kernel sums in float32, up to N roundings off, so a code near a rounding
    boundary may go either way (`near_tie` with slack 4 + N)."""
    codes, steps, offsets, near = quantize_groups64(float64_groups(q).sum(axis=0), q.bits,
                                                    q.symmetric, slack=4 + q.lead[0])
    return Quantized64(codes, steps, offsets, near, q.shape[1:], q.bits, q.group_size)


def sum_tolerance(q) -> float:
    """float32 summation of N terms: N roundings of at most the sum of |terms|."""
    n = q.lead[0]
    return 2 * n * EPS32 * float(np.nanmax(np.abs(float64_groups(q)).sum(axis=0), initial=1.0))


class TestDequantReduce:
    """`impl="auto"` (the kernel on GPU, the jnp reference on CPU) against float64 numpy; the
    twin below runs the same assertions on the interpreted Pallas kernel."""

    INTERPRET = False

    def kw(self):
        return dict(impl="pallas", interpret=True) if self.INTERPRET else dict(impl="auto")

    @pytest.mark.parametrize("n,shape,group_size,swizzled", CASES, ids=CASE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_sum_matches_float64(self, n, shape, group_size, swizzled, bits, symmetric):
        q = stacked_inputs(n, shape, group_size, swizzled, bits, symmetric)
        out = np.asarray(dequant_sum(q, **self.kw()))
        assert out.shape == shape and out.dtype == np.float32
        np.testing.assert_allclose(out, float64_sum(q), rtol=0, atol=sum_tolerance(q))

    @pytest.mark.parametrize("n,shape,group_size,swizzled", CASES, ids=CASE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_reduce_matches_float64(self, n, shape, group_size, swizzled, bits, symmetric):
        q = stacked_inputs(n, shape, group_size, swizzled, bits, symmetric)
        got = dequant_reduce(q, **self.kw())
        assert got.shape == shape and got.data.shape == q.data.shape[1:]
        assert (got.bits, got.group_size, got.symmetric) == (bits, group_size, symmetric)
        # The exact sum, requantized in float64 (codes may differ by one at near ties).
        expected = reduced64(q)
        assert_codes_match(unpack_codes(got.data, bits), expected)
        assert_steps_match(got.scales, got.offsets, expected, rtol=(4 + n) * EPS32)
        # Requantizing the exact sum costs at most one output step per element.
        total = float64_sum(q)
        out = unpad_groups(dequantize_groups64(unpack_codes(got.data, bits), got.scales,
                                               got.offsets), shape, len(got.lead))
        step = unpad_groups(np.repeat(np.asarray(got.scales, np.float64)[..., None],
                                      group_size, axis=-1), shape, len(got.lead))
        assert np.all(np.abs(out - total) <= step * 1.0001 + 1e-6)

    def kernel_runs(self, group_size: int) -> bool:
        return self.INTERPRET or use_pallas("auto", group_size)

    @pytest.mark.parametrize("n,shape,group_size,swizzled", CASES, ids=CASE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_kernel_matches_reference(self, n, shape, group_size, swizzled, bits, symmetric):
        """Kernel and jnp reference sum in float32 in possibly different orders: sums within
        N roundings, requantized codes at most one apart (a sum on a rounding boundary)."""
        if not self.kernel_runs(group_size):
            pytest.skip("impl='auto' runs the jnp reference itself off GPU (the interpret twin "
                        "compares the kernel)")
        q = stacked_inputs(n, shape, group_size, swizzled, bits, symmetric)
        np.testing.assert_allclose(dequant_sum(q, **self.kw()), dequant_sum_reference(q),
                                   rtol=0, atol=sum_tolerance(q))
        got, ref = dequant_reduce(q, **self.kw()), dequant_reduce_reference(q)
        flips = np.abs(unpack_codes(got.data, bits) - unpack_codes(ref.data, bits))
        assert flips.max() <= 1 and flips.mean() < 1e-3
        np.testing.assert_allclose(got.scales, ref.scales, rtol=(4 + n) * EPS32)

    # Issue 10: a NaN or +-inf in one contribution (an fp16 overflow on one device) must reach
    # the reduced gradient. N = 3 tensors [65, 384] in 390 groups of 64 (CASES[2]).

    @pytest.mark.parametrize("bad", NONFINITE, ids=NONFINITE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_non_finite_contribution_gives_nan_group(self, bits, symmetric, bad):
        n, shape, group_size, _ = CASES[2]
        x = np.random.default_rng(0).standard_normal((n, *shape)).astype(np.float32)
        flat = x.reshape(n, -1)             # a view: contribution j, flat element e
        flat[0, 300] = bad                  # group 4
        flat[1, -1] = bad                   # the last group, 389
        flat[2, [6400, 6410, 6420]] = NONFINITE  # NaN, +inf, -inf together in group 100
        flat[0, 12800], flat[1, 12850] = np.inf, -np.inf  # group 200, from two contributions
        hit = np.zeros(390, bool)
        hit[[4, 389, 100, 200]] = True
        q = stack_quantized(x, group_size, False, bits, symmetric)
        assert np.array_equal(np.isnan(q.scales).any(axis=0), hit)   # numpy marked the groups

        total = np.asarray(dequant_sum(q, **self.kw())).reshape(-1, group_size)  # [G, gs]
        expected = float64_sum(q).reshape(total.shape)     # NaN in every hit group
        np.testing.assert_allclose(total, expected, rtol=0, atol=sum_tolerance(q),
                                   equal_nan=True)
        assert np.all(np.isnan(total[hit])) and np.all(np.isfinite(total[~hit]))

        got = dequant_reduce(q, **self.kw())
        np.testing.assert_array_equal(np.isnan(got.scales), hit)
        if not symmetric:
            np.testing.assert_array_equal(np.isnan(got.offsets), hit)
        assert not np.any(np.asarray(got.data)[hit])
        expected = reduced64(q)
        assert_codes_match(unpack_codes(got.data, bits), expected)
        assert_steps_match(got.scales, got.offsets, expected, rtol=(4 + n) * EPS32)

    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_float32_overflow_of_the_sum_gives_nan_group(self, bits, symmetric):
        # Finite contributions of ~1.5e38 each: their float32 sum is +inf, and the requantized
        # partial sum (what qgZ's second hop carries) must not turn it back into finite codes.
        n, shape, group_size, _ = CASES[2]
        x = np.random.default_rng(0).standard_normal((n, *shape)).astype(np.float32)
        x.reshape(n, -1)[:, 1000] = 1.5e38  # group 15 of every contribution
        q = stack_quantized(x, group_size, False, bits, symmetric)
        assert np.all(np.isfinite(q.scales))
        total = np.asarray(dequant_sum(q, **self.kw())).reshape(-1)
        assert total[1000] == np.inf and np.isfinite(np.delete(total, 1000)).all()
        got = dequant_reduce(q, **self.kw())
        hit = np.arange(390) == 15
        np.testing.assert_array_equal(np.isnan(got.scales), hit)
        out = dequantize_groups64(unpack_codes(got.data, bits), got.scales, got.offsets)
        assert np.all(np.isnan(out[hit])) and np.all(np.isfinite(out[~hit]))


class TestDequantReduceInterpret(TestDequantReduce):
    INTERPRET = True


def test_needs_a_stacked_axis():
    q = quantize_reference(jnp.ones(256), bits=4, group_size=64)
    with pytest.raises(ValueError, match="stacked on a leading axis"):
        dequant_reduce(q)
