"""Quantized collectives of ZeRO++: qwZ's all-gather and qgZ's reduce-scatter.

Call these inside `jax.shard_map` over a mesh with the data axes ("node", "local")
(`zeroxla.make_mesh`); the axis names are arguments, defaulting to those roles' names.
Each is a drop-in for a `lax` collective up to quantization error:

- `quantized_all_gather` ~ `lax.all_gather(shard, axes, tiled=True)`   (qwZ, ZeRO++ §3.1):
  `quantize`, then `gather_quantized`, which also gathers codes kept in storage
  (`quantized_nontrainable_weights`)
- `quantized_reduce_scatter` ~ `lax.psum_scatter(grad, axes, scatter_dimension=0, tiled=True)`
  (qgZ, ZeRO++ §3.3), with `one_hop_quantized_reduce_scatter` as the baseline the paper
  compares against.

The kernels (quantize, swizzle, dequant-reduce) are in `pallas_kernels/`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.pallas_kernels import (
    QuantizedArray,
    dequant_reduce,
    dequant_sum,
    dequantize,
    quantize,
    swizzled_quantize,
)
from zeroxla.sharding.mesh import DATA_AXES, LOCAL_AXIS, NODE_AXIS  # default axis names

# ZeRO++ defaults: int8 weights for qwZ (§3.1), int4 gradients for qgZ (§3.3). Group sizes keep
# the float32 scales to <1% (qwZ) and ~3% (qgZ) of the bytes sent.
QWZ_BITS = 8
QWZ_GROUP_SIZE = 512
QGZ_BITS = 4
QGZ_GROUP_SIZE = 256
# qgZ leaves a gradient unquantized when each device's chunk is smaller than this: int4 codes
# would save under 1 KiB, and tiny tensors would pay quantization error for nothing.
QGZ_MIN_CHUNK = 256


def _axis_size(axis_names: str | Sequence[str]) -> int:
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    return math.prod(lax.axis_size(a) for a in names)


def _exchange(q: QuantizedArray, axis_names) -> QuantizedArray:
    """all-to-all of every array in q along its leading dim: afterwards row j came from peer j."""
    return jax.tree.map(
        lambda a: lax.all_to_all(a, axis_names, split_axis=0, concat_axis=0, tiled=True), q)


def quantized_all_gather(shard: jax.Array, *, axis_names: str | Sequence[str] = DATA_AXES,
                         bits: int = QWZ_BITS, group_size: int = QWZ_GROUP_SIZE,
                         symmetric: bool = True, dtype=None, impl: str = "auto") -> jax.Array:
    """qwZ: quantize the local shard, all-gather codes and scales, dequantize.

    shard: this device's flat partition [m] (other shapes are flattened). Returns the gathered
    flat array [P * m] in `lax.all_gather(shard, axis_names, tiled=True)` order, as `dtype`
    (default: the shard's dtype). The wire carries bits/8 bytes per element plus 4 bytes per
    group instead of the shard's itemsize.
    """
    flat = shard.reshape(-1)
    q = quantize(flat, bits=bits, group_size=group_size, symmetric=symmetric, impl=impl)
    return gather_quantized(q, axis_names=axis_names,
                            dtype=shard.dtype if dtype is None else dtype, impl=impl)


def gather_quantized(q: QuantizedArray, *, axis_names: str | Sequence[str] = DATA_AXES,
                     dtype=jnp.float32, impl: str = "auto") -> jax.Array:
    """All-gather already quantized partitions (codes and scales), dequantize after the gather.

    q: this device's one-row quantized partition of m elements (`q.shape == (m,)`), from
    `quantize` on the fly (qwZ) or from storage (ZeRO++'s quantized_nontrainable_weights).
    Returns the flat [P * m] array of all P partitions in `lax.all_gather(tiled=True)` order.
    """
    if q.lead:
        raise ValueError(f"gather_quantized takes one row of codes; got leading dims {q.lead}")
    gathered = jax.tree.map(lambda a: lax.all_gather(a, axis_names), q)  # each [P, ...]
    peers = gathered.data.shape[0]
    gathered = dataclasses.replace(gathered, shape=(peers, *q.shape))
    return dequantize(gathered, impl=impl).reshape(-1).astype(dtype)  # [P * m]


def uses_quantized_reduce_scatter(numel: int, *, devices: int,
                                  group_size: int = QGZ_GROUP_SIZE,
                                  min_size: int | None = None) -> bool:
    """Whether `quantized_reduce_scatter` quantizes a gradient of `numel` elements.

    Below `min_size` (default: `devices * min(group_size, QGZ_MIN_CHUNK)`, i.e. a chunk per
    device smaller than one group and than `QGZ_MIN_CHUNK`) the int4 codes would save little and
    small tensors (biases, norms) would pay quantization error for nothing, so they go through
    plain `psum_scatter`. A chunk between the two is quantized as one group
    (`qgz_group_size`).
    """
    threshold = devices * min(group_size, QGZ_MIN_CHUNK) if min_size is None else min_size
    return devices > 1 and numel >= threshold


def qgz_group_size(chunk: int, group_size: int) -> int:
    """The group size qgZ quantizes a `chunk`-element partition with: `group_size`, or, for a
    chunk smaller than one group, the power of two >= chunk (one group per partition). DeepSpeed
    quantizes every gradient (bucketed), so a layer smaller than its 2048-element blocks (every
    layer of the tiny models) must still be quantized, not silently sent in full precision."""
    return min(group_size, 1 << max(chunk - 1, 1).bit_length())


def _pad_to_devices(flat_grad: jax.Array, devices: int) -> jax.Array:
    flat = flat_grad.reshape(-1)
    return jnp.pad(flat, (0, -flat.size % devices))


def quantized_reduce_scatter(flat_grad: jax.Array, *, bits: int = QGZ_BITS,
                             group_size: int = QGZ_GROUP_SIZE, symmetric: bool = True,
                             min_size: int | None = None, impl: str = "auto",
                             node_axis: str = NODE_AXIS,
                             local_axis: str | Sequence[str] = LOCAL_AXIS) -> jax.Array:
    """qgZ: reduce-scatter the gradient with int4 codes and a hierarchical two-hop all-to-all.

    flat_grad: this device's full gradient [M] (zero-padded here to a multiple of the P data
    devices). Returns this device's reduced chunk [ceil(M / P)], exactly the layout of
    `lax.psum_scatter(flat_grad, ("node", "local"), scatter_dimension=0, tiled=True)`: the
    device with node index n and local index l gets chunk n * local_size + l.

    Steps (ZeRO++ §3.3, DeepSpeed `all_to_all_quant_reduce`):
      1. swizzled int4 quantization: [local, node, chunk], grouped by local destination;
      2. all-to-all over "local" (intra-node links): row j now comes from local peer j;
      3. dequant_reduce: sum the local contributions in float32, requantize  -> [node, chunk];
      4. all-to-all over "node" (inter-node network): row k now comes from node k;
      5. dequantize and sum the node contributions -> [chunk].
    Each device sends M * bits / 8 bytes over intra-node links and M / local_size * bits / 8
    over the network, instead of 4M (float32) with a ring reduce-scatter.
    Gradients below `uses_quantized_reduce_scatter`'s threshold use plain `psum_scatter`.
    """
    nodes, local = lax.axis_size(node_axis), lax.axis_size(local_axis)
    flat = _pad_to_devices(flat_grad, nodes * local)
    if not uses_quantized_reduce_scatter(flat.size, devices=nodes * local, group_size=group_size,
                                         min_size=min_size):
        both = (node_axis, *((local_axis,) if isinstance(local_axis, str) else local_axis))
        return lax.psum_scatter(flat, both, scatter_dimension=0, tiled=True)
    group_size = qgz_group_size(flat.size // (nodes * local), group_size)
    q = swizzled_quantize(flat, bits=bits, group_size=group_size, nodes=nodes,
                          devices_per_node=local, symmetric=symmetric, impl=impl)
    q = _exchange(q, local_axis)                   # [local_src, node, chunk]
    partial_sums = dequant_reduce(q, impl=impl)    # [node, chunk]: this node's sum per node
    partial_sums = _exchange(partial_sums, node_axis)  # [node_src, chunk]
    return dequant_sum(partial_sums, impl=impl).astype(flat_grad.dtype)  # [chunk]


def one_hop_quantized_reduce_scatter(flat_grad: jax.Array, *, bits: int = QGZ_BITS,
                                     group_size: int = QGZ_GROUP_SIZE, symmetric: bool = True,
                                     impl: str = "auto",
                                     axis_names: Sequence[str] = DATA_AXES) -> jax.Array:
    """The baseline of ZeRO++ §3.3: quantize once, one all-to-all over all P devices, sum.

    Same inputs and output layout as `quantized_reduce_scatter`, with a single quantization
    error per contribution, but all P - 1 sends cross the (slow) network when nodes > 1.
    """
    devices = _axis_size(axis_names)
    flat = _pad_to_devices(flat_grad, devices)
    # nodes=1 makes the swizzle the identity: row p is partition p.
    q = swizzled_quantize(flat, bits=bits, group_size=group_size, nodes=1,
                          devices_per_node=devices, symmetric=symmetric, impl=impl)
    q = _exchange(q, tuple(axis_names))            # [device_src, 1, chunk]
    return dequant_sum(q, impl=impl).reshape(-1).astype(flat_grad.dtype)  # [chunk]
