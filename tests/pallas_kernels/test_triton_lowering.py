"""Every kernel lowers to Triton IR for CUDA, from this (CPU-only) machine.

`zeroxla.compat.lowering.lower_for_cuda` runs the Pallas Triton lowering (jaxpr -> Triton IR)
without a GPU, for compute capability 9.0; only Triton -> PTX compilation needs one. This catches
what interpret mode cannot: primitives Triton has no rule for (e.g. `round`) and blocks whose
size is not a power of two.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import zeroxla.pallas_kernels as pk
from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.pallas_kernels.quantization import _dequantize_pallas, _quantize_pallas
from zeroxla.pallas_kernels.reduction import _dequant_reduce_pallas, _dequant_sum_pallas
from zeroxla.pallas_kernels.swizzle import _swizzled_quantize_pallas

pytest.importorskip("jax._src.lib.triton", reason="jaxlib without Triton bindings")

TILES = pk.QuantTiles()


def triton_calls(fn, *args):
    text = lower_for_cuda(jax.jit(fn), *args).as_text()
    return re.findall(r"custom_call @(\S+)\(", text)


@pytest.mark.parametrize("group_size", [8, 16384])  # 512 groups per program .. one
@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)], ids=["int8-sym", "int4-asym"])
def test_kernels_lower_to_triton(group_size, bits, symmetric):
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric)
    x = jnp.ones((4097,), jnp.bfloat16)
    flat = jnp.ones((3 * 2 * 1000,), jnp.float32)
    swizzled = pk.swizzled_quantize(flat, nodes=2, devices_per_node=3, impl="jnp", **kw)
    calls = (
        triton_calls(lambda x: _quantize_pallas(x, **kw, interpret=False, tiles=TILES), x)
        + triton_calls(lambda q: _dequantize_pallas(q, interpret=False, tiles=TILES),
                       pk.quantize(x, impl="jnp", **kw))
        + triton_calls(lambda x: _swizzled_quantize_pallas(
            x, nodes=2, devices_per_node=3, **kw, interpret=False, tiles=TILES), flat)
        # N = 3 stacked tensors: not a power of two, which the kernel's loop allows.
        + triton_calls(lambda q: _dequant_reduce_pallas(q, interpret=False, tiles=TILES),
                       swizzled)
        + triton_calls(lambda q: _dequant_sum_pallas(q, interpret=False, tiles=TILES),
                       swizzled))
    assert calls == ["__gpu$xla.gpu.triton"] * 5


def test_non_power_of_two_groups_are_rejected_before_lowering():
    with pytest.raises(ValueError, match="power of two"):
        pk.quantize(jnp.ones(4097), group_size=96, impl="pallas")
