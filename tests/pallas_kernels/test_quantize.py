"""quantize / dequantize against DeepSpeed's formulas in float64 numpy
(tests/support/numpy_quant.py), the Pallas kernel against its `*_reference` where a kernel runs,
and accuracy against DeepSpeed's reference quantizer (tests/unit/ops/quantizer/test_quantize.py).

The base classes run `impl="auto"`: the compiled kernel on GPU, the jnp reference on CPU; their
interpret twins run the Pallas kernel in interpret mode. Both are checked against float64 numpy,
which shares no code with either.
"""

import hashlib

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from numpy_quant import (
    EPS32,
    assert_codes_match,
    assert_steps_match,
    dequantize_groups64,
    quantize64,
    unpack_codes,
    unpad_groups,
)
from zeroxla.pallas_kernels import (
    QuantTiles,
    dequantize,
    dequantize_reference,
    quantize,
    quantize_reference,
)
from zeroxla.pallas_kernels._common import use_pallas

# (shape, group_size): odd sizes (not multiples of 8 -- DeepSpeed#4386 -- nor of the group) and
# group sizes from 8 (512 groups per program) to 16384 (one group per program, more than the size).
CASES = [((7,), 64), ((1000,), 8), ((4097,), 256), ((65, 384), 16384)]
KINDS = [(8, True), (8, False), (4, True), (4, False)]
KIND_IDS = ["int8-sym", "int8-asym", "int4-sym", "int4-asym"]


def kinds_by_cases():
    """Every kind x case; daily the diagonal (each kind once, each case once), the rest slow."""
    return [pytest.param(*kind, *case, id=f"{kind_id}-{case[0]}-{case[1]}",
                         marks=() if k == c else pytest.mark.slow)
            for k, (kind, kind_id) in enumerate(zip(KINDS, KIND_IDS))
            for c, case in enumerate(CASES)]


def deepspeed_quantize64(x: np.ndarray, bits: int, group_size: int, symmetric: bool):
    """DeepSpeed's *test* quantizer in float64 numpy (test_quantize.py's `run_float_quantize`):
    scale = 2^b / (2 absmax) or 2^b / (max - min); q = clamp(round(x * scale + zero_point)).
    Its asymmetric form (zero point q_min - min * scale) differs from the kernel's (offset
    (max + min) / 2, `numpy_quant`); the accuracy test below holds us to it. Returns codes
    [G, group_size], the step 1 / scale [G], and the dequantized array of x's shape."""
    flat = np.asarray(x, np.float64).reshape(-1)
    groups = -(-max(flat.size, 1) // group_size)
    g = np.pad(flat, (0, groups * group_size - flat.size), mode="edge").reshape(groups, group_size)
    q_min, q_max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if symmetric:
        absmax = np.abs(g).max(-1, keepdims=True)
        scale = np.where(absmax == 0, 1.0, 2.0 ** bits / (2 * np.where(absmax == 0, 1, absmax)))
        zero_point = np.zeros_like(scale)
    else:
        hi, lo = g.max(-1, keepdims=True), g.min(-1, keepdims=True)
        scale = np.where(hi == lo, 1.0, 2.0 ** bits / np.where(hi == lo, 1, hi - lo))
        zero_point = q_min - lo * scale
    codes = np.clip(np.round(g * scale + zero_point), q_min, q_max)
    dequant = ((codes - zero_point) / scale).reshape(-1)[:flat.size].reshape(np.shape(x))
    return codes, 1.0 / scale[:, 0], dequant


# Issue 10: a NaN or +-inf (an fp16 overflow) must survive quantization so that the overflow check
# after qwZ / qgZ sees it. The tests below put `bad` at these elements of a 4097-element input in
# groups of 256: mid-group 1, the first element of group 4, and the last element (group 16, whose
# other 255 elements are padding repeating it). Group 8 holds a NaN, a +inf and a -inf together.
NONFINITE = [np.nan, np.inf, -np.inf]
NONFINITE_IDS = ["nan", "+inf", "-inf"]


def kinds_by_non_finite():
    """Every kind x non-finite value; daily each kind once, the values in turn."""
    return [pytest.param(*kind, bad, id=f"{kind_id}-{bad_id}",
                         marks=() if b == k % len(NONFINITE) else pytest.mark.slow)
            for k, (kind, kind_id) in enumerate(zip(KINDS, KIND_IDS))
            for b, (bad, bad_id) in enumerate(zip(NONFINITE, NONFINITE_IDS))]
BAD_AT = [300, 1024, 4096]
MIXED_AT = [2050, 2100, 2300]  # group 8


def with_non_finite(x: np.ndarray, bad: float) -> tuple[np.ndarray, np.ndarray]:
    """x with `bad` at BAD_AT and NaN, +inf, -inf at MIXED_AT; and the mask of hit groups of 256."""
    y = x.copy()
    y[BAD_AT] = bad
    y[MIXED_AT] = NONFINITE
    hit = np.zeros(-(-x.size // 256), bool)
    hit[np.array(BAD_AT + MIXED_AT) // 256] = True
    return y, hit


def by_group(values, group_size: int) -> np.ndarray:
    """A flat dequantized array [n] -> [G, group_size], padded with its last value."""
    flat = np.asarray(values).reshape(-1)
    return np.pad(flat, (0, -flat.size % group_size), mode="edge").reshape(-1, group_size)


def own_values(q) -> np.ndarray:
    """What `dequantize(q)` must return, from q's own codes and steps in float64 numpy."""
    values = dequantize_groups64(unpack_codes(q.data, q.bits), q.scales, q.offsets)
    return unpad_groups(values, q.shape, len(q.lead))


def check_dequantized(out, q, x) -> None:
    """`out = dequantize(q)` is q's codes times steps (+ offsets) up to float32 rounding (one
    of the product, one of the sum: 2 eps of the input's absmax, doubled for a fused
    multiply-add's reassociation)."""
    assert out.shape == q.shape and out.dtype == jnp.float32
    absmax = float(np.nanmax(np.abs(np.where(np.isfinite(x), x, np.nan)), initial=0.0)) or 1.0
    np.testing.assert_allclose(out, own_values(q), rtol=0, atol=4 * EPS32 * absmax,
                               equal_nan=True)


class TestQuantize:
    """`impl="auto"` (the kernel on GPU, the jnp reference on CPU) against float64 numpy; the
    twin below runs the same assertions on the interpreted Pallas kernel."""

    INTERPRET = False

    def kw(self):
        return dict(impl="pallas", interpret=True) if self.INTERPRET else dict(impl="auto")

    @pytest.mark.parametrize("bits,symmetric,shape,group_size", kinds_by_cases())
    def test_matches_float64(self, shape, group_size, bits, symmetric):
        self.check_matches_float64(shape, group_size, bits, symmetric, jnp.float32)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_matches_float64_low_precision_input(self, dtype):
        self.check_matches_float64((65, 384), 128, 4, False, dtype)

    def check_matches_float64(self, shape, group_size, bits, symmetric, dtype):
        rng = np.random.default_rng(sum(shape) + bits)
        x = jnp.asarray(rng.standard_normal(shape) * 3.0, dtype)
        x64 = np.asarray(x.astype(jnp.float32), np.float64)    # the exact input values
        q = quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, **self.kw())
        expected = quantize64(x64, bits, group_size, symmetric)
        assert q.data.dtype == jnp.int8
        assert q.data.shape == (expected.codes.shape[0], group_size * bits // 8)
        assert_codes_match(unpack_codes(q.data, bits), expected)
        assert_steps_match(q.scales, q.offsets, expected)
        out = dequantize(q, **self.kw())
        check_dequantized(out, q, x64)
        # Accuracy: within one step of the input (the clamped maximum; half a step elsewhere),
        # up to the float32 rounding of the output.
        step = np.repeat(expected.steps, group_size)[:x64.size].reshape(shape)
        error = np.abs(np.asarray(out, np.float64) - x64)
        assert np.all(error <= step + 4 * EPS32 * np.abs(x64).max())

    def kernel_runs(self, group_size: int) -> bool:
        return self.INTERPRET or use_pallas("auto", group_size)

    @pytest.mark.parametrize("bits,symmetric,shape,group_size", kinds_by_cases())
    def test_kernel_matches_reference(self, shape, group_size, bits, symmetric):
        """The Pallas kernel and its jnp reference do the same float32 arithmetic: bit for bit
        the same codes and steps."""
        if not self.kernel_runs(group_size):
            pytest.skip("impl='auto' runs the jnp reference itself off GPU (the interpret twin "
                        "compares the kernel)")
        x = jnp.asarray(np.random.default_rng(sum(shape) + bits).standard_normal(shape) * 3.0,
                        jnp.float32)
        kw = dict(bits=bits, group_size=group_size, symmetric=symmetric)
        q, r = quantize(x, **kw, **self.kw()), quantize_reference(x, **kw)
        np.testing.assert_array_equal(q.data, r.data)
        np.testing.assert_array_equal(q.scales, r.scales)
        if not symmetric:
            np.testing.assert_array_equal(q.offsets, r.offsets)
        np.testing.assert_allclose(dequantize(q, **self.kw()), dequantize_reference(r), rtol=0,
                                   atol=4 * EPS32 * float(jnp.max(jnp.abs(x))))

    # The tests below reuse CASES' shapes and group sizes, so they hit the jit cache.

    @pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
    def test_all_zero_input_gives_finite_zeros(self, bits, symmetric):
        q = quantize(jnp.zeros((1000,)), bits=bits, group_size=8, symmetric=symmetric,
                     **self.kw())
        assert np.all(np.isfinite(q.scales))
        out = dequantize(q, **self.kw())
        assert np.all(np.isfinite(out)) and not np.any(out)

    @pytest.mark.parametrize("symmetric", [True, False])
    def test_constant_and_tiny_groups_are_finite(self, symmetric):
        x = np.zeros(1000, np.float32)
        x[:8], x[8:16], x[16:24] = 3.5, 1e-38, -2.0  # groups of 8: constant, subnormal, constant
        q = quantize(jnp.asarray(x), bits=4, group_size=8, symmetric=symmetric, **self.kw())
        out = np.asarray(dequantize(q, **self.kw()))
        assert np.all(np.isfinite(out))
        # asymmetric: a constant group is its offset, exactly; symmetric: absmax is clamped to
        # 7/8 of itself (DeepSpeed's 2^bits / (2 absmax) scale), the subnormal group to 0.
        np.testing.assert_allclose(out, x, atol=1e-30 if not symmetric else 3.5 / 8)
        expected = quantize64(x, 4, 8, symmetric)
        assert_codes_match(unpack_codes(q.data, 4), expected)
        np.testing.assert_allclose(out, expected.values(), rtol=2 * EPS32, atol=1e-38)

    @pytest.mark.parametrize("bits,symmetric,bad", kinds_by_non_finite())
    def test_non_finite_group_dequantizes_to_nan(self, bits, symmetric, bad):
        x = np.random.default_rng(bits).standard_normal(4097).astype(np.float32)
        y, hit = with_non_finite(x, bad)
        q = quantize(jnp.asarray(y), bits=bits, group_size=256, symmetric=symmetric,
                     **self.kw())
        expected = quantize64(y, bits, 256, symmetric)
        # float64 numpy: a hit group gets codes 0 and step (and offset) NaN, every other group
        # its finite codes and step
        assert np.all(np.isnan(expected.steps) == hit) and not expected.codes[hit].any()
        assert_codes_match(unpack_codes(q.data, bits), expected)
        assert_steps_match(q.scales, q.offsets, expected)
        out = dequantize(q, **self.kw())
        check_dequantized(out, q, y)
        out = by_group(out, 256)
        assert np.all(np.isnan(out[hit])) and np.all(np.isfinite(out[~hit]))

    def test_fp16_overflow_is_not_hidden(self):
        # What issue 10 is about: fp16 gradients that overflowed to +-inf, quantized to int4.
        x = np.random.default_rng(0).standard_normal(4097) * 2e4
        with np.errstate(over="ignore"):
            x16 = jnp.asarray(x.astype(np.float16))  # |x| > 65504 overflows to +-inf
        q = quantize(x16, bits=4, group_size=256, **self.kw())
        out = by_group(dequantize(q, **self.kw()), 256)
        overflowed = ~np.isfinite(by_group(np.asarray(x16, np.float32), 256)).all(-1)
        assert 0 < overflowed.sum() < overflowed.size
        assert np.all(np.isnan(out[overflowed])) and np.all(np.isfinite(out[~overflowed]))


class TestQuantizeInterpret(TestQuantize):
    INTERPRET = True


# Accuracy is a property of the numerics: checked on the default path (the compiled kernel on
# GPU); that the interpreted kernel gives the same codes is what the twin above checks.


# A regression lock, not an independent check: sha256 (first 16 hex digits) of data, scales and
# offsets for `golden_input()`, group size 256, recorded before issue 10's NaN handling: finite
# inputs must keep their codes and steps bit for bit. Regenerate only for a deliberate change of
# numerics, and say so in the change.
# Per backend. The GPU's (H100, jax 0.11.2; `benchmarks/gpu/platform_bits.py` compares the two
# in one process): the same codes; symmetric steps one ulp apart in 4 of 17 groups (XLA:GPU's
# float32 division); the asymmetric offset of the 1e-36 group -1.93e-39, a subnormal XLA:CPU
# flushes to -0.0. The Pallas kernel equals the jnp path bit for bit on both.
GOLDEN_DIGESTS = {
    "cpu": {(8, True): "d7813857364af80b", (8, False): "7efe71e2685de48b",
            (4, True): "5dfcafdd812b4efb", (4, False): "a2188068d31be4b6"},
    "gpu": {(8, True): "2ad9c56a20241995", (8, False): "fefc3ad0a2b44370",
            (4, True): "c2bbe92e7f0841e2", (4, False): "b54c7c242c6937e0"},
}


def golden_input() -> np.ndarray:
    """4097 float32 values from exact integer arithmetic (no RNG, no libm): groups of 256 with
    magnitudes 1/16 .. 16, a zero group, a constant group and one of about 1e-36."""
    i = np.arange(4097)
    x = ((i * 7919) % 4099 - 2049) / 517.0 * 2.0 ** ((i // 256) % 9 - 4)
    x[512:768], x[768:1024] = 0.0, 1.5
    x[1024:1280] *= 1e-36
    return x.astype(np.float32)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
@pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
def test_finite_codes_and_steps_are_bit_identical_to_golden(bits, symmetric, impl):
    q = quantize(jnp.asarray(golden_input()), bits=bits, group_size=256, symmetric=symmetric,
                 impl=impl, interpret=True)
    digest = hashlib.sha256(np.asarray(q.data).tobytes() + np.asarray(q.scales).tobytes())
    if not symmetric:
        digest.update(np.asarray(q.offsets).tobytes())
    assert digest.hexdigest()[:16] == GOLDEN_DIGESTS[jax.default_backend()][bits, symmetric]


@pytest.mark.parametrize("bits,symmetric", KINDS, ids=KIND_IDS)
def test_l1_error_within_5_percent_of_deepspeed(bits, symmetric):
    # DeepSpeed's test: sum |x - dequant(quant(x))| <= 1.05 x that of its float reference.
    x = np.random.default_rng(bits + symmetric).standard_normal(1 << 15).astype(np.float32)
    for group_size in (8, 64, 512, 4096, 16384):
        q = quantize(jnp.asarray(x), bits=bits, group_size=group_size, symmetric=symmetric)
        ours = np.abs(np.asarray(dequantize(q), np.float64) - x).sum()
        ref = np.abs(deepspeed_quantize64(x, bits, group_size, symmetric)[2] - x).sum()
        assert ours <= 1.05 * ref, (group_size, ours / ref)


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_beat_per_tensor_with_outliers(bits):
    # ZeRO++ §3.1: one outlier per 10^4 weights stretches a per-tensor scale for everyone.
    rng = np.random.default_rng(bits)
    w = rng.standard_normal(1 << 16).astype(np.float32) * 0.02
    outliers = rng.choice(w.size, size=w.size // 10_000, replace=False)
    w[outliers] = rng.choice([-1.0, 1.0], size=outliers.size) * 2.0

    def l1(group_size):
        q = quantize(jnp.asarray(w), bits=bits, group_size=group_size)
        return np.abs(np.asarray(dequantize(q)) - w).sum()

    assert l1(w.size) >= 3 * l1(256)


def test_any_size_and_group_size_on_the_jnp_path():
    x = jnp.arange(1001, dtype=jnp.float32) - 500  # not a multiple of 8 (DeepSpeed#4386)
    q = quantize(x, bits=4, group_size=100, impl="jnp")  # not a power of two either
    assert q.data.shape == (11, 50)
    expected = quantize64(np.asarray(x), 4, 100, True)
    assert_codes_match(unpack_codes(q.data, 4), expected)
    np.testing.assert_allclose(dequantize(q), expected.values(), rtol=2 * EPS32)


def test_int4_packs_two_codes_per_byte():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096), jnp.float32)
    q8, q4 = (quantize(x, bits=b, group_size=256) for b in (8, 4))
    assert q8.data.nbytes == 2 * q4.data.nbytes == 4096
    assert q4.nbytes == 2048 + 4 * 16


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=3, group_size=64), "bits=3"),
    (dict(bits=4, group_size=63), "odd"),
    (dict(bits=8, group_size=0), "group_size=0"),
    (dict(bits=8, group_size=96, impl="pallas"), "power of two"),
    (dict(bits=8, group_size=64, impl="cuda"), "impl='cuda'"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(jnp.ones(128), **kwargs)


def test_tiles_validate():
    with pytest.raises(ValueError, match="block_elems=1000"):
        QuantTiles(block_elems=1000)
    x = jnp.linspace(-1, 1, 3000)
    small = quantize(x, bits=8, group_size=64, impl="pallas", interpret=True,
                     tiles=QuantTiles(block_elems=128))
    assert_codes_match(unpack_codes(small.data, 8), quantize64(np.asarray(x), 8, 64))
