"""Gemma 2 (Gemma Team 2024): sqrt(d)-scaled embedding, (1 + w) RMSNorm before and after both
sub-layers, GeGLU (tanh GELU) MLP, grouped-query attention scaled by query_pre_attn_scalar^-1/2
with soft-capped scores, sliding-window and global layers alternating, soft-capped logits and a
head tied to the embedding.

The alternation is built into the block: one `Pair` is a sliding-window layer followed by a
global one (transformers' layer_types: even layers slide), so every block of the `LayerStack`
has one shape and static windows, and the engine, the pipeline and the Hybrid Engine run it as
any stack. `Gemma2Config.num_layers` counts pairs (HF's num_hidden_layers / 2). A pair's KV
cache holds both layers' keys side by side on the head_dim: {"k", "v"} [L, B, S, G, 2K]
(`run_layers`: a block of P layers holds P, Gemma 3's period of six among them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .chunked_logits import LOGITS_CHUNK, chunked_token_logprobs, tied_projection
from .config import ModelConfig
from .attention import attention, cached_attention
from .paged_attention import is_paged
from .sequence_parallel import SequenceParallel
from .layers import LayerStack, RMSNorm, forward_stack, init_kv_cache, normal, param
from .rope import inv_freq, rope
from .tiled_mlp import tiled_mlp


@dataclasses.dataclass(frozen=True)
class Gemma2Config(ModelConfig):
    """Shape of a Gemma 2 model; `num_layers` is the number of (sliding, global) layer pairs."""

    vocab_size: int = 65
    max_seq_len: int = 128
    d_model: int = 48
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int = 1
    mlp_dim: int = 96
    explicit_head_dim: int | None = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    query_pre_attn_scalar: int = 16        # scores are scaled by its inverse square root
    attn_softcap: float | None = 50.0
    final_softcap: float | None = 30.0
    sliding_window: int = 4096
    family: str = dataclasses.field(default="gemma2", init=False)

    MAX_SEQ_LEN_REASON = ("RoPE: the positions the model is built and trained for, Hugging "
                          "Face's max_position_embeddings")
    POSITIVE_FIELDS = ("vocab_size", "max_seq_len", "d_model", "num_heads", "num_kv_heads",
                       "num_layers", "mlp_dim", "sliding_window")

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.head_dim % 2 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{type(self).__name__}: head_dim={self.head_dim} must be even and "
                             f"num_heads={self.num_heads} a multiple of num_kv_heads="
                             f"{self.num_kv_heads}")
        for field in ("attn_softcap", "final_softcap"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{type(self).__name__}.{field}={value!r} is invalid; "
                                 "accepted: None or a positive number")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.num_heads

    @property
    def layers_per_block(self) -> int:
        """HF layers per block of the stack: a (sliding, global) pair."""
        return 2


class Layer(nnx.Module):
    """One Gemma 2 / Gemma 3 decoder layer: x + post_norm(attn(norm(x))), x +
    post_norm(mlp(norm(x))). `window`: the sliding window (None: global); `freqs`: its RoPE
    inverse frequencies [K/2] (`rope.inv_freq`; Gemma 3's local and global layers differ);
    `qk_norm`: Gemma 3's per-head (1 + w) RMSNorm of q and k before RoPE."""

    def __init__(self, cfg: Gemma2Config, window: int | None, freqs: Sequence[float],
                 rngs: nnx.Rngs, *, qk_norm: bool = False):
        d, h, g, k, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
        std, eps = cfg.init_std, cfg.norm_eps
        self.window, self.softcap = window, cfg.attn_softcap
        self.implementation, self.mlp_chunk = cfg.attention, cfg.mlp_chunk    # static
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.inv_freq = tuple(float(x) for x in freqs)
        self.qk_norm = qk_norm                                                # static
        if qk_norm:
            self.q_norm = RMSNorm(k, eps=eps, axis=axes.HEAD_DIM, offset=1.0)
            self.k_norm = RMSNorm(k, eps=eps, axis=axes.HEAD_DIM, offset=1.0)
        self.attn_norm, self.attn_post_norm = (RMSNorm(d, eps=eps, offset=1.0) for _ in "ab")
        self.mlp_norm, self.mlp_post_norm = (RMSNorm(d, eps=eps, offset=1.0) for _ in "ab")
        self.wq = param(rngs, normal(std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.wk = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wv = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wo = param(rngs, normal(std), (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        self.w_gate = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_up = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_down = param(rngs, normal(std), (f, d), (axes.MLP, axes.EMBED))

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict | None]:
        """x [B, T, D] -> (x, cache): attention (`attention.attention`, within each segment
        of `segment_ids` when given; against `cache` by `attention.cached_attention`), then
        the MLP (in chunks of `mlp_chunk` tokens when set, `tiled_mlp`)."""
        h = self.attn_norm(x)                                             # [B, T, D]
        q = jnp.einsum("BTD,DHK->BTHK", h, self.wq[...])
        k = jnp.einsum("BTD,DGK->BTGK", h, self.wk[...])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq)
        v = jnp.einsum("BTD,DGK->BTGK", h, self.wv[...])
        kw = dict(window=self.window, scale=self.scale, softcap=self.softcap,
                  segment_ids=segment_ids, implementation=self.implementation)
        if cache is not None and sequence is not None:
            raise ValueError("a KV cache under sequence parallelism: decoding runs on whole "
                             "sequences (the Hybrid Engine's inference mesh); sequence=None")
        if cache is None:
            a = attention(q, k, v, **kw, sequence=sequence)               # [B, T, H, K]
        else:
            a, cache = cached_attention(q, k, v, positions, cache, **kw)
        x = x + self.attn_post_norm(jnp.einsum("BTHK,HKD->BTD", a, self.wo[...]))
        mlp = tiled_mlp(self._mlp, self.mlp_norm(x), self.mlp_chunk)            # [B, T, D]
        return x + self.mlp_post_norm(mlp), cache

    def _mlp(self, h: jax.Array) -> jax.Array:
        """GeGLU: h [B, T, D] -> [B, T, D] through the [B, T, F] gate and up projections."""
        gate = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h, self.w_gate[...]), approximate=True)
        up = jnp.einsum("BTD,DF->BTF", h, self.w_up[...])
        return jnp.einsum("BTF,FD->BTD", gate * up, self.w_down[...])


def run_layers(layers: Sequence[Layer], x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None, sequence: SequenceParallel | None,
               cache: Any, widths: Sequence[int] | None = None) -> tuple[jax.Array, Any]:
    """x [B, T, D] through a block's `layers` in order -> (x, cache). With a cache, each layer
    owns its part of the last dim: {"k", "v"} [B, S, G, W], or a paged cache's pools [L, D, G,
    NP, PG, W], layer j's keys in the `widths[j]` entries after layers 0..j-1's (default W / P
    each, P = len(layers); layers of different KV shapes: `kv_groups`); entries past the
    widths' sum are kept as they are (Gemma 3's tail: fewer layers than a period)."""
    if cache is None:
        for layer in layers:
            x, _ = layer(x, positions, segment_ids, sequence)
        return x, None
    paged = is_paged(cache)
    total = (cache.k if paged else cache["k"]).shape[-1]
    widths = widths or (total // len(layers),) * len(layers)

    def part(at: slice) -> Any:
        return (cache.replace(k=cache.k[..., at], v=cache.v[..., at]) if paged
                else {n: c[..., at] for n, c in cache.items()})

    written, start = [], 0
    for layer, width in zip(layers, widths):
        x, out = layer(x, positions, segment_ids, sequence, part(slice(start, start + width)))
        written.append(out)
        start += width
    if start < total:                            # entries no layer of the block owns, kept
        written.append(part(slice(start, None)))
    if paged:
        return x, cache.replace(k=jnp.concatenate([w.k for w in written], axis=-1),
                                v=jnp.concatenate([w.v for w in written], axis=-1))
    return x, {n: jnp.concatenate([w[n] for w in written], axis=-1) for n in cache}


class Pair(nnx.Module):
    """A sliding-window layer (`local`) then a global one (`glob`): one block of the stack."""

    def __init__(self, cfg: Gemma2Config, rngs: nnx.Rngs):
        freqs = inv_freq(cfg.head_dim, cfg.rope_theta)
        self.local = Layer(cfg, cfg.sliding_window, freqs, rngs)
        self.glob = Layer(cfg, None, freqs, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict | None]:
        """With `cache` {"k", "v"} [B, S, G, 2K]: the local layer's half [..., :K], the global
        layer's [..., K:] (`run_layers`). `segment_ids` (a packed batch) and `sequence` reach
        both layers."""
        return run_layers((self.local, self.glob), x, positions, segment_ids, sequence, cache)


class Embed(nnx.Module):
    """The sqrt(d)-scaled token embedding; `attend` / `attend_logprobs` are the tied head
    (`attend_logprobs` soft-caps with `final_softcap`, as `Gemma2.head` does). `logits_chunk`:
    tokens per chunk of the chunked head (static)."""

    def __init__(self, cfg: Gemma2Config, rngs: nnx.Rngs):
        self.normalizer = math.sqrt(cfg.d_model)
        self.final_softcap = cfg.final_softcap
        self.logits_chunk = LOGITS_CHUNK
        self.weight = param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                            (axes.VOCAB, axes.EMBED))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        del positions                       # positions enter through RoPE
        x = self.weight[...][tokens]                                      # [B, T, D]
        return x * jnp.asarray(self.normalizer, x.dtype)   # HF rounds sqrt(d) to the dtype

    def attend(self, h: jax.Array) -> jax.Array:
        """The tied head: h [B, T, D] -> logits float32 [B, T, V] = h @ weight^T (unscaled). A
        method of the module owning the weight, so that ZeRO-3 gathers the weight around the
        call."""
        return tied_projection(self.weight[...].astype(h.dtype), h)

    def attend_logprobs(self, h: jax.Array, labels: jax.Array,
                        vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """The soft-capped tied head's log-probs of `labels` int [B, T] from h [B, T, D] (after
        the final norm) -> float32 [B, T], `logits_chunk` tokens at a time, each chunk's logits
        soft-capped (`models.chunked_logits`): one method, so ZeRO-3 gathers the weight once."""
        return chunked_token_logprobs(h, labels, self.weight[...].astype(h.dtype), tied_projection,
                                      softcap=self.final_softcap, vocab_limit=vocab_limit,
                                      chunk=self.logits_chunk)


class Gemma2(nnx.Module):
    """Gemma 2: scaled embed -> stacked (sliding, global) pairs -> (1 + w) norm -> tied head
    -> soft-capped logits. `BLOCK`: the stack's block (Gemma 3 stacks its period)."""

    BLOCK: Callable[[Gemma2Config, nnx.Rngs], nnx.Module] = Pair
    tail: LayerStack | None = None      # a stack after the blocks' (Gemma 3's trailing layers)

    def __init__(self, cfg: Gemma2Config, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embed(cfg, rngs)
        self.blocks = LayerStack(lambda r: self.BLOCK(cfg, r), cfg.num_layers, rngs)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=1.0)

    def head(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> logits float32 [B, T, V] through the tied embedding, soft-capped."""
        logits = self.embed.attend(self.norm(x))
        cap = self.config.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def init_cache(self, batch: int, max_len: int,
                   dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
        """A zeroed KV cache {"k", "v"} [L, B, max_len, G, P K] (a block's P layers side by
        side, `run_layers`; one more row for a `tail`, `Gemma3.decode`). ValueError past
        max_seq_len (`ModelConfig.check_seq_len`)."""
        c = self.config
        c.check_seq_len(max_len, "KV cache length (max_len)")
        return init_kv_cache(c.num_layers + (self.tail is not None), batch, max_len,
                             c.num_kv_heads, c.layers_per_block * c.head_dim, dtype)

    def decode(self, tokens: jax.Array, positions: jax.Array,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits float32 [B, T, V] of `tokens` at `positions` against and into `cache`."""
        x, cache = self.blocks(self.embed(tokens, positions), positions, cache=cache)
        return self.head(x), cache

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None) -> jax.Array:
        """log p(labels | tokens) float32 [B, T] for tokens, labels int [B, T] under the
        soft-capped head, the logits never whole (`models.chunked_logits`). Equals
        `token_logprobs(model(tokens), labels)` (`zeroxla.engine.loss`)."""
        h = self.hidden(tokens, positions, segment_ids, sequence)                    # [B, T, D]
        return self.embed.attend_logprobs(h, labels, vocab_limit)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None) -> jax.Array:
        """Logits float32 [B, T, V] of tokens int [B, T] at `positions` (default 0..T-1); a
        packed batch gives `segment_ids` int [B, T] and its own positions
        (`layers.stack_args`)."""
        h = forward_stack(self, tokens, positions, segment_ids, sequence, tail=self.tail)
        return self.head(h)                                                          # [B, T, V]

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None) -> jax.Array:
        """The final hidden states [B, T, D] after the final norm (reward and value heads)."""
        return self.norm(forward_stack(self, tokens, positions, segment_ids, sequence,
                                       tail=self.tail))
