"""The wire format of ZeRO's all-gather and reduce-scatter: the one place a backend quirk lives.

On GPU and TPU (and any backend but CPU) 16-bit floats travel as themselves: a bf16
`all_gather` and a bf16 `psum_scatter`, which NCCL runs as ring / NVLS collectives and XLA's
collective combiners and pipeliners can act on (DeepSpeed's `communication_data_type` defaults
to the training dtype likewise).

XLA:CPU widens 16-bit float collectives to float32 (the bytes in its compiled program would be
twice what a GPU run sends). On CPU only, 16-bit floats are therefore gathered as their raw
bits (uint16) and reduce-scattered as an all-to-all of raw bits followed by a float32 sum on the
receiver: the bytes on the wire are those of a 16-bit all-gather / reduce-scatter and the sum is
at least as accurate. The choice is made when the program is lowered, per platform
(`lax.platform_dependent`), so a program lowered for CUDA on a CPU machine is the GPU one.
float32 uses `all_gather` / `psum_scatter` as they are everywhere.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def is_16bit_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def all_gather_dim(x: jax.Array, axes: Any, dim: int,
                   groups: list[list[int]] | None = None) -> jax.Array:
    """Tiled all-gather of `x` along `dim` over `axes` (within `groups` of axis indices);
    16-bit floats travel as raw bits."""
    def gather(a):
        return lax.all_gather(a, axes, axis=dim, tiled=True, axis_index_groups=groups)
    if not is_16bit_float(x.dtype):
        return gather(x)

    def as_bits(a):                                   # XLA:CPU
        return lax.bitcast_convert_type(gather(lax.bitcast_convert_type(a, jnp.uint16)), a.dtype)
    return lax.platform_dependent(x, cpu=as_bits, default=gather)


def reduce_scatter_dim(x: jax.Array, axes: Any, dim: int) -> jax.Array:
    """Sum of `x` over the G devices of `axes`, scattered along `dim` (device i gets block i).

    float32: `psum_scatter`. 16-bit: a 16-bit `psum_scatter`, except on CPU, where each device
    sends block j's raw bits to device j (all-to-all, the bytes of a 16-bit reduce-scatter) and
    sums what it receives in float32. Returns float32 with `dim` divided by G.

    A 16-bit `x` is divided by G before it is sent and the result multiplied by G in float32
    (DeepSpeed's gradient pre-division): a native 16-bit sum of G loss-scaled fp16 gradients
    then stays within fp16's range wherever each one does. G a power of two: exact but for
    values in fp16's subnormal range.
    """
    if not is_16bit_float(x.dtype):       # float32 (float64 in a float64 verification run)
        return lax.psum_scatter(x.astype(jnp.promote_types(x.dtype, jnp.float32)), axes,
                                scatter_dimension=dim, tiled=True)
    groups = lax.axis_size(axes)
    x = (x.astype(jnp.float32) / groups).astype(x.dtype)

    def native(a):
        return lax.psum_scatter(a, axes, scatter_dimension=dim, tiled=True).astype(jnp.float32)

    def as_bits(a):                                   # XLA:CPU
        groups = lax.axis_size(axes)
        bits = lax.bitcast_convert_type(a, jnp.uint16)
        received = lax.all_to_all(bits, axes, split_axis=dim, concat_axis=dim, tiled=True)
        # Block j of `dim` now holds device j's contribution to this device's block.
        blocks = received.reshape(*a.shape[:dim], groups, a.shape[dim] // groups,
                                  *a.shape[dim + 1:])
        return lax.bitcast_convert_type(blocks, a.dtype).astype(jnp.float32).sum(axis=dim)
    return lax.platform_dependent(x, cpu=as_bits, default=native) * groups


def all_gather_flat(x: jax.Array, axes: Any, groups: list[list[int]] | None = None) -> jax.Array:
    """`all_gather_dim` of a 1-D array."""
    return all_gather_dim(x, axes, 0, groups)


def reduce_scatter_flat(x: jax.Array, axes: Any) -> jax.Array:
    """`reduce_scatter_dim` of a 1-D array [G*c] -> float32 [c]."""
    return reduce_scatter_dim(x, axes, 0)
