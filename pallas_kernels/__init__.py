"""ZeRO++ quantization kernels in Pallas, each with a pure-jnp reference.

- `quantize` / `dequantize`: block quantization to int8 / packed int4 (qwZ, ZeRO++ §3.1).
- `swizzled_quantize`: quantization laid out for qgZ's two-hop all-to-all (ZeRO++ §3.3).
- `dequant_reduce` / `dequant_sum`: sum N received quantized tensors, requantize (qgZ).

This package imports nothing from `zeroxla`; the collectives built on it live in
`zeroxla/collectives/quantized.py`.
"""

from ._common import QuantizedArray, QuantTiles
from .quantization import (
    dequantize,
    dequantize_reference,
    quantize,
    quantize_reference,
)
from .reduction import (
    dequant_reduce,
    dequant_reduce_reference,
    dequant_sum,
    dequant_sum_reference,
)
from .swizzle import swizzled_quantize, swizzled_quantize_reference

__all__ = [
    "QuantTiles",
    "QuantizedArray",
    "dequant_reduce",
    "dequant_reduce_reference",
    "dequant_sum",
    "dequant_sum_reference",
    "dequantize",
    "dequantize_reference",
    "quantize",
    "quantize_reference",
    "swizzled_quantize",
    "swizzled_quantize_reference",
]
