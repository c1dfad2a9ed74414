"""Ring attention (Liu et al. 2023; Brandon et al.'s striped / zigzag balance): context
parallelism that passes key/value chunks around the sequence devices instead of gathering them.

Layout (the same as all-gather context parallelism, `sequence_parallel.zigzag_order`): the
sequence is cut into 2P chunks of c = T / 2P tokens and device r holds chunks r and 2P - 1 - r,
so that under the causal mask every device does the same work.

Forward, P steps: at step s device r holds the keys and values of device (r - s) mod P (its two
chunks). Each local query chunk attends each chunk in hand with FlashAttention-2's blockwise
forward at their relative offset (`blockwise_attention._forward`, visiting only the key blocks
the causal mask and window leave visible, so a chunk entirely in the future costs no block),
and the partial results merge by their logsumexps (`online_softmax.merge`: o = Σ o_i
exp(lse_i - lse), lse = log Σ exp(lse_i)); then every device sends what it holds to device
r + 1 (`lax.ppermute`). Only one chunk pair of keys and values is in hand at a time:
per-device memory stays T / P.

Backward (a `jax.custom_vjp`), P steps again: the keys and values travel the ring once more,
the other way round (device r -> r - 1: the same hops forward would be one computation to XLA,
which merges them and keeps every device's keys and values alive from the forward to the
backward), each with its float32 gradient accumulators dk, dv; each device adds the gradients of its
queries' attention over the chunks in hand (`blockwise_attention._backward` with the rows'
final output and logsumexp: P = exp(S - lse) is then the exact softmax over that part) to dq
(local) and to the travelling dk, dv, and a last hop brings each dk, dv home. The rows'
logsumexp is an output with a cotangent (attention sinks, `online_softmax.sink_rescale`, are
applied from it after the ring), which each pair's backward takes as its D - dL.

Bytes (elements sent per device per layer): forward (P - 1) x (T / P) x 2G x K (the keys and
values, P - 1 hops); backward (P - 1) x (T / P) x 2G x K again plus P x (T / P) x 2G x K
gradients in the accumulation dtype (`ring_elements`).

Chunks whose length is not a multiple of the block are padded inside; the padded keys and
queries get segment id 0 (padding), which the blockwise mask hides from every real query.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import layers, online_softmax
from .blockwise_attention import KV_BLOCK, PAD_SEGMENT, Q_BLOCK, _backward, _forward, _Plan
from .sequence_parallel import ATTENTION_SCOPE, SequenceParallel


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static half of one call: the sequence devices, the real chunk length c, the
    blockwise plan (blocks of at most c) and the `stride`: the ring links every stride-th
    sequence device (USP, `models.usp_attention`: the devices of one Ulysses group are
    consecutive; device d is at ring position d // stride of a ring of P / stride)."""

    sequence: SequenceParallel
    chunk: int
    plan: _Plan
    stride: int = 1

    @property
    def size(self) -> int:
        """Devices in the ring."""
        return self.sequence.size // self.stride

    def position(self) -> jax.Array:
        """This device's place j in its ring: it holds chunks j and 2R - 1 - j."""
        return self.sequence.index() // self.stride


@jax.named_scope(ATTENTION_SCOPE)     # what the step reads as proof of use
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, sequence: SequenceParallel,
                   segment_ids: jax.Array | None = None, *, window: int | None = None,
                   scale: float | None = None, softcap: float | None = None,
                   sinks: jax.Array | None = None, stride: int = 1) -> jax.Array:
    """The whole sequences' causal attention at this device's two zigzag chunks, inside a
    `shard_map` over `sequence.axis`: q [B, 2c, H, K], k and v [B, 2c, G, K],
    segment_ids int [B, 2c] (this device's chunks r and 2P - 1 - r, in that order) ->
    [B, 2c, H, K] (module docstring). `sinks` [H]: attention sinks, applied from the merged
    logsumexp. `stride` > 1: a ring of every stride-th device (USP), whose position j holds
    chunks j and 2R - 1 - j of 2R."""
    b, t_local, h, d = q.shape
    g, c = k.shape[2], t_local // 2
    block = min(Q_BLOCK, KV_BLOCK, c)
    padded = -(-c // block) * block
    ring = _Ring(sequence, c, _Plan(window, scale, softcap, block, block), stride)
    if segment_ids is None and padded != c:
        segment_ids = jnp.ones((b, t_local), jnp.int32)
    segments = None if segment_ids is None else _chunks(segment_ids.astype(jnp.int32), padded,
                                                        PAD_SEGMENT)        # [B, 2, cp]
    qc = _chunks(q.reshape(b, t_local, g, h // g, d), padded)             # [B, 2, cp, G, R, K]
    kc, vc = _chunks(k, padded), _chunks(v, padded)                       # [B, 2, cp, G, K]
    out, lse = _ring(qc, kc, vc, segments, ring)        # [B, 2, cp, G, R, K], [B, 2, G, R, cp]
    if sinks is not None:
        out = online_softmax.sink_rescale(out, jnp.moveaxis(lse, 4, 2), sinks.reshape(g, h // g))
    return out[:, :, :c].reshape(b, t_local, h, d)


def _chunks(x: jax.Array, padded: int, value: int = 0) -> jax.Array:
    """[B, 2c, ...] -> [B, 2, padded, ...]: the two chunks, each padded at its end."""
    b, t = x.shape[:2]
    x = x.reshape(b, 2, t // 2, *x.shape[2:])
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, padded - t // 2)
    return jnp.pad(x, pad, constant_values=value)


def _held_chunks(ring: _Ring, step, way: int) -> jax.Array:
    """int32 [2]: the chunk numbers of the keys and values a device holds at `step` of a pass
    that sends to device r + `way` (1: forward, -1: backward): those of device
    (r - way x step) mod P (ring positions: `_Ring.position`, of `_Ring.size`)."""
    source = (ring.position() - way * step) % ring.size
    return jnp.stack([source, 2 * ring.size - 1 - source]).astype(jnp.int32)


def _pass_on(ring: _Ring, way: int, xs):
    """Each array of the tuple `xs` (None kept) sent to ring position r + `way` (mod R): the
    device `stride` x that further along the sequence axis (mod P)."""
    size, stride = ring.size, ring.stride
    perm = [(j * stride + i, (j + way) % size * stride + i)
            for j in range(size) for i in range(stride)]
    return tuple(None if x is None else lax.ppermute(x, ring.sequence.axis, perm) for x in xs)


def _chunk(x: jax.Array | None, index) -> jax.Array | None:
    """Chunk `index` (traced) of [B, 2, ...] -> [B, ...]."""
    return None if x is None else lax.dynamic_index_in_dim(x, index, 1, keepdims=False)


def _add_chunk(x: jax.Array, index, part: jax.Array) -> jax.Array:
    """x [B, 2, ...] with `part` [B, ...] added at chunk `index` (traced)."""
    return lax.dynamic_update_index_in_dim(x, _chunk(x, index) + part, index, 1)


def _over_steps(ring: _Ring, way: int, compute, carry, held):
    """`(carry, held) = compute(carry, held, step)` for step 0 .. P - 1, the `held` tuple
    (keys, values, segment ids; the backward's dk, dv travelling with them) passed to device
    r + `way` between steps (P - 1 hops): one step's pairs, then a `lax.scan` whose every
    iteration is a hop and a step, so that one step's blocks are live at a time (an unrolled
    ring lets XLA run every step's blocks at once: 10x the temporaries)."""
    state = compute(carry, held, 0)

    def hop_and_step(state, step):
        carry, held = state
        return compute(carry, _pass_on(ring, way, held), step), None

    return lax.scan(hop_and_step, state, jnp.arange(1, ring.size))[0]


def _each_pair(ring: _Ring, way: int, step, visit, carry):
    """`visit(carry, a, b, offset)` for the four (local query chunk a, held key chunk b) pairs
    of `step`, in a `lax.scan` (one pair's blocks live at a time); offset: a's first position
    less b's."""
    mine, held = _held_chunks(ring, 0, way), _held_chunks(ring, step, way)

    def pair(carry, index):
        a, b = index // 2, index % 2
        return visit(carry, a, b, (mine[a] - held[b]) * ring.chunk), None

    return lax.scan(pair, carry, jnp.arange(4, dtype=jnp.int32))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(qc, kc, vc, segments, ring):
    return _ring_forward(qc, kc, vc, segments, ring)


def _ring_forward(qc, kc, vc, segments, ring: _Ring):
    """(out [B, 2, cp, G, R, K] in v's dtype, lse [B, 2, G, R, cp]; +inf for rows that see no
    key, as `_forward` gives them)."""
    acc_dtype = layers.at_least_float32(qc.dtype)
    b, _, cp, g, r, _ = qc.shape
    out = layers.fresh_zeros(qc.shape, acc_dtype, qc)                    # [B, 2, cp, G, R, K]
    lse = layers.fresh_zeros((b, 2, cp, g, r), acc_dtype, qc) - jnp.inf  # -inf: nothing seen

    def compute(carry, held, step):
        k_held, v_held, seg_held = held

        def visit(carry, a, bb, offset):
            out, lse = carry
            pair = None if segments is None else (_chunk(segments, a), _chunk(seg_held, bb))
            part, part_lse = _forward(_chunk(qc, a), _chunk(k_held, bb), _chunk(v_held, bb),
                                      pair, offset, ring.plan, cast=False)
            part_lse = jnp.moveaxis(part_lse, 3, 1)          # [B, G, R, cp] -> [B, cp, G, R]
            merged, merged_lse = online_softmax.merge(      # the softmax over both key sets
                _chunk(out, a), _chunk(lse, a), part,
                jnp.where(jnp.isfinite(part_lse), part_lse, -jnp.inf))
            return (lax.dynamic_update_index_in_dim(out, merged, a, 1),
                    lax.dynamic_update_index_in_dim(lse, merged_lse, a, 1))
        return _each_pair(ring, 1, step, visit, carry), held

    (out, lse), _ = _over_steps(ring, 1, compute, (out, lse), (kc, vc, segments))
    lse = jnp.moveaxis(lse, 2, 4)                    # [B, 2, cp, G, R] -> [B, 2, G, R, cp]
    return out.astype(vc.dtype), jnp.where(jnp.isfinite(lse), lse, jnp.inf)


def _ring_fwd(qc, kc, vc, segments, ring):
    out, lse = _ring_forward(qc, kc, vc, segments, ring)
    return (out, lse), (qc, kc, vc, segments, out, lse)


def _ring_bwd(ring, residuals, cotangents):
    qc, kc, vc, segments, out, lse = residuals
    d_out, d_lse = cotangents                        # [B, 2, cp, G, R, K], [B, 2, G, R, cp]
    acc_dtype = layers.at_least_float32(qc.dtype)
    dq = layers.fresh_zeros(qc.shape, acc_dtype, d_out)
    dk, dv = (layers.fresh_zeros(x.shape, acc_dtype, d_out) for x in (kc, vc))

    def compute(dq, held, step):
        k_held, v_held, seg_held, dk, dv = held

        def visit(carry, a, bb, offset):
            dq, dk, dv = carry
            pair = None if segments is None else (_chunk(segments, a), _chunk(seg_held, bb))
            dq_ab, dk_ab, dv_ab = _backward(
                _chunk(qc, a), _chunk(k_held, bb), _chunk(v_held, bb), pair, offset,
                _chunk(out, a), _chunk(lse, a), _chunk(d_out, a), ring.plan, cast=False,
                d_lse=_chunk(d_lse, a))
            return _add_chunk(dq, a, dq_ab), _add_chunk(dk, bb, dk_ab), _add_chunk(dv, bb, dv_ab)
        dq, dk, dv = _each_pair(ring, -1, step, visit, (dq, dk, dv))
        return dq, (k_held, v_held, seg_held, dk, dv)

    # The backward's hops go the other way (module docstring), dk and dv with their k and v.
    dq, (*_, dk, dv) = _over_steps(ring, -1, compute, dq, (kc, vc, segments, dk, dv))
    dk, dv = _pass_on(ring, -1, (dk, dv))                    # the last hop brings them home
    return dq.astype(qc.dtype), dk.astype(kc.dtype), dv.astype(vc.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_elements(tokens: int, kv_heads: int, head_dim: int, degree: int) -> dict[str, int]:
    """Elements one device sends per layer (module docstring): "forward" the keys and values
    over P - 1 hops; "backward" those again and "gradients" (dk, dv in the accumulation dtype)
    over P hops."""
    kv = tokens // degree * 2 * kv_heads * head_dim
    return {"forward": (degree - 1) * kv, "backward": (degree - 1) * kv,
            "gradients": degree * kv}


__all__ = ["ring_attention", "ring_elements"]
