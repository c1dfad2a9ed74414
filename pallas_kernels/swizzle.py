"""Swizzled quantization: quantize a flat gradient and lay its partitions out for qgZ's two-hop
all-to-all (ZeRO++ §3.3; DeepSpeed `csrc/quantization/swizzled_quantize.cu`).

A device's flat gradient is conceptually x[nodes, devices_per_node, chunk]: partition (n, l) is
what the device with node index n and local index l will own after the reduce-scatter. qgZ sends
it in two hops: first an intra-node all-to-all (fast links), then an inter-node one. For the
first hop to be a plain all-to-all, everything bound for local peer j -- partitions (n, j) of
every node n -- must be contiguous, so the output is laid out [devices_per_node, nodes, chunk]:
the transpose of the two leading dims (DeepSpeed's 2-node, 4-device example: partitions
0 1 2 3 4 5 6 7 become 0 4 1 5 2 6 3 7). After the first hop, peer j holds [nodes, chunk] for
local index j, and the second hop sends its row n to node n.

The Pallas kernel does the reorder for free: its output BlockSpec writes the block it quantized
from partition (n, l) at (l, n). Each partition is padded to whole groups on its own, so groups
never straddle two destinations.

GPU: the same Triton constraints as `quantization.py`. Partitions are not padded beyond whole
groups (padding would be sent over the network), so the groups per program are the largest power
of two dividing a partition's groups: a partition of an odd number of groups runs one group per
program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ._common import (
    DEFAULT_TILES,
    Impl,
    QuantizedArray,
    QuantTiles,
    block_groups_dividing,
    check_quant_args,
    pad_edge,
    resolve_interpret,
    use_pallas,
)
from .quantization import quantize_groups_reference, quantize_rows_pallas


def _partitions(x: jax.Array, nodes: int, devices_per_node: int, group_size: int):
    """x (size divisible by nodes * devices_per_node) -> ([nodes, dpn, G, gs] padded, chunk)."""
    parts = nodes * devices_per_node
    if nodes < 1 or devices_per_node < 1:
        raise ValueError(f"nodes={nodes} and devices_per_node={devices_per_node} must be >= 1")
    if x.size % parts:
        raise ValueError(f"swizzled_quantize: x.size={x.size} is not divisible by nodes * "
                         f"devices_per_node = {parts}; pad the flat gradient to "
                         f"{math.ceil(x.size / parts) * parts} first")
    chunk = x.size // parts
    groups = math.ceil(chunk / group_size)
    rows = pad_edge(x.reshape(nodes, devices_per_node, chunk), groups * group_size)
    return rows.reshape(nodes, devices_per_node, groups, group_size), chunk


def swizzled_quantize(x: jax.Array, *, bits: int = 4, group_size: int, nodes: int,
                      devices_per_node: int, symmetric: bool = True, impl: Impl = "auto",
                      interpret: bool | None = None,
                      tiles: QuantTiles = DEFAULT_TILES) -> QuantizedArray:
    """Quantizes x (size divisible by nodes * devices_per_node) in the two-hop layout.

    Returns a QuantizedArray with data [devices_per_node, nodes, G, packed] and scales
    [devices_per_node, nodes, G], G = ceil(chunk / group_size), shape
    (devices_per_node, nodes, chunk): element [l, n] is partition n * devices_per_node + l.
    """
    pallas = use_pallas(impl, group_size)
    check_quant_args(bits, group_size, pallas=pallas)
    args = dict(bits=bits, group_size=group_size, nodes=nodes,
                devices_per_node=devices_per_node, symmetric=symmetric)
    if not pallas:
        return swizzled_quantize_reference(x, **args)
    return _swizzled_quantize_pallas(x, **args, interpret=resolve_interpret(interpret),
                                     tiles=tiles)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "nodes", "devices_per_node",
                                             "symmetric", "interpret", "tiles"))
def _swizzled_quantize_pallas(x, *, bits, group_size, nodes, devices_per_node, symmetric,
                              interpret, tiles) -> QuantizedArray:
    rows, chunk = _partitions(x, nodes, devices_per_node, group_size)  # [N, L, G, gs]
    data, steps, offsets = quantize_rows_pallas(
        rows, bits=bits, symmetric=symmetric,
        block_groups=block_groups_dividing(tiles, group_size, rows.shape[2]), swap_lead=True,
        interpret=interpret, tiles=tiles)
    return QuantizedArray(data=data, scales=steps, offsets=offsets,
                          shape=(devices_per_node, nodes, chunk), bits=bits,
                          group_size=group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "nodes", "devices_per_node",
                                             "symmetric"))
def swizzled_quantize_reference(x: jax.Array, *, bits: int = 4, group_size: int, nodes: int,
                                devices_per_node: int, symmetric: bool = True) -> QuantizedArray:
    """Pure-jnp `swizzled_quantize`: quantize each partition, then transpose [N, L] -> [L, N]."""
    check_quant_args(bits, group_size, pallas=False)
    rows, chunk = _partitions(x, nodes, devices_per_node, group_size)
    rows = jnp.swapaxes(rows, 0, 1).astype(jnp.float32)  # [L, N, G, gs]
    data, steps, offsets = quantize_groups_reference(rows, bits=bits, symmetric=symmetric)
    return QuantizedArray(data=data, scales=steps, offsets=offsets,
                          shape=(devices_per_node, nodes, chunk), bits=bits,
                          group_size=group_size)
