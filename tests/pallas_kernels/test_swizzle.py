"""swizzled_quantize against float64 numpy (tests/support/numpy_quant.py), the Pallas kernel
against its `*_reference` where a kernel runs, and the two-hop layout of ZeRO++ §3.3."""

import numpy as np
import jax.numpy as jnp
import pytest

from numpy_quant import (
    assert_codes_match,
    assert_steps_match,
    quantize64,
    swizzled_quantize64,
    unpack_codes,
)
from zeroxla.pallas_kernels import (
    dequantize,
    swizzled_quantize,
    swizzled_quantize_reference,
)
from zeroxla.pallas_kernels._common import use_pallas

# (nodes, devices_per_node, chunk, group_size): the standard 2x4 mesh, one node of 8, an odd
# 3x2 one, and chunks that are not multiples of the group (each partition padded on its own).
CASES = [(2, 4, 512, 128), (1, 8, 100, 64), (3, 2, 1000, 256)]
KINDS = [(4, True), (4, False), (8, True)]
KIND_IDS = ["int4-sym", "int4-asym", "int8-sym"]
NONFINITE = [np.nan, np.inf, -np.inf]
NONFINITE_IDS = ["nan", "+inf", "-inf"]


def by_group(values, group_size: int) -> np.ndarray:
    """[..., chunk] -> [..., G, group_size], each row padded with its last value."""
    a = np.asarray(values)
    pad = [(0, 0)] * (a.ndim - 1) + [(0, -a.shape[-1] % group_size)]
    return np.pad(a, pad, mode="edge").reshape(*a.shape[:-1], -1, group_size)


def gaussian(nodes, local, chunk) -> np.ndarray:
    return np.random.default_rng(chunk).standard_normal(nodes * local * chunk).astype(np.float32)


class TestSwizzle:
    """`impl="auto"` (the kernel on GPU, the jnp reference on CPU) against float64 numpy; the
    twin below runs the same assertions on the interpreted Pallas kernel."""

    INTERPRET = False

    def kw(self):
        return dict(impl="pallas", interpret=True) if self.INTERPRET else dict(impl="auto")

    @pytest.mark.parametrize("nodes,local,chunk,group_size", CASES, ids=str)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_matches_float64(self, nodes, local, chunk, group_size, bits, symmetric):
        x = gaussian(nodes, local, chunk)
        q = swizzled_quantize(jnp.asarray(x), bits=bits, group_size=group_size, nodes=nodes,
                              devices_per_node=local, symmetric=symmetric, **self.kw())
        groups = -(-chunk // group_size)
        assert q.data.shape == (local, nodes, groups, group_size * bits // 8)
        assert q.scales.shape == (local, nodes, groups) and q.shape == (local, nodes, chunk)
        expected = swizzled_quantize64(x, bits, group_size, nodes, local, symmetric)
        assert_codes_match(unpack_codes(q.data, bits), expected)
        assert_steps_match(q.scales, q.offsets, expected)

    @pytest.mark.parametrize("nodes,local,chunk,group_size", CASES, ids=str)
    def test_row_l_n_is_partition_n_l(self, nodes, local, chunk, group_size):
        # [l, n] of the output is partition (n, l) of the input, quantized on its own.
        x = gaussian(nodes, local, chunk)
        q = swizzled_quantize(jnp.asarray(x), bits=4, group_size=group_size, nodes=nodes,
                              devices_per_node=local, **self.kw())
        codes = unpack_codes(q.data, 4)
        parts = x.reshape(nodes, local, chunk)
        for n in range(nodes):
            for l in range(local):
                alone = quantize64(parts[n, l], 4, group_size)
                assert_codes_match(codes[l, n], alone)
                assert_steps_match(q.scales[l, n], None, alone)

    def kernel_runs(self, group_size: int) -> bool:
        return self.INTERPRET or use_pallas("auto", group_size)

    @pytest.mark.parametrize("nodes,local,chunk,group_size", CASES, ids=str)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_kernel_matches_reference(self, nodes, local, chunk, group_size, bits, symmetric):
        """The same float32 arithmetic: bit for bit the same codes and steps."""
        if not self.kernel_runs(group_size):
            pytest.skip("impl='auto' runs the jnp reference itself off GPU (the interpret twin "
                        "compares the kernel)")
        x = jnp.asarray(gaussian(nodes, local, chunk))
        args = dict(bits=bits, group_size=group_size, nodes=nodes, devices_per_node=local,
                    symmetric=symmetric)
        q, r = swizzled_quantize(x, **args, **self.kw()), swizzled_quantize_reference(x, **args)
        np.testing.assert_array_equal(q.data, r.data)
        np.testing.assert_array_equal(q.scales, r.scales)
        if not symmetric:
            np.testing.assert_array_equal(q.offsets, r.offsets)

    @pytest.mark.parametrize("bad", NONFINITE, ids=NONFINITE_IDS)
    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_non_finite_group_dequantizes_to_nan(self, bits, symmetric, bad):
        # Issue 10: a NaN or +-inf in a gradient must survive qgZ's quantization.
        nodes, local, chunk, group_size = CASES[2]  # 3 x 2 partitions of 1000: 4 groups each
        y = gaussian(nodes, local, chunk)
        parts = y.reshape(nodes, local, chunk)  # a view: partition (n, l)
        parts[1, 0, 600] = bad                  # group 2 of partition (1, 0)
        parts[2, 1, 999] = bad                  # its last element: group 3, with the padding
        parts[0, 1, [5, 6, 7]] = NONFINITE      # NaN, +inf, -inf together in group 0
        hit = np.zeros((local, nodes, 4), bool)  # output layout [l, n, G]
        hit[0, 1, 2] = hit[1, 2, 3] = hit[1, 0, 0] = True
        q = swizzled_quantize(jnp.asarray(y), bits=bits, group_size=group_size, nodes=nodes,
                              devices_per_node=local, symmetric=symmetric, **self.kw())
        expected = swizzled_quantize64(y, bits, group_size, nodes, local, symmetric)
        np.testing.assert_array_equal(np.isnan(expected.steps), hit)
        assert_codes_match(unpack_codes(q.data, bits), expected)
        assert_steps_match(q.scales, q.offsets, expected)
        assert not np.any(np.asarray(q.data)[hit])
        out = by_group(dequantize(q, impl="jnp"), group_size)  # [l, n, G, gs]
        assert np.all(np.isnan(out[hit])) and np.all(np.isfinite(out[~hit]))


class TestSwizzleInterpret(TestSwizzle):
    INTERPRET = True


def test_two_hop_all_to_all_delivers_each_partition_to_its_owner():
    """Simulates qgZ's routing in numpy on the swizzled layout of 2 nodes x 4 devices.

    Device (n, l) owns partition n * 4 + l (psum_scatter's layout). Device d fills partition p
    with 100 * p + d; after hop 1 (all-to-all among the 4 devices of a node) and hop 2
    (all-to-all among the 2 devices with the same local index), device (n, l) must hold
    partition n * 4 + l from every device d = k * 4 + j, as row [k, j].
    """
    nodes, local, chunk = 2, 4, 16
    partition = np.repeat(np.arange(nodes * local, dtype=np.float32), chunk)
    sent = {}
    for n in range(nodes):
        for l in range(local):
            q = swizzled_quantize(jnp.asarray(100 * partition + n * local + l), bits=8,
                                  group_size=16, nodes=nodes, devices_per_node=local,
                                  symmetric=False)  # constant groups: exact
            sent[n, l] = np.asarray(dequantize(q))  # [local, nodes, chunk]
    # hop 1: device (n, l) receives row l of each local peer (n, j) -> [j, nodes, chunk]
    hop1 = {(n, l): np.stack([sent[n, j][l] for j in range(local)])
            for n in range(nodes) for l in range(local)}
    # (dequant_reduce sums over j here.) hop 2: row n of each node peer (k, l) -> [k, j, chunk]
    hop2 = {(n, l): np.stack([hop1[k, l][:, n] for k in range(nodes)])
            for n in range(nodes) for l in range(local)}
    for (n, l), received in hop2.items():
        sender = np.arange(nodes * local).reshape(nodes, local, 1)  # d = k * local + j
        expected = np.broadcast_to(100 * (n * local + l) + sender, received.shape)
        np.testing.assert_array_equal(received, expected)
