"""The batch-invariant mode's attention (`LlamaConfig.batch_invariant`): the training forward's
causal attention and the decode step's attention over a KV cache, both through
`invariant.attention`, so a token's attention output has the same bits whether it is computed
with the whole sequence or one step at a time against a cache of any length: each query's
visible keys are summed in position order, and every other key adds an exact zero."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import invariant, kv_groups, layers
from .paged_attention import is_paged


def attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, cache: Any, *,
           window: int | None, segment_ids: jax.Array | None, sequence: Any,
           sinks: jax.Array | None) -> tuple[jax.Array, Any]:
    """A Llama block's attention in the mode: q [B, T, H, K], k and v [B, T, G, K] ->
    (out [B, T, H, K], cache): `causal_attention` without a cache, `cached_attention` with
    one. Attention sinks (gpt-oss) are refused by name."""
    if sinks is not None:
        raise ValueError("batch_invariant=True with attention sinks: not built; accepted: "
                         "batch_invariant=False")
    if cache is None:
        return causal_attention(q, k, v, window=window, segment_ids=segment_ids,
                                sequence=sequence), None
    return cached_attention(q, k, v, positions, cache, window=window, segment_ids=segment_ids)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                     segment_ids: jax.Array | None = None, sequence: Any = None) -> jax.Array:
    """`layers.causal_attention`'s contract (q [B, T, H, K], k and v [B, T, G, K] -> [B, T, H,
    K]; a sliding `window`; `segment_ids` int [B, T], 0 for padding rows, which give zeros)
    with every sum in a fixed order. Sequence parallelism is refused by name: its attention
    splits the keys over devices."""
    if sequence is not None and sequence.size > 1:
        raise ValueError(f"batch_invariant=True with sequence parallelism (size "
                         f"{sequence.size}): its attention sums keys split over devices; "
                         "accepted: batch_invariant=False or a sequence size of 1")
    b, t = q.shape[:2]
    index = jnp.arange(t)
    visible = layers.visible_keys(index[:, None], index[None, :], window)[None]    # [1, T, S]
    if segment_ids is not None:
        real = segment_ids != layers.PAD_SEGMENT                                      # [B, T]
        visible = (visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
                   & real[:, :, None])
    return invariant.attention(q, k, v, jnp.broadcast_to(visible, (b, t, t)))


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     cache: dict[str, jax.Array], *, window: int | None = None,
                     segment_ids: jax.Array | None = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`layers.cached_attention_naive`'s contract (q [B, T, H, K]; k, v [B, T, G, K] written
    at positions int [B, T] into cache {"k", "v"} [B, S, G, K], then each token attends the
    slots up to its position) with every sum in a fixed order. A paged cache (continuous
    batching) and packed `segment_ids` are refused by name."""
    if is_paged(cache):
        raise ValueError("batch_invariant=True against a paged KV cache (continuous batching): "
                         "the paged attention's sums are not batch-invariant; accepted: static "
                         "batching (HybridEngineConfig.batching='static') or "
                         "batch_invariant=False")
    if segment_ids is not None:
        raise ValueError("segment_ids given with a KV cache: a cache row holds one sequence; "
                         "decode packed sequences as separate rows (segment_ids=None)")
    cache = layers.write_cache(k, v, positions, cache)
    g, s = k.shape[2], cache["k"].shape[1]
    keys, values = (kv_groups.unfold_heads(cache[n], g) for n in ("k", "v"))   # [B, S, G, K]
    visible = layers.visible_keys(positions[:, :, None], jnp.arange(s)[None, None, :],
                                  window)                                          # [B, T, S]
    out = invariant.attention(q, keys.astype(q.dtype), values.astype(v.dtype), visible)
    return out, cache
