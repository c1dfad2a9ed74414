"""Sequence parallelism for the families' attention: DeepSpeed-Ulysses (Jacobs et al. 2023),
all-gather context parallelism (Llama 3's), ring attention (`ring_attention`) and USP (Ulysses
in groups, a ring across them: `usp_attention`), the last three for any head count.

Under sequence parallelism each device of a sequence group holds T / P tokens of every
sequence (the mesh's "sequence" axis, `zeroxla.make_mesh(sequence=P)`). Everything but
attention is per token and runs on the local slice as it is; attention needs whole sequences.

strategy "ulysses": each device holds T / P consecutive tokens, and `ulysses_attention` swaps
the sequence split for a head split around attention:

    q [B, T/P, H, K]   --all-to-all-->  [B, T, H/P, K]
    k, v [B, T/P, G, K] --all-to-all-->  [B, T, G'/P, K]   (G' = G, or G repeated: below)
    attention on whole sequences of H/P heads (any implementation, segment ids gathered)
    out [B, T, H/P, K] --all-to-all-->  [B, T/P, H, K]

Each all-to-all moves (P - 1) / P of a device's slice: per layer 2H + 2G' head-slices of
T/P tokens each way (4Nh/P bytes per link, against Megatron-SP's all-gather of 4Nh).

KV heads fewer than P (or not divisible by it) are repeated before the exchange, as DeepSpeed
does: each KV head m times, m = P / G when G divides P, else H / G (plain multi-head), so that
the i-th head slice of q meets exactly the KV heads its query heads read. The backward of the
repeat sums the copies' gradients: the result is the attention of the unsplit sequence.

The head count must be a multiple of P: Ulysses' degree is capped by the heads (verl#1226).

strategy "allgather" (any head count): the sequence is cut into 2P chunks and device r holds
chunks r and 2P - 1 - r (the zigzag split, `zigzag_order`: under the causal mask chunk j sees
j + 1 chunks of keys, so every device's pair sees 2P + 1 of them: the same work on every
device). `allgather_attention` all-gathers the keys and values over the sequence devices
((P - 1) / P of T x 2G x K per device, G the KV heads), puts them in sequence order and runs the
blockwise attention of each local query chunk at its offset against them
(`blockwise_attention_at`, which visits only the key blocks left of the chunk's end). Backward,
the all-gather's transpose reduce-scatters the keys' and values' gradients.

strategy "ring" (any head count): the same zigzag split; the keys and values are passed around
the sequence devices one device's chunks at a time (`lax.ppermute`) instead of gathered, so a
device never holds more than T / P of them (`models.ring_attention`: its bytes, forward and
backward). All-gather moves the same bytes forward in one collective and holds the whole T of
keys and values for the layer; the ring holds 1/P of it and overlaps each hop with a step's
attention.

strategy "usp" (any head count): the same split; Ulysses inside groups of U consecutive devices
(U the largest divisor of P that divides the heads), ring attention across the P / U groups
(`models.usp_attention`): heads split as far as they allow, the ring for the rest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .blockwise_attention import blockwise_attention_at

STRATEGIES = ("ulysses", "allgather", "ring", "usp")
# The `jax.named_scope` of every sequence-parallel attention below, ring's and USP's: the step
# reads it in the traced loss as the proof that a model's attention used the `SequenceParallel`
# it was given (`zeroxla.engine.consumption`), which a model taking `sequence=` through
# **kwargs, or ignoring it, would not leave.
ATTENTION_SCOPE = "sequence_parallel_attention"
ZIGZAG_STRATEGIES = ("allgather", "ring", "usp")   # 2P chunks, device r holds r and 2P - 1 - r


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Where a model's tokens are split: over mesh axis `axis` (of `size` devices), by
    `strategy`. A static pytree (no leaves): it travels through layer stacks, scans and custom
    VJPs with the other stack arguments and is part of what a trace is keyed on.

    Built by the ZeRO step for a mesh with a sequence axis (`ZeroLayout.sequence`); a model
    called with it must run inside a `shard_map` over that axis."""

    axis: str
    size: int
    strategy: str = "ulysses"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"SequenceParallel.size={self.size!r}: a positive integer")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"SequenceParallel.strategy={self.strategy!r} is not built; "
                             f"accepted: {', '.join(STRATEGIES)}")

    def index(self) -> jax.Array:
        """This device's place r in the sequence group: it holds tokens [r T/P, (r + 1) T/P)
        under "ulysses", chunks r and 2P - 1 - r under "allgather", "ring" and "usp"
        (`chunk_starts`)."""
        return lax.axis_index(self.axis)

    @property
    def zigzag(self) -> bool:
        """Whether the tokens are split in zigzag chunks (allgather, ring, usp), not in P runs."""
        return self.strategy in ZIGZAG_STRATEGIES

    @property
    def chunks(self) -> int:
        """Chunks the sequence is cut into: P (ulysses), 2P (the zigzag of allgather, ring,
        usp)."""
        return self.size * (2 if self.zigzag else 1)

    def positions(self, tokens: jax.Array) -> jax.Array:
        """The default positions [B, T/P] of this device's tokens: 0..T-1 of the whole
        sequence, sliced as the tokens are (one run, or the zigzag's two chunks)."""
        b, t = tokens.shape[:2]
        if not self.zigzag:
            starts = [self.index() * t]
        else:
            c = t // 2
            starts = [start * c for start in self.chunk_starts()]
        parts = [start + jnp.arange(t // len(starts), dtype=jnp.int32) for start in starts]
        return jnp.broadcast_to(jnp.concatenate(parts), (b, t))

    def chunk_starts(self, device: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """allgather, ring: the chunk numbers (r, 2P - 1 - r) device r holds (default: this
        device)."""
        r = self.index() if device is None else device
        return r, 2 * self.size - 1 - r

    def gather(self, x: jax.Array) -> jax.Array:
        """The whole sequence of a per-token array [B, T/P, ...] -> [B, T, ...]."""
        return lax.all_gather(x, self.axis, axis=1, tiled=True)

    def to_heads(self, x: jax.Array) -> jax.Array:
        """[B, T/P, H, K] -> [B, T, H/P, K]: the whole sequence of this device's head slice."""
        return lax.all_to_all(x, self.axis, split_axis=2, concat_axis=1, tiled=True)

    def to_sequence(self, x: jax.Array) -> jax.Array:
        """[B, T, H/P, K] -> [B, T/P, H, K]: back to this device's tokens, every head."""
        return lax.all_to_all(x, self.axis, split_axis=1, concat_axis=2, tiled=True)


jax.tree_util.register_static(SequenceParallel)


def kv_repeats(heads: int, kv_heads: int, degree: int) -> int:
    """How many times each KV head is repeated before the all-to-all (module docstring): 1
    when `degree` divides the KV heads, degree / G when G divides the degree, else H / G."""
    if kv_heads % degree == 0:
        return 1
    if degree % kv_heads == 0:
        return degree // kv_heads
    return heads // kv_heads


def check_heads(heads: int, degree: int) -> None:
    """ValueError unless Ulysses can split `heads` query heads over `degree` devices."""
    if heads % degree:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"sequence parallel size {degree} does not divide the model's {heads} attention "
            f"heads: DeepSpeed-Ulysses splits the heads over the sequence devices; accepted "
            f"sizes for this model: {divisors}, or sequence_parallel_strategy='usp' (Ulysses "
            "as far as the heads divide, a ring for the rest), 'ring' or 'allgather' (context "
            "parallelism): any head count")


@jax.named_scope(ATTENTION_SCOPE)
def ulysses_attention(attend: Callable[..., jax.Array], q: jax.Array, k: jax.Array,
                      v: jax.Array, sequence: SequenceParallel,
                      segment_ids: jax.Array | None = None, **options: Any) -> jax.Array:
    """`attend(q, k, v, segment_ids=, **options)` of the whole sequences, computed from this
    device's slice: q [B, T/P, H, K], k and v [B, T/P, G, K], segment_ids int [B, T/P] ->
    [B, T/P, H, K] (module docstring). `options["sinks"]` [H], when given, is cut to this
    device's heads as q is."""
    p, h, g = sequence.size, q.shape[2], k.shape[2]
    check_heads(h, p)
    if options.get("sinks") is not None:                                  # [H] -> [H/P]
        options = {**options, "sinks": lax.dynamic_slice_in_dim(
            options["sinks"], sequence.index() * (h // p), h // p)}
    m = kv_repeats(h, g, p)
    if m > 1:
        k, v = jnp.repeat(k, m, axis=2), jnp.repeat(v, m, axis=2)          # [B, T/P, G*m, K]
    q, k, v = (sequence.to_heads(x) for x in (q, k, v))                   # [B, T, ./P, K]
    segments = None if segment_ids is None else sequence.gather(segment_ids)   # [B, T]
    out = attend(q, k, v, segment_ids=segments, **options)                # [B, T, H/P, K]
    return sequence.to_sequence(out)                                      # [B, T/P, H, K]


def zigzag_order(degree: int) -> np.ndarray:
    """The chunk each slot of the zigzag layout holds, in device order: [0, 2P-1, 1, 2P-2, ...,
    P-1, P] (device r's two slots hold chunks r and 2P - 1 - r)."""
    return np.stack([np.arange(degree), 2 * degree - 1 - np.arange(degree)], 1).reshape(-1)


def _in_sequence_order(x: jax.Array, degree: int) -> jax.Array:
    """x [B, T, ...] gathered in the zigzag layout -> the same in sequence order."""
    b, t = x.shape[:2]
    chunks = x.reshape(b, 2 * degree, t // (2 * degree), *x.shape[2:])
    inverse = np.argsort(zigzag_order(degree))
    return jnp.take(chunks, inverse, axis=1).reshape(x.shape)


@jax.named_scope(ATTENTION_SCOPE)
def allgather_attention(q: jax.Array, k: jax.Array, v: jax.Array, sequence: SequenceParallel,
                        segment_ids: jax.Array | None = None, **options: Any) -> jax.Array:
    """The whole sequences' attention at this device's two zigzag chunks (module docstring):
    q [B, T/P, H, K], k and v [B, T/P, G, K], segment_ids int [B, T/P] -> [B, T/P, H, K];
    `options` (window, scale, softcap, sinks) go to `blockwise_attention_at`, the blockwise
    attention of a query chunk at an offset."""
    p, c = sequence.size, q.shape[1] // 2
    k, v = (_in_sequence_order(sequence.gather(x), p) for x in (k, v))    # [B, T, G, K]
    kv_segments = (None if segment_ids is None
                   else _in_sequence_order(sequence.gather(segment_ids), p))     # [B, T]
    outs = []
    for half, chunk in enumerate(sequence.chunk_starts()):
        rows = slice(half * c, (half + 1) * c)
        outs.append(blockwise_attention_at(q[:, rows], k, v, chunk * c,
                              q_segment_ids=None if segment_ids is None else segment_ids[:, rows],
                              kv_segment_ids=kv_segments, **options))   # [B, c, H, K]
    return jnp.concatenate(outs, axis=1)


def allgather_elements(tokens: int, kv_heads: int, head_dim: int, degree: int) -> int:
    """Elements one device receives in one layer's forward all-gathers of k and v:
    T (P-1)/P x 2G x K."""
    return tokens * (degree - 1) // degree * 2 * kv_heads * head_dim


def all_to_all_elements(tokens: int, heads: int, kv_heads: int, head_dim: int,
                        degree: int) -> int:
    """Elements one device sends in one layer's forward all-to-alls (each way the same):
    (T/P) (2H + 2G') K (P-1)/P, G' the KV heads after `kv_repeats`."""
    kv = kv_heads * kv_repeats(heads, kv_heads, degree)
    return math.prod((tokens // degree, 2 * heads + 2 * kv, head_dim)) * (degree - 1) // degree


__all__ = ["ATTENTION_SCOPE", "STRATEGIES", "ZIGZAG_STRATEGIES", "SequenceParallel",
           "all_to_all_elements", "allgather_attention", "allgather_elements", "check_heads",
           "kv_repeats", "ulysses_attention", "zigzag_order"]
