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


def stacked_inputs(n, shape, group_size, swizzled, bits, symmetric, seed=0):
    """N quantized tensors stacked on a leading axis, as an all-to-all hands them back."""
    x = np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)
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


class TestDequantReduceInterpret(TestDequantReduce):
    INTERPRET = True


def test_needs_a_stacked_axis():
    q = quantize_reference(jnp.ones(256), bits=4, group_size=64)
    with pytest.raises(ValueError, match="stacked on a leading axis"):
        dequant_reduce(q)
