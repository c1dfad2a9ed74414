"""Tiled MLP (DeepSpeed ALST's `TiledMLP`, Bekman et al. 2025): a block's MLP computed over
chunks of the sequence, so its [B, T, F] intermediate (F ~ 3-4 x D, the largest activation of a
long sequence after attention's scores) exists one chunk at a time.

The MLP acts on each token alone, so chunking the sequence changes nothing but the order of the
sums in the weights' gradients. The chunks run in a `lax.scan` whose body is `jax.checkpoint`ed:
the forward keeps only each chunk's input, and the backward recomputes a chunk's intermediate
just before it differentiates it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def tiled_mlp(mlp: Callable[[jax.Array], jax.Array], h: jax.Array,
              chunk: int | None) -> jax.Array:
    """`mlp(h)` for h [B, T, D] -> [B, T, D'], computed `chunk` tokens at a time (all at once
    when `chunk` is None or at least T). `mlp` must treat each token alone (the parameters it
    reads are closed over). T need not be a multiple of `chunk`: the last chunk is padded with
    zeros, whose outputs are cut away."""
    b, t, d = h.shape
    if chunk is None or chunk >= t:
        return mlp(h)
    if chunk < 1:
        raise ValueError(f"mlp_chunk={chunk}: a chunk holds at least 1 token, or None")
    n = -(-t // chunk)
    padded = jnp.pad(h, ((0, 0), (0, n * chunk - t), (0, 0)))
    chunks = jnp.moveaxis(padded.reshape(b, n, chunk, d), 1, 0)           # [N, B, C, D]

    @jax.checkpoint
    def body(_, x):                                                       # x [B, C, D]
        return None, mlp(x)

    _, out = jax.lax.scan(body, None, chunks)                             # [N, B, C, D']
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, -1)[:, :t]


__all__ = ["tiled_mlp"]
