"""One KV cache for layers of different key-value shapes (Gemma 4: sliding layers of G heads of
K dims and a global layer of G' heads of K' dims in one block of the stack).

The cache's head dim holds C groups, C = gcd of the layers' KV head counts (`cache_groups`),
and a layer of G heads of K keeps G / C of its heads side by side in each group: its keys
[.., G, K] are stored as [.., C, G K / C] (`fold_heads`, a row-major reshape), so each group
holds a contiguous run of the layer's heads. Tensor parallelism splits the cache's C groups
over the `tensor` axis and each layer's weights over its own heads, in contiguous blocks
both: a device holds, in its groups, exactly the heads its weights project (replicated KV
heads, `inference.layout`'s kv_repeat, scale every count alike and change no width).

A block of layers keeps them side by side on the last dim, layer j at its own offset, G_j K_j
/ C wide (`gemma2.run_layers`): a slot costs sum_j G_j K_j, each layer's own size, nothing
padded. Layers of one shape (C = G) store [.., G, K] as they always did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax


def cache_groups(kv_heads: Sequence[int]) -> int:
    """C: the greatest common divisor of the layers' KV head counts."""
    return math.gcd(*kv_heads)


def fold_widths(shapes: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Each layer's width on the cache's last dim, G K / C, for layers of (G, K) `shapes`."""
    groups = cache_groups([g for g, _ in shapes])
    return tuple(g * k // groups for g, k in shapes)


def fold_heads(x: jax.Array, groups: int) -> jax.Array:
    """x [..., G, K] -> [..., C, G K / C] for C = `groups` (G / C heads side by side per
    group); ValueError naming both counts unless C divides G."""
    heads = x.shape[-2]
    if heads % groups:
        raise ValueError(f"a KV cache of {groups} head groups cannot hold a layer of {heads} KV "
                         "heads; accepted: groups dividing every layer's KV heads "
                         "(kv_groups.cache_groups)")
    return x.reshape(*x.shape[:-2], groups, -1)


def unfold_heads(x: jax.Array, heads: int) -> jax.Array:
    """`fold_heads`' inverse: x [..., C, G K / C] -> [..., G, K] for G = `heads`."""
    return x.reshape(*x.shape[:-2], heads, -1)


def unfold_leading(x: jax.Array, heads: int) -> jax.Array:
    """A page pool's block with its groups first: x [C, N, S, G K / C] -> [G, N, S, K] for
    G = `heads` (group c's heads become heads c G / C .. (c + 1) G / C - 1)."""
    groups, n, s, width = x.shape
    per = heads // groups
    x = x.reshape(groups, n, s, per, width // per)
    return x.transpose(0, 3, 1, 2, 4).reshape(heads, n, s, width // per)


__all__ = ["cache_groups", "fold_heads", "fold_widths", "unfold_heads", "unfold_leading"]
