"""USP (Fang & Zhao 2024, "unified sequence parallelism"): DeepSpeed-Ulysses inside groups of
consecutive sequence devices, ring attention across the groups, so that a degree the heads do
not divide still splits heads as far as they allow (a 14-head Qwen2.5-0.5B at P = 8: Ulysses
over 2, a ring of 4) instead of falling back to a ring over all P.

The layout is the ring's (`sequence_parallel.zigzag_order`): the sequence is cut into 2P chunks
of c tokens and device d holds chunks d and 2P - 1 - d. With U the Ulysses degree (the largest
divisor of P that divides the query heads, `ulysses_degree`) and R = P / U, device d = j U + i
is member i of Ulysses group j; the group's 2U chunks are j U .. j U + U - 1 and their mirror
images, i.e. the two zigzag chunks j and 2R - 1 - j of a ring of R over chunks of U c tokens.
So one layer's attention is

    q [B, 2c, H, K] --all-to-all in the group--> [B, 2Uc, H/U, K]   (k, v alike, G' heads)
    reorder the group's chunks into its two ring chunks (ascending within each)
    ring attention over the R groups' members i (`ring_attention(..., stride=U)`)
    undo the reorder, all-to-all back                                [B, 2c, H, K]

The all-to-alls stay inside a group (`axis_index_groups`: consecutive devices, one host's fast
links); the ring's ppermutes link device j U + i to (j + 1) U + i. Per layer and device the
Ulysses part moves (U - 1) / U of q, k, v and the output, the ring (R - 1) hops of the group's
keys and values for H/U heads (`usp_elements`). U = P is Ulysses on the zigzag layout (no
ring: the group holds the whole sequence, in order); U = 1 is the ring. KV heads the Ulysses
degree does not divide are repeated first (`sequence_parallel.kv_repeats`), as Ulysses does.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from .ring_attention import ring_attention, ring_elements
from .sequence_parallel import ATTENTION_SCOPE, SequenceParallel, kv_repeats


def ulysses_degree(heads: int, degree: int) -> int:
    """U: the largest divisor of the sequence degree P that divides the query heads."""
    return max(u for u in range(1, degree + 1) if degree % u == 0 and heads % u == 0)


def _groups(sequence: SequenceParallel, u: int) -> list[list[int]]:
    """The Ulysses groups: U consecutive devices of the sequence axis each."""
    return [[j * u + i for i in range(u)] for j in range(sequence.size // u)]


def _to_ring_order(x: jax.Array, u: int) -> jax.Array:
    """[B, U x 2c, ...] as the all-to-all concatenates it (member i's chunks j U + i, then
    2P - 1 - j U - i) -> the group's two ring chunks, each ascending: [B, 2 U c, ...]."""
    b, t = x.shape[:2]
    pieces = x.reshape(b, u, 2, t // (2 * u), *x.shape[2:])              # [B, U, 2, c, ...]
    first, second = pieces[:, :, 0], pieces[:, ::-1, 1]                  # ascending chunks
    return jnp.concatenate([first, second], axis=1).reshape(x.shape)


def _from_ring_order(x: jax.Array, u: int) -> jax.Array:
    """The inverse of `_to_ring_order`."""
    b, t = x.shape[:2]
    halves = x.reshape(b, 2, u, t // (2 * u), *x.shape[2:])              # [B, 2, U, c, ...]
    pieces = jnp.stack([halves[:, 0], halves[:, 1, ::-1]], axis=2)       # [B, U, 2, c, ...]
    return pieces.reshape(x.shape)


@jax.named_scope(ATTENTION_SCOPE)     # what the step reads as proof of use
def usp_attention(attend: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
                  sequence: SequenceParallel, segment_ids: jax.Array | None = None,
                  **options: Any) -> jax.Array:
    """The whole sequences' attention at this device's two zigzag chunks (module docstring):
    q [B, 2c, H, K], k and v [B, 2c, G, K], segment_ids int [B, 2c] -> [B, 2c, H, K].
    `attend(q, k, v, segment_ids=, **options)` is the attention of whole sequences, used when
    the Ulysses degree is P (no ring); `options` holds window, scale and softcap (and, for
    `attend` alone, the implementation)."""
    p, h, g = sequence.size, q.shape[2], k.shape[2]
    u = ulysses_degree(h, p)
    ring_options = {key: options[key] for key in ("window", "scale", "softcap") if key in options}
    if u == 1:
        return ring_attention(q, k, v, sequence, segment_ids, **ring_options)
    groups = _groups(sequence, u)
    m = kv_repeats(h, g, u)
    if m > 1:
        k, v = jnp.repeat(k, m, axis=2), jnp.repeat(v, m, axis=2)          # [B, 2c, G*m, K]

    def to_heads(x):                                  # [B, 2c, N, K] -> [B, 2Uc, N/U, K]
        return _to_ring_order(lax.all_to_all(x, sequence.axis, 2, 1, tiled=True,
                                             axis_index_groups=groups), u)

    q, k, v = (to_heads(x) for x in (q, k, v))
    segments = None if segment_ids is None else _to_ring_order(lax.all_gather(
        segment_ids, sequence.axis, axis=1, tiled=True, axis_index_groups=groups), u)
    if u == p:              # one group: the whole sequence, in order
        out = attend(q, k, v, segment_ids=segments, **options)
    else:
        out = ring_attention(q, k, v, sequence, segments, stride=u, **ring_options)
    return lax.all_to_all(_from_ring_order(out, u), sequence.axis, 1, 2, tiled=True,
                          axis_index_groups=groups)                       # [B, 2c, H, K]


def usp_elements(tokens: int, heads: int, kv_heads: int, head_dim: int,
                 degree: int) -> dict[str, int]:
    """Elements one device sends per layer in USP's forward: "all_to_all" (each way the same)
    (T/P)(2H + 2G')K (U-1)/U, G' the KV heads after `kv_repeats` at degree U; "ring" the
    keys and values of the group's T/R tokens for G'/U heads over R - 1 hops (backward:
    `ring_elements`' "backward" and "gradients" of the same shape)."""
    u = ulysses_degree(heads, degree)
    kv = kv_heads * kv_repeats(heads, kv_heads, u)
    a2a = tokens // degree * (2 * heads + 2 * kv) * head_dim * (u - 1) // u
    ring = ring_elements(tokens, kv // u, head_dim, degree // u) if u < degree else {
        "forward": 0, "backward": 0, "gradients": 0}
    return {"all_to_all": a2a, **{f"ring_{k}": n for k, n in ring.items()}}


__all__ = ["ulysses_degree", "usp_attention", "usp_elements"]
