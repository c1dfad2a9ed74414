"""dequant_reduce / dequant_sum: kernel vs reference, and both vs a float64 numpy sum."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from zeroxla.pallas_kernels import (
    QuantizedArray,
    dequant_reduce,
    dequant_reduce_reference,
    dequant_sum,
    dequant_sum_reference,
    dequantize_reference,
    quantize_reference,
    swizzled_quantize_reference,
)

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
    """x [N, *shape] float32 -> the N tensors quantized and stacked (see `stacked_inputs`)."""
    n, *shape = x.shape
    if swizzled:  # lead [N, rows]: the layout of swizzled_quantize after hop 1
        rows, chunk = shape
        return swizzled_quantize_reference(jnp.asarray(x.reshape(-1)), bits=bits,
                                           group_size=group_size, nodes=rows,
                                           devices_per_node=n, symmetric=symmetric)
    qs = [quantize_reference(jnp.asarray(t), bits=bits, group_size=group_size,
                             symmetric=symmetric) for t in x]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *qs)
    return QuantizedArray(data=stacked.data, scales=stacked.scales, offsets=stacked.offsets,
                          shape=(n, *shape), bits=bits, group_size=group_size)


def codes(q: QuantizedArray) -> np.ndarray:
    """Integer codes [..., G, group_size] from the documented int8 / packed-int4 layout."""
    b = np.asarray(q.data).astype(np.int64)
    return b if q.bits == 8 else np.concatenate([((b & 0xF) ^ 0x8) - 0x8, b >> 4], axis=-1)


def float64_sum(q: QuantizedArray) -> np.ndarray:
    return np.asarray(dequantize_reference(q), np.float64).sum(axis=0)


class TestDequantReduce:
    INTERPRET = False

    def kw(self):
        return dict(impl="pallas", interpret=True) if self.INTERPRET else dict(impl="auto")

    @pytest.mark.parametrize("n,shape,group_size,swizzled", CASES, ids=CASE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_sum_matches_reference_and_float64(self, n, shape, group_size, swizzled, bits,
                                               symmetric):
        q = stacked_inputs(n, shape, group_size, swizzled, bits, symmetric)
        out = np.asarray(dequant_sum(q, **self.kw()))
        assert out.shape == shape and out.dtype == np.float32
        np.testing.assert_allclose(out, dequant_sum_reference(q), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out, float64_sum(q), rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("n,shape,group_size,swizzled", CASES, ids=CASE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_reduce_matches_reference_and_float64(self, n, shape, group_size, swizzled, bits,
                                                  symmetric):
        q = stacked_inputs(n, shape, group_size, swizzled, bits, symmetric)
        got, ref = dequant_reduce(q, **self.kw()), dequant_reduce_reference(q)
        assert got.shape == shape and got.data.shape == ref.data.shape == q.data.shape[1:]
        assert (got.bits, got.group_size, got.symmetric) == (bits, group_size, symmetric)
        # The float32 sums may differ in the last bit (summation order), which can move a code
        # that sits on a rounding tie by one.
        flips = np.abs(codes(got) - codes(ref))
        assert flips.max() <= 1 and flips.mean() < 1e-3
        np.testing.assert_allclose(got.scales, ref.scales, rtol=1e-6)
        # Requantizing the exact sum costs at most one output step per element.
        total, out = float64_sum(q), np.asarray(dequantize_reference(got), np.float64)
        lead = len(got.lead)
        step = np.repeat(np.asarray(got.scales, np.float64), group_size, axis=-1)
        step = step.reshape(*got.lead, -1)[..., :total[(0,) * lead].size].reshape(total.shape)
        assert np.all(np.abs(out - total) <= step * 1.0001 + 1e-6)


    # Issue 10: a NaN or +-inf in one contribution (an fp16 overflow on one device) must reach
    # the reduced gradient. N = 3 tensors [65, 384] in 390 groups of 64 (CASES[2]).

    @pytest.mark.parametrize("bad", NONFINITE, ids=NONFINITE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_non_finite_contribution_gives_nan_group(self, bits, symmetric, bad):
        n, shape, group_size, _ = CASES[2]
        x = np.random.default_rng(0).standard_normal((n, *shape)).astype(np.float32)
        y = x.copy()
        flat = y.reshape(n, -1)             # a view: contribution j, flat element e
        flat[0, 300] = bad                  # group 4
        flat[1, -1] = bad                   # the last group, 389
        flat[2, [6400, 6410, 6420]] = NONFINITE  # NaN, +inf, -inf together in group 100
        flat[0, 12800], flat[1, 12850] = np.inf, -np.inf  # group 200, from two contributions
        hit = np.zeros(390, bool)
        hit[[4, 389, 100, 200]] = True
        clean = stack_quantized(x, group_size, False, bits, symmetric)
        q = stack_quantized(y, group_size, False, bits, symmetric)

        total = np.asarray(dequant_sum(q, **self.kw())).reshape(-1, group_size)  # [G, gs]
        np.testing.assert_allclose(total, np.asarray(dequant_sum_reference(q)).reshape(
            total.shape), rtol=1e-6, atol=1e-6, equal_nan=True)
        assert np.all(np.isnan(total[hit]))
        np.testing.assert_array_equal(total[~hit], np.asarray(
            dequant_sum(clean, **self.kw())).reshape(total.shape)[~hit])

        got, ref = dequant_reduce(q, **self.kw()), dequant_reduce_reference(q)
        np.testing.assert_array_equal(np.isnan(got.scales), hit)
        np.testing.assert_array_equal(np.isnan(ref.scales), hit)
        assert not np.any(np.asarray(got.data)[hit]) and not np.any(np.asarray(ref.data)[hit])
        before = dequant_reduce(clean, **self.kw())
        np.testing.assert_array_equal(got.data[~hit], before.data[~hit])
        np.testing.assert_array_equal(got.scales[~hit], before.scales[~hit])
        out = np.asarray(dequantize_reference(got)).reshape(-1, group_size)
        assert np.all(np.isnan(out[hit])) and np.all(np.isfinite(out[~hit]))

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
        got, ref = dequant_reduce(q, **self.kw()), dequant_reduce_reference(q)
        hit = np.arange(390) == 15
        np.testing.assert_array_equal(np.isnan(got.scales), hit)
        np.testing.assert_array_equal(np.isnan(ref.scales), hit)
        out = np.asarray(dequantize_reference(got)).reshape(-1, group_size)
        assert np.all(np.isnan(out[hit])) and np.all(np.isfinite(out[~hit]))


class TestDequantReduceInterpret(TestDequantReduce):
    INTERPRET = True


def test_needs_a_stacked_axis():
    q = quantize_reference(jnp.ones(256), bits=4, group_size=64)
    with pytest.raises(ValueError, match="stacked on a leading axis"):
        dequant_reduce(q)
