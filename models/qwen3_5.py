"""Qwen3.5 dense (Qwen Team 2026; transformers 5.23 `models/qwen3_5/`): Gated DeltaNet linear
attention beside gated full attention, (1 + w) RMSNorm, SwiGLU MLPs.

Of every `attention_interval` layers (`full_attention_interval`, 4), the first ones are Gated
DeltaNet token mixers (`models.gated_deltanet`) and the last one is gated full attention:
an output gate sigmoid(x Wg) from the query projection, per-head (1 + w) RMSNorm of q and k,
RoPE over the first `partial_rotary_factor` of each head's dims. transformers' mRoPE sections
rotate text positions as plain RoPE: its three position rows (temporal, height, width) are the
same text position, so every frequency it picks from one row or another is the same.

The period of layers is built into the block: one `Period` is the DeltaNet layers (an
`nnx.List`) then the attention layer, so every block of the `LayerStack` has one shape and the
engine, the pipeline and ZeRO-3's per-block gathers run it as any stack.
`Qwen3_5Config.num_layers` counts periods (HF's num_hidden_layers / attention_interval).

Generation: `init_cache` gives the attention layers' KV cache {"k", "v"} [L, B, S, G, K] (one
attention layer per period) beside each DeltaNet layer's recurrent cache (`models.gated_deltanet`:
conv windows and the float32 [H, K, V] state), [L, B, N, ...] for the N = attention_interval - 1
DeltaNet layers of a period; `cache_axes` names every entry's dims, so an engine lays them out as
it lays out parameters. `decode` takes the prefill's pad mask as `segment_ids` (the DeltaNet
state must end at each row's last prompt token). A paged KV cache (continuous batching) carries
the DeltaNet entries as per-sequence slots beside its pages (`PagedKV.recurrent`,
`models.recurrent_slots`: [L, D, S + 1, N, ...]): `Period.decode_paged` steps them place by
place in each sequence's position order; a `PagedKV` without them is refused by name
(`paged_refusal`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .attention import attention, cached_attention
from .chunked_logits import LOGITS_CHUNK, chunked_token_logprobs, untied_projection
from .config import ModelConfig
from .gated_deltanet import DeltaNet
from .gated_deltanet import RECURRENT_CACHE_AXES, init_recurrent_cache
from .layers import (KV_CACHE_AXES, LayerStack, RMSNorm, forward_stack, init_kv_cache, normal,
                     param)
from .llama import TokenEmbed
from .paged_attention import PagedKV, is_paged
from .recurrent_slots import RecurrentSlots
from .rope import inv_freq, rope
from .sequence_parallel import SequenceParallel
from .tiled_mlp import tiled_mlp


def paged_refusal(family: str) -> str:
    """Why `family` (qwen3_5, qwen3_5_moe) does not decode a paged KV cache without recurrent
    slots: the message its refusal gives (an engine quotes its start)."""
    return (f"{family} (Qwen3.5) decodes a paged KV cache only with slots for its Gated DeltaNet "
            "layers' recurrent state (conv windows, [heads, K, V] state): got PagedKV(recurrent="
            "None); accepted: PagedKV(..., recurrent=RecurrentSlots(pools, slots, order)) with "
            "init_cache's conv_q, conv_k, conv_v, state as pools [L, D, S + 1, ...] "
            "(models.recurrent_slots), or a dense cache (init_cache)")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    """Shape of a Qwen3.5 dense model; `num_layers` counts periods of `attention_interval`
    layers (attention_interval - 1 DeltaNet layers, then one attention layer)."""

    vocab_size: int = 65
    max_seq_len: int = 128
    d_model: int = 48
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int = 1
    mlp_dim: int = 96
    explicit_head_dim: int = 16
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_word_embeddings: bool = False
    attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 8
    linear_value_head_dim: int = 8
    linear_conv_kernel_dim: int = 4
    family: str = dataclasses.field(default="qwen3_5", init=False)

    MAX_SEQ_LEN_REASON = ("RoPE: the positions the model is built and trained for, Hugging "
                          "Face's max_position_embeddings")
    POSITIVE_FIELDS = ("vocab_size", "max_seq_len", "d_model", "num_heads", "num_kv_heads",
                       "num_layers", "mlp_dim", "explicit_head_dim", "attention_interval",
                       "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                       "linear_value_head_dim", "linear_conv_kernel_dim")

    def __post_init__(self) -> None:
        self.check_sizes()
        name = type(self).__name__
        for heads, groups in (("num_heads", "num_kv_heads"),
                              ("linear_num_value_heads", "linear_num_key_heads")):
            if getattr(self, heads) % getattr(self, groups):
                raise ValueError(f"{name}.{heads}={getattr(self, heads)} is not a multiple of "
                                 f"{groups}={getattr(self, groups)}")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"{name}.partial_rotary_factor={self.partial_rotary_factor!r} is "
                             f"invalid for head_dim={self.head_dim}; accepted: a factor in "
                             "(0, 1] giving an even whole number of rotated dims")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layers_per_block(self) -> int:
        """HF layers per block of the stack (`models.hf`'s `{unit[j]}` names)."""
        return self.attention_interval


class GatedAttention(nnx.Module):
    """Qwen3.5's full attention: h [B, T, D] (the normed residual) -> [B, T, D]; q and k
    per-head (1 + w) RMSNormed then partially RoPE'd, the heads' output gated by
    sigmoid(h Wg) before the output projection."""

    def __init__(self, cfg: Qwen3_5Config, rngs: nnx.Rngs):
        d, h, g, k, std = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.init_std
        self.rotary_dim = cfg.rotary_dim
        self.inv_freq = tuple(float(f) for f in inv_freq(cfg.rotary_dim, cfg.rope_theta))
        self.implementation = cfg.attention                                  # static
        q_axes, kv_axes = (axes.EMBED, axes.HEADS, axes.HEAD_DIM), (axes.EMBED, axes.KV_HEADS,
                                                                     axes.HEAD_DIM)
        self.wq = param(rngs, normal(std), (d, h, k), q_axes)
        self.wg = param(rngs, normal(std), (d, h, k), q_axes)
        self.wk = param(rngs, normal(std), (d, g, k), kv_axes)
        self.wv = param(rngs, normal(std), (d, g, k), kv_axes)
        self.wo = param(rngs, normal(std), (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        self.q_norm = RMSNorm(k, eps=cfg.norm_eps, axis=axes.HEAD_DIM, offset=1.0)
        self.k_norm = RMSNorm(k, eps=cfg.norm_eps, axis=axes.HEAD_DIM, offset=1.0)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, T, H, K]: its first `rotary_dim` dims rotated, the rest as they are."""
        r = self.rotary_dim
        return jnp.concatenate([rope(x[..., :r], positions, self.inv_freq), x[..., r:]], -1)

    def _project(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """(q [B, T, H, K], k, v [B, T, G, K], gate [B, T, H, K]) of h [B, T, D]: q and k
        normed and partially RoPE'd at `positions`, the gate sigmoid(h Wg)."""
        q = self.q_norm(jnp.einsum("BTD,DHK->BTHK", h, self.wq[...]))
        k = self.k_norm(jnp.einsum("BTD,DGK->BTGK", h, self.wk[...]))
        v = jnp.einsum("BTD,DGK->BTGK", h, self.wv[...])
        gate = jax.nn.sigmoid(jnp.einsum("BTD,DHK->BTHK", h, self.wg[...]))
        return self._rope(q, positions), self._rope(k, positions), v, gate

    def __call__(self, h: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None) -> jax.Array:
        q, k, v, gate = self._project(h, positions)
        a = attention(q, k, v, segment_ids=segment_ids, implementation=self.implementation,
                      sequence=sequence)                                   # [B, T, H, K]
        return jnp.einsum("BTHK,HKD->BTD", a * gate, self.wo[...])

    def decode(self, h: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """h [B, T, D] against and into this layer's KV cache {"k", "v"} [B, S, G, K] ->
        ([B, T, D], the cache). `segment_ids` (a prefill's pad mask) is not read: a slot is
        attended by position, and a right pad's slot is overwritten before any token reads it
        (`models.layers.cached_attention_naive`)."""
        del segment_ids
        q, k, v, gate = self._project(h, positions)
        a, cache = cached_attention(q, k, v, positions, cache,
                                    implementation=self.implementation)    # [B, T, H, K]
        return jnp.einsum("BTHK,HKD->BTD", a * gate, self.wo[...]), cache


class Layer(nnx.Module):
    """One decoder layer: x + mixer(norm(x)), then x + swiglu(norm(x)); `mixer` a `DeltaNet`
    or a `GatedAttention`, the norms (1 + w)."""

    def __init__(self, cfg: Qwen3_5Config, mixer: nnx.Module, rngs: nnx.Rngs):
        self.mlp_chunk = cfg.mlp_chunk                                       # static
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=1.0)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=1.0)
        self.init_mlp(cfg, rngs)

    def init_mlp(self, cfg: Qwen3_5Config, rngs: nnx.Rngs) -> None:
        """The SwiGLU MLP's parameters (the MoE variant's layer makes an MoE MLP instead)."""
        d, f, std = cfg.d_model, cfg.mlp_dim, cfg.init_std
        self.w_gate = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_up = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_down = param(rngs, normal(std), (f, d), (axes.MLP, axes.EMBED))

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 sequence: SequenceParallel | None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; the MLP in chunks of `mlp_chunk` tokens when set."""
        x = x + self.mixer(self.attn_norm(x), positions, segment_ids, sequence)
        return x + self.feed_forward(x, segment_ids)

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> (x, cache): the mixer against and into its cache (`decode`)."""
        h, cache = self.mixer.decode(self.attn_norm(x), positions, segment_ids, cache)
        x = x + h
        return x + self.feed_forward(x, segment_ids), cache

    def decode_slots(self, x: jax.Array, positions: jax.Array, slots: RecurrentSlots,
                     states: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """A continuous-batching step's places x [D, N, D] -> (x, states): the DeltaNet mixer
        against its sequences' slots (`DeltaNet.decode_slots`), then the MLP."""
        h, states = self.mixer.decode_slots(self.attn_norm(x), positions, slots, states)
        x = x + h
        return x + self.feed_forward(x, None), states

    def feed_forward(self, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """The MLP's residual branch of x [B, T, D] -> [B, T, D] (normed, then SwiGLU)."""
        del segment_ids
        return tiled_mlp(self._mlp, self.mlp_norm(x), self.mlp_chunk)

    def _mlp(self, h: jax.Array) -> jax.Array:
        """SwiGLU: h [B, T, D] -> [B, T, D] through the [B, T, F] gate and up projections."""
        gate = jax.nn.silu(jnp.einsum("BTD,DF->BTF", h, self.w_gate[...]))
        up = jnp.einsum("BTD,DF->BTF", h, self.w_up[...])
        return jnp.einsum("BTF,FD->BTD", gate * up, self.w_down[...])


class Period(nnx.Module):
    """`attention_interval - 1` DeltaNet layers (`linear`), then the attention layer (`full`):
    one block of the stack, HF layers P*i .. P*i + P - 1 of block i; each a `LAYER`."""

    LAYER: ClassVar[type] = Layer

    def __init__(self, cfg: Qwen3_5Config, rngs: nnx.Rngs):
        self.linear = nnx.List([self.LAYER(cfg, DeltaNet(cfg, rngs), rngs)
                                for _ in range(cfg.attention_interval - 1)])
        self.full = self.LAYER(cfg, GatedAttention(cfg, rngs), rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None, cache: dict | None = None):
        """x [B, T, D] -> [B, T, D]; `segment_ids` (a packed batch) and `sequence` reach every
        layer. With `cache` (this period's slice of `Qwen3_5.init_cache`'s) -> (x, cache)
        (`decode`)."""
        if cache is not None:
            return self.decode(x, positions, segment_ids, cache)
        for layer in self.linear:
            x = layer(x, positions, segment_ids, sequence)
        return self.full(x, positions, segment_ids, sequence)

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> (x, cache): DeltaNet layer j reads and writes entry [:, j] of each
        recurrent entry [B, N, ...], the attention layer the KV cache {"k", "v"} [B, S, G, K].
        A `PagedKV` (continuous batching: x [D, N, D]) goes to `decode_paged`."""
        if is_paged(cache):
            return self.decode_paged(x, positions, cache)
        recurrent = [name for name, _ in RECURRENT_CACHE_AXES]
        written = []
        for j, layer in enumerate(self.linear):
            x, own = layer.decode(x, positions, segment_ids,
                                  {name: cache[name][:, j] for name in recurrent})
            written.append(own)
        x, kv = self.full.decode(x, positions, segment_ids, {n: cache[n] for n in ("k", "v")})
        return x, {**kv, **{name: jnp.stack([w[name] for w in written], axis=1)
                            for name in recurrent}}


    def decode_paged(self, x: jax.Array, positions: jax.Array,
                     cache: PagedKV) -> tuple[jax.Array, PagedKV]:
        """The step's places x [D, N, D] -> (x, cache) against a paged cache whose `recurrent`
        slots hold this period's entries [D, S + 1, N, ...] at block `cache.layer`: DeltaNet
        layer j steps slot entry [:, :, j] (`DeltaNet.decode_slots`), the attention layer reads
        and writes the pages."""
        slots = cache.recurrent
        states = slots.read(cache.layer)                          # {entry: [D, S + 1, N, ...]}
        for j, layer in enumerate(self.linear):
            x, own = layer.decode_slots(x, positions, slots,
                                        {n: s[:, :, j] for n, s in states.items()})
            states = {n: s.at[:, :, j].set(own[n].astype(s.dtype)) for n, s in states.items()}
        x, cache = self.full.decode(x, positions, None, cache)
        return x, cache.replace(recurrent=slots.write(cache.layer, states))


class Head(nnx.Module):
    """The final (1 + w) RMSNorm and the untied output projection `weight` [D, V] (none when
    tied: the embedding's `attend` projects). `logits_chunk`: tokens per chunk (static)."""

    def __init__(self, cfg: Qwen3_5Config, rngs: nnx.Rngs):
        self.logits_chunk = LOGITS_CHUNK
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=1.0)
        if not cfg.tie_word_embeddings:
            self.weight = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                (axes.EMBED, axes.VOCAB))

    def __call__(self, h: jax.Array) -> jax.Array:
        """The normed hidden states h [B, T, D] -> logits float32 [B, T, V] (untied)."""
        return untied_projection(self.weight[...].astype(h.dtype), h)

    def logprobs(self, h: jax.Array, labels: jax.Array,
                 vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """The untied projection's log-probs of `labels` int [B, T] from the normed h
        [B, T, D] -> float32 [B, T], `logits_chunk` tokens at a time."""
        return chunked_token_logprobs(h, labels, self.weight[...].astype(h.dtype),
                                      untied_projection, vocab_limit=vocab_limit,
                                      chunk=self.logits_chunk)


class Qwen3_5(nnx.Module):
    """Qwen3.5: embed -> stacked periods (DeltaNet layers, then gated attention) -> (1 + w)
    norm -> head (tied to the embedding when `tie_word_embeddings`); each block a `PERIOD`."""

    PERIOD: ClassVar[type] = Period

    def __init__(self, cfg: Qwen3_5Config, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = TokenEmbed(cfg, rngs)
        self.blocks = LayerStack(lambda r: self.PERIOD(cfg, r), cfg.num_layers, rngs)
        self.head = Head(cfg, rngs)

    def init_cache(self, batch: int, max_len: int,
                   dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
        """A zeroed decode cache for `batch` rows of up to `max_len` positions (module
        docstring): {"k", "v"} [L, B, max_len, G, K] and the DeltaNet layers' conv_q, conv_k,
        conv_v, state [L, B, N, ...] (`gated_deltanet.init_recurrent_cache`). ValueError past
        max_seq_len (`ModelConfig.check_seq_len`)."""
        c = self.config
        c.check_seq_len(max_len, "KV cache length (max_len)")
        kv = init_kv_cache(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype)
        return {**kv, **init_recurrent_cache(
            c, (c.num_layers, batch, c.attention_interval - 1), dtype)}

    def cache_axes(self) -> dict[str, tuple[str | None, ...]]:
        """The logical names of each `init_cache` entry's dims (`models.axes`; None: a DeltaNet
        layer of the period, never split)."""
        lead = (axes.LAYERS, axes.BATCH, None)
        return {"k": KV_CACHE_AXES, "v": KV_CACHE_AXES,
                **{name: lead + dims for name, dims in RECURRENT_CACHE_AXES}}

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict[str, jax.Array],
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits float32 [B, T, V] of `tokens` [B, T] at `positions` [B, T], against and into
        `cache` (`init_cache`'s). A right-padded prefill gives `segment_ids` int [B, T] (0 on a
        pad, 1 on a prompt token); a row whose first position is 0 starts a new sequence. A
        paged cache carries the recurrent entries in its slots (module docstring), else it is
        refused (`paged_refusal`)."""
        if is_paged(cache) and cache.recurrent is None:
            raise NotImplementedError(paged_refusal(self.config.family))
        x, cache = self.blocks(self.embed(tokens, positions), positions, segment_ids,
                               cache=cache)
        return self.logits(self.head.norm(x)), cache

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None) -> jax.Array:
        """The final hidden states [B, T, D] after the final norm (reward and value heads)."""
        return self.head.norm(forward_stack(self, tokens, positions, segment_ids, sequence))

    def logits(self, h: jax.Array) -> jax.Array:
        """The normed hidden states h [B, T, D] -> logits float32 [B, T, V]."""
        return self.embed.attend(h) if self.config.tie_word_embeddings else self.head(h)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None) -> jax.Array:
        """Logits float32 [B, T, V] of tokens int [B, T] at `positions` (default 0..T-1); a
        packed batch gives `segment_ids` int [B, T] and its own positions
        (`layers.stack_args`)."""
        return self.logits(self.hidden(tokens, positions, segment_ids, sequence))

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None) -> jax.Array:
        """log p(labels | tokens) float32 [B, T] for tokens, labels int [B, T], the logits
        never whole (`models.chunked_logits`). Equals `token_logprobs(model(tokens), labels)`
        (`zeroxla.engine.loss`)."""
        h = self.hidden(tokens, positions, segment_ids, sequence)                    # [B, T, D]
        return self.head_logprobs(h, labels, vocab_limit)

    def head_logprobs(self, h: jax.Array, labels: jax.Array,
                      vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """log p(labels) float32 [B, T] from the normed hidden states h [B, T, D], through the
        tied embedding or the head, `logits_chunk` tokens at a time."""
        if self.config.tie_word_embeddings:
            return self.embed.attend_logprobs(h, labels, vocab_limit)
        return self.head.logprobs(h, labels, vocab_limit)
