"""Building blocks shared by the GPT-2 and Llama families.

Every parameter is an `nnx.Param` with a `logical_axes` tuple; nothing here knows of meshes.
A model's transformer blocks form one `LayerStack`: a single block module whose parameters carry
a leading `layers` dim, run with `lax.scan`. The engine recognises a `LayerStack` by type and runs
it its own way (ZeRO-3 gathers each layer just before it runs, with prefetch; a pipeline gives
each stage its own layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes, invariant, kv_groups, online_softmax

def param(rngs: nnx.Rngs, init: Callable, shape: tuple[int, ...],
          logical_axes: tuple[str, ...]) -> nnx.Param:
    """A float32 parameter of `shape` drawn from `init`, tagged with its logical axis names."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {shape} and logical_axes {logical_axes} differ in rank")
    return nnx.Param(init(rngs.params(), shape, jnp.float32), logical_axes=logical_axes)


def stacked(make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
            rngs: nnx.Rngs) -> nnx.Module:
    """`num_layers` independent blocks as one module whose parameters have a leading [L] dim.

    Each layer gets its own RNG stream (split_rngs); `layers` is prepended to every parameter's
    logical axes so the engine can see the stacking.
    """

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num_layers)
    def create(r: nnx.Rngs) -> nnx.Module:
        return make_block(r)

    blocks = create(rngs)
    for _, variable in nnx.iter_graph(blocks):
        if isinstance(variable, nnx.Param):
            # A block of plain `nnx.Linear` / `nnx.LayerNorm` names no dims: its dims stay
            # unnamed (the engine's rules give unnamed dims a default role).
            names = variable.get_metadata().get("logical_axes")
            if names is None:
                names = (None,) * (variable.get_value().ndim - 1)
            variable.set_metadata("logical_axes", (axes.LAYERS,) + tuple(names))
    return blocks


def call_block(block: nnx.Module, x: Any, args: tuple, cache: Any) -> tuple[Any, Any]:
    """One layer of a stack: `block(x, *args)` (with `cache=` when there is one), its result
    normalised to `(x, cache)`. A block returns `x`, or `(x, cache)` when it keeps a cache."""
    out = block(x, *args) if cache is None else block(x, *args, cache=cache)
    return out if isinstance(out, tuple) else (out, None)


def scan_layers(blocks: nnx.Module, x: Any, *args: Any, cache: Any = None) -> tuple[Any, Any]:
    """Applies a stacked block module layer after layer (`lax.scan`): `x` is carried from layer
    to layer, `args` (e.g. token positions) are seen by every layer, and `cache` (a pytree with a
    leading [L] dim, or None) is sliced per layer (a cache with its own `scan_layers`, the paged
    one, is carried whole). Returns `(x, cache)`."""
    graphdef, state = nnx.split(blocks)
    if hasattr(cache, "scan_layers"):
        return cache.scan_layers(graphdef, state, x, args)

    def body(h, per_layer):
        layer_state, cache_i = per_layer
        return call_block(nnx.merge(graphdef, layer_state), h, args, cache_i)

    return jax.lax.scan(body, x, (state, cache))


class LayerStack(nnx.Module):
    """`num_layers` blocks of one shape, stored stacked (`self.layers`) and run by `lax.scan`.

    `stack(x, *args, cache=None) -> (x, cache)`: each block is called as `block(x, *args)` (and
    `cache=` its layer's slice of `cache` when given) and returns `x` or `(x, cache)`.
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                 rngs: nnx.Rngs):
        self.num_layers = num_layers
        self.layers = stacked(make_block, num_layers, rngs)

    def __call__(self, x: Any, *args: Any, cache: Any = None) -> tuple[Any, Any]:
        return scan_layers(self.layers, x, *args, cache=cache)


def at_least_float32(dtype: Any) -> jnp.dtype:
    """The dtype norms, attention scores, softmax and logits are computed in: float32 for 16-
    and 32-bit activations, float64 for float64 ones (a float64 verification run must not pass
    through float32, whose round-off it exists to remove)."""
    return jnp.promote_types(dtype, jnp.float32)


# Loops here read and write 16-bit float arrays block by block through their raw bits: XLA:CPU
# has no 16-bit float dynamic-slice or dynamic-update-slice; its float normalization converts the
# whole operand to float32 in the loop, and loop-invariant code motion hoists that convert, so a
# float32 image (twice the bytes) lives through the loop. uint16 ones are native; other backends
# reinterpret the bits in place. A loop's output buffers are made by `fresh_zeros`.
def as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as its uint16 bits (for slicing in a loop); other arrays as they are."""
    is_16bit = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if is_16bit else x


def from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    """`as_bits`' inverse: `x` read as `dtype` when that is a 16-bit float."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def fresh_zeros(shape: tuple[int, ...], dtype: Any, after: jax.Array) -> jax.Array:
    """Zeros that XLA cannot make before `after` exists. A broadcast zero is loop-invariant: made
    inside the layer loop (a scan's output buffer, an accumulator), XLA hoists it out and keeps it,
    with a copy for each iteration's in-place writes, through the whole loop. p - p is 0 for a
    finite p and XLA does not fold it (inf - inf is NaN); an optimization barrier, it drops."""
    p = after.reshape(-1)[0].astype(jnp.float32)
    zero = jnp.where(jnp.isfinite(p), p - p, 0.0)
    return jnp.broadcast_to(zero.astype(dtype), shape)


def scan_stacked(body: Callable, carry: Any, n: int, after: jax.Array) -> tuple[Any, Any]:
    """`lax.scan(body, carry, arange(n))`, its per-step outputs written into `fresh_zeros`
    buffers (16-bit floats as bits): `(carry, ys)`, ys stacked on a leading [n] dim."""
    shapes = jax.eval_shape(lambda c: body(c, jnp.int32(0))[1], carry)
    bufs = jax.tree.map(lambda a: fresh_zeros((n, *a.shape), as_bits(
        jnp.zeros((), a.dtype)).dtype, after), shapes)

    def step(state, i):
        c, ys = state
        c, y = body(c, i)
        return (c, jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(
            b, as_bits(v), i, 0), ys, y)), None

    (carry, bufs), _ = jax.lax.scan(step, (carry, bufs), jnp.arange(n))
    return carry, jax.tree.map(lambda b, a: from_bits(b, a.dtype), bufs, shapes)


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim, computed in float32 (GPT-2), or float64 for float64 input."""

    def __init__(self, dim: int, *, eps: float = 1e-5):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axes.EMBED,))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), logical_axes=(axes.EMBED,))

    def __call__(self, x: jax.Array) -> jax.Array:
        acc = at_least_float32(x.dtype)
        h = x.astype(acc)
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.scale[...].astype(acc) + self.bias[...].astype(acc)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim, computed in float32 (Llama), or float64 for float64 input.
    `axis` names the normalised dim (`embed`; `head_dim` for Qwen3's per-head q/k norms). The
    output is scaled by `offset + scale` (Gemma's `1 + w`: offset 1, scale initialised to 0).
    `invariant`: the squares summed in a fixed order (`models.invariant`, the batch-invariant
    mode)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, axis: str = axes.EMBED,
                 offset: float = 0.0, invariant: bool = False):
        self.eps, self.offset, self.invariant = eps, offset, invariant
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32), logical_axes=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        acc = at_least_float32(x.dtype)
        h = x.astype(acc)
        if self.invariant:
            h = invariant.rms_norm(h, self.eps)
        else:
            h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)
        return (h * (self.offset + self.scale[...].astype(acc))).astype(x.dtype)


def default_positions(tokens: jax.Array) -> jax.Array:
    """Positions 0..T-1 of every row of `tokens` [B, T] -> int32 [B, T]."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def stack_args(tokens: jax.Array, positions: jax.Array | None,
               segment_ids: jax.Array | None, sequence: Any = None,
               experts: Any = None) -> tuple[Any, ...]:
    """What a family passes its `LayerStack` after x: (positions,), (positions, segment_ids)
    for a packed batch, (positions, segment_ids or None, sequence) under sequence parallelism
    (`SequenceParallel`), and (positions, segment_ids or None, sequence or None, experts)
    under expert parallelism (`ExpertParallel`: an MoE family's blocks take it). positions
    default to 0..T-1 (this device's slice of them under sequence parallelism); a packed batch
    must give its own: ValueError otherwise."""
    if segment_ids is not None:
        if positions is None:
            raise ValueError("segment_ids given without positions: a packed row's sequences "
                             "each start at 0; pass positions [B, T] with the segment ids")
        if segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {tokens.shape}")
    if positions is None:
        positions = sequence.positions(tokens) if sequence else default_positions(tokens)
    if experts is not None:
        return positions, segment_ids, sequence, experts
    if sequence is not None:
        return positions, segment_ids, sequence
    return (positions,) if segment_ids is None else (positions, segment_ids)


def forward_stack(model: Any, tokens: jax.Array, positions: jax.Array | None,
                  segment_ids: jax.Array | None, sequence: Any = None, carry: Any = None,
                  experts: Any = None, tail: LayerStack | None = None) -> Any:
    """`model.blocks`' output [B, T, D] (before the final norm; with `carry`, the last carry of
    the stack run on `carry(x)`, an MoE's `Routed`) for tokens int [B, T]: the length rule, embed,
    the stack (`stack_args`), then `tail` (a stack after it) on the same arguments. Under
    sequence parallelism `tokens` are this device's [B, T/P]; `experts` (an MoE family's) goes
    to every block."""
    parts = 1 if sequence is None else sequence.size
    model.config.check_seq_len(tokens.shape[1] * parts, "sequence length")
    args = stack_args(tokens, positions, segment_ids, sequence, experts)
    x = model.embed(tokens, args[0])
    x = model.blocks(x if carry is None else carry(x), *args)[0]
    return x if tail is None else tail(x, *args)[0]


def visible_keys(query_pos: jax.Array, key_pos: jax.Array, window: int | None) -> jax.Array:
    """Which keys a query attends: key position <= query position and, with a sliding `window`
    (Mistral's `sliding_window`), key position > query position - window (the query and the
    window - 1 tokens before it, transformers' `sliding_window_overlay`). Broadcasts."""
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def attention_scores(q: jax.Array, k: jax.Array, scale: float | None, softcap: float | None,
                     spec: str = "BTGRK,BSGK->BGRTS") -> jax.Array:
    """q [B, T, G, R, K] . k [B, S, G, K] -> scores [B, G, R, T, S] (another layout by `spec`) in
    float32 (float64 for float64 input), times `scale` (default 1/sqrt(K)), soft-capped to
    (-softcap, softcap) as Gemma 2 does (`softcap * tanh(scores / softcap)`) when set."""
    scores = jnp.einsum(spec, q, k, preferred_element_type=at_least_float32(q.dtype))
    scores = scores / jnp.sqrt(q.shape[-1]) if scale is None else scores * scale
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


# Segment id of padding in `segment_ids` (MaxText's convention): such a query attends to no key,
# its output is zeros and no gradient flows through it. Real sequences are numbered from 1.
PAD_SEGMENT = 0


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     segment_ids: jax.Array | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Causal softmax attention with grouped-query heads (and a sliding `window`, see
    `visible_keys`; `scale` and `softcap`, see `attention_scores`): the naive reference, which
    holds the whole [B, G, R, T, T] score tensor.

    q [B, T, H, K], k and v [B, T, G, K] with H a multiple of G -> [B, T, H, K]. Scores and
    softmax in float32 (float64 for float64 input). `segment_ids` int [B, T] (packed
    sequences): a query sees only keys of its own segment; `PAD_SEGMENT` rows give zeros.
    `sinks` [H]: attention sinks (`online_softmax.sink_softmax`).
    """
    b, t, h, d = q.shape
    g = k.shape[2]
    q = q.reshape(b, t, g, h // g, d)
    scores = attention_scores(q, k, scale, softcap)
    mask = visible_keys(jnp.arange(t)[:, None], jnp.arange(t)[None, :], window)[None]  # [1,T,S]
    if segment_ids is not None:
        real = segment_ids != PAD_SEGMENT                                    # [B, T]
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :]) & real[:, :, None]
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = online_softmax.sink_softmax(scores, sinks).astype(v.dtype)
    out = jnp.einsum("BGRTS,BSGK->BTGRK", probs, v).reshape(b, t, h, d)
    if segment_ids is not None:          # a padding row saw no key: zeros, not a uniform mix
        out = out * real[:, :, None, None].astype(out.dtype)
    return out


# A KV cache is `{"k": [L, B, S, G, K], "v": [L, B, S, G, K]}`; these name its dims, as
# `logical_axes` name a parameter's, so an engine lays it out with the same rules table.
KV_CACHE_AXES = (axes.LAYERS, axes.BATCH, axes.CACHE_LENGTH, axes.KV_HEADS, axes.HEAD_DIM)


def init_kv_cache(num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                  dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    """A zeroed KV cache: `{"k", "v"}`, each [L, B, max_len, G, K] (dims named `KV_CACHE_AXES`):
    slot s of a row holds its token at position s, so rows of different lengths share it."""
    shape = (num_layers, batch, max_len, kv_heads, head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


# Cache slots one step of `cached_attention` reads at a time (temporaries [B, H, T, 512] float32).
CACHE_BLOCK = 512


def write_cache(k: jax.Array, v: jax.Array, positions: jax.Array,
                cache: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`cache` {"k", "v"} [B, S, C, G K / C] with token (b, t)'s k, v [B, T, G, K] written to
    slot positions[b, t], G / C heads side by side per group (`kv_groups`; C = G: [B, S, G, K])."""
    fold = functools.partial(kv_groups.fold_heads, groups=cache["k"].shape[2])
    write = jax.vmap(lambda c, new, pos: c.at[pos].set(fold(new).astype(c.dtype)))
    return {"k": write(cache["k"], k, positions), "v": write(cache["v"], v, positions)}


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     cache: dict[str, jax.Array], *, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     block: int = CACHE_BLOCK, sinks: jax.Array | None = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Attention of new tokens against one layer's KV cache, after writing their keys/values;
    equal to `cached_attention_naive` (which says what is attended) but reading the cache
    `block` slots at a time with an online softmax (flash-decoding's split over S), so no
    [B, H, T, S] score tensor exists, and visiting only the blocks up to the largest position
    (and, with a window, from the smallest position's first visible slot).

    q [B, T, H, K]; k, v [B, T, G, K]; positions int [B, T]; cache {"k", "v"} [B, S, G, K]
    (or its heads in C groups, [B, S, C, G K / C], `write_cache`); sinks [H] or None
    (`online_softmax.sink_rescale`). Returns (out [B, T, H, K], updated cache).
    """
    b, t, h, d = q.shape
    g = k.shape[2]
    cache = write_cache(k, v, positions, cache)
    s = cache["k"].shape[1]
    bk = min(block, s)
    qg = q.reshape(b, t, g, h // g, d)
    acc_dtype = at_least_float32(q.dtype)
    hi = jnp.minimum(-(-s // bk), jnp.max(positions) // bk + 1)
    lo = 0 if window is None else jnp.maximum(0, (jnp.min(positions) - window + 1) // bk)

    def kv_step(j, state):                        # m, l [B, G, R, T], acc [B, G, R, T, K]
        # The last block may overlap the one before it (S not a multiple of bk): its slots
        # below j * bk were already summed and are masked here.
        start = jnp.minimum(j * bk, s - bk)
        k_blk, v_blk = (kv_groups.unfold_heads(jax.lax.dynamic_slice_in_dim(
            cache[n], start, bk, 1), g).astype(dt) for n, dt in (("k", q.dtype), ("v", v.dtype)))
        slot = start + jnp.arange(bk)                                          # [bk]
        visible = (visible_keys(positions[:, :, None], slot[None, None, :], window)
                   & (slot >= j * bk))[:, None, None]                         # [B, 1, 1, T, bk]
        return online_softmax.step(state, attention_scores(qg, k_blk, scale, softcap), v_blk,
                                   visible, "BGRTS,BSGK->BGRTK")

    state = jax.lax.fori_loop(lo, hi, kv_step,
                              online_softmax.start((b, g, h // g, t), d, acc_dtype))
    out, lse = online_softmax.finish(state, jnp.inf)    # every token sees its own slot: l > 0
    if sinks is not None:
        out = online_softmax.sink_rescale(out, lse, sinks.reshape(g, h // g, 1))
    out = jnp.einsum("BGRTK->BTGRK", out).astype(v.dtype)
    return out.reshape(b, t, h, d), cache


def cached_attention_naive(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                           cache: dict[str, jax.Array], *, window: int | None = None,
                           scale: float | None = None, softcap: float | None = None,
                           sinks: jax.Array | None = None
                           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Attention of new tokens against one layer's KV cache, after writing their keys/values:
    the reference, holding the whole [B, G, R, T, S] score tensor.

    q [B, T, H, K]; k, v [B, T, G, K]; positions int [B, T] (each row its own); cache {"k", "v"}
    [B, S, G, K]. Token (b, t) is written to slot positions[b, t] and attends to the slots
    s <= positions[b, t] of its row (and, with a sliding `window`, s > positions[b, t] - window:
    `visible_keys`). Every slot below a row's current position was written by
    this generation (the prompt's prefill, then one token per step), so a slot holding a
    padding token or an earlier generation's data is never attended: with right-padded prompts
    a pad's slot lies above the row's position until a real token overwrites it. `sinks` [H]:
    attention sinks (`online_softmax.sink_softmax`). Returns (out [B, T, H, K], updated cache).
    """
    b, t, h, d = q.shape
    g = k.shape[2]
    cache = write_cache(k, v, positions, cache)
    s = cache["k"].shape[1]
    q = q.reshape(b, t, g, h // g, d)
    keys, values = (kv_groups.unfold_heads(cache[n], g) for n in ("k", "v"))  # [B, S, G, K]
    scores = attention_scores(q, keys.astype(q.dtype), scale, softcap)
    visible = visible_keys(positions[:, :, None], jnp.arange(s)[None, None, :], window)  # [B,T,S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = online_softmax.sink_softmax(scores, sinks).astype(v.dtype)
    out = jnp.einsum("BGRTS,BSGK->BTGRK", probs, values.astype(v.dtype))
    return out.reshape(b, t, h, d), cache


def decode(model: Any, tokens: jax.Array, positions: jax.Array,
           cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One cached forward of any model with the `embed` / `blocks` / `head` protocol.

    tokens, positions int32 [B, T]; cache {"k", "v"} [L, B, S, G, K] with S > every position.
    Prefill is a call with the (right-padded) prompts at positions 0..T-1; each decode step is
    a call with T = 1 at each row's own next position. Returns (logits float32 [B, T, V],
    updated cache)."""
    x = model.embed(tokens, positions)                                   # [B, T, D]
    x, cache = model.blocks(x, positions, cache=cache)
    return model.head(x), cache


def normal(stddev: float) -> Callable[..., Any]:
    """`jax.nn.initializers.normal(stddev)`; named here so model files read as the papers do."""
    return jax.nn.initializers.normal(stddev)
