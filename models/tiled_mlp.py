"""Tiled MLP (DeepSpeed ALST's `TiledMLP`, Bekman et al. 2025): per-token work of a block
computed over chunks of the sequence, so its intermediates (the MLP's [B, T, F], F ~ 3-4 x D,
the largest activation of a long sequence after attention's scores; a norm's float32 ones)
exist one chunk at a time.

The work acts on each token alone, so chunking the sequence changes nothing but the order of the
sums in the weights' gradients (accumulated in float32 over the chunks). The chunks run in a
`lax.scan` under a `jax.custom_vjp`: forward keeps only the inputs, and backward, a second scan,
recomputes a chunk's forward just before it differentiates it (`jax.checkpoint`'s schedule).
Both scans read and write 16-bit chunks through their bits (`layers.as_bits`), so XLA:CPU holds
no float32 image of a [B, T, D] input, output or cotangent, into buffers made inside the layer
loop (`layers.scan_stacked`), not hoisted out of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .layers import as_bits, at_least_float32, fresh_zeros, from_bits, scan_stacked


def tiled_mlp(mlp: Callable[[jax.Array], jax.Array], h: jax.Array,
              chunk: int | None) -> jax.Array:
    """`mlp(h)` for h [B, T, D] -> [B, T, D'], computed `chunk` tokens at a time (all at once
    when `chunk` is None or at least T). `mlp` must treat each token alone (the parameters it
    reads are closed over). T need not be a multiple of `chunk`: the last chunk is padded with
    zeros, whose outputs are cut away."""
    return tiled_map(mlp, (h,), chunk)


def effective_chunk(chunk: int | None, seq_len: int) -> int | None:
    """The chunk `tiled_map` runs `seq_len` tokens in: None (all at once, the untiled program)
    when `chunk` is None or holds every token. Two chunk settings with the same effective chunk
    build the same program at that length (`zeroxla plan` compiles it once)."""
    return None if chunk is None or chunk >= seq_len else chunk


def tiled_map(fn: Callable[..., Any], xs: tuple[jax.Array, ...], chunk: int | None) -> Any:
    """`fn(*xs)` for arrays xs [B, T, ...] (float or integer) -> a pytree of [B, T, ...]
    arrays, computed `chunk` tokens at a time as `tiled_mlp`; `fn` treats each token alone and
    closes over its parameters (differentiable: their cotangents are summed over the chunks)."""
    b, t = xs[0].shape[:2]
    if effective_chunk(chunk, t) is None:
        return fn(*xs)
    if chunk < 1:
        raise ValueError(f"mlp_chunk={chunk}: a chunk holds at least 1 token, or None")
    n = -(-t // chunk)

    def chunked(x):                                                       # [N, B, C, ...]
        padded = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(padded.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    chunks = tuple(chunked(x) for x in xs)
    # The parameters `fn` closes over become explicit arguments (a custom_vjp differentiates
    # its arguments only).
    converted, consts = jax.closure_convert(fn, *(c[0] for c in chunks))
    out = _over_chunks(converted, chunks, tuple(consts))
    return jax.tree.map(lambda o: jnp.moveaxis(o, 0, 1).reshape(b, n * chunk, *o.shape[3:])
                        [:, :t], out)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _at(bits: Any, i: jax.Array, like: Any) -> Any:
    """Chunk `i` of each array of `bits` (`as_bits` views of arrays like `like`)."""
    return jax.tree.map(lambda x, a: from_bits(lax.dynamic_index_in_dim(x, i, 0, False), a.dtype),
                        bits, like)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _over_chunks(fn: Callable, chunks: tuple, consts: tuple) -> Any:
    """`fn(*chunk_i, *consts)` for each chunk [B, C, ...] of chunks [N, B, C, ...], stacked."""
    return _forward(fn, chunks, consts)


def _forward(fn, chunks, consts):
    bits = jax.tree.map(as_bits, chunks)
    return scan_stacked(lambda _, i: (None, fn(*_at(bits, i, chunks), *consts)), None,
                        chunks[0].shape[0], after=bits[0])[1]


def _over_chunks_fwd(fn, chunks, consts):
    return _forward(fn, chunks, consts), (chunks, consts)


def _over_chunks_bwd(fn, residuals, g):
    chunks, consts = residuals
    floats = [i for i, c in enumerate(chunks) if _is_float(c)]
    diff_consts = [i for i, c in enumerate(consts) if _is_float(c)]
    bits, g_bits = jax.tree.map(as_bits, chunks), jax.tree.map(as_bits, g)

    def body(acc, i):
        xs, g_i = _at(bits, i, chunks), _at(g_bits, i, g)

        def of_floats(float_xs, float_consts):        # fn of the differentiable arguments
            all_xs, all_consts = list(xs), list(consts)
            for k, x in zip(floats, float_xs):
                all_xs[k] = x
            for k, c in zip(diff_consts, float_consts):
                all_consts[k] = c
            return fn(*all_xs, *all_consts)

        _, pullback = jax.vjp(of_floats, [xs[k] for k in floats],
                              [consts[k] for k in diff_consts])
        d_xs, d_consts = pullback(g_i)
        acc = [a + d.astype(a.dtype) for a, d in zip(acc, d_consts)]
        return acc, list(d_xs)

    after = jax.tree.leaves(g_bits)[0]
    acc0 = [fresh_zeros(consts[k].shape, at_least_float32(consts[k].dtype), after)
            for k in diff_consts]
    acc, d_floats = scan_stacked(body, acc0, chunks[0].shape[0], after)
    d_chunks: list[Any] = [None] * len(chunks)
    for k, d in zip(floats, d_floats):
        d_chunks[k] = d
    d_consts: list[Any] = [None] * len(consts)
    for k, a in zip(diff_consts, acc):
        d_consts[k] = _in_space_of(a.astype(consts[k].dtype), consts[k])
    return tuple(d_chunks), tuple(d_consts)


def _in_space_of(cotangent: jax.Array, primal: Any) -> jax.Array:
    """`cotangent` in the memory space of `primal`: a custom VJP's cotangent must have its
    primal's type, and a closed-over value may live in host memory (a ZeRO-Infinity partition
    that a gathered call `fn` reads, fetched to the device inside it)."""
    space = jax.typeof(primal).memory_space
    if space == jax.typeof(cotangent).memory_space:
        return cotangent
    return jax.device_put(cotangent, space)


_over_chunks.defvjp(_over_chunks_fwd, _over_chunks_bwd)


__all__ = ["tiled_map", "tiled_mlp"]
