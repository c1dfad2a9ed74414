"""Llama family (Touvron et al. 2023): RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .config import ModelConfig
from .layers import (LayerStack, RMSNorm, at_least_float32, cached_attention, causal_attention,
                     decode, default_positions, init_kv_cache, normal, param, rope)


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Shape of a Llama model. Presets: `tiny()`, `small()`, `llama_1b()`, `llama_7b()`."""

    vocab_size: int = 65
    max_seq_len: int = 128
    d_model: int = 60
    num_heads: int = 6
    num_kv_heads: int = 2
    num_layers: int = 2
    mlp_dim: int = 164
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    family: str = dataclasses.field(default="llama", init=False)

    # RoPE could rotate past max_seq_len, but the model is built and trained for max_seq_len
    # positions (Hugging Face's max_position_embeddings), so past it is refused as GPT's is.
    MAX_SEQ_LEN_REASON = ("RoPE: the positions the model is built and trained for, Hugging "
                          "Face's max_position_embeddings")

    POSITIVE_FIELDS = ("vocab_size", "max_seq_len", "d_model", "num_heads", "num_kv_heads",
                       "num_layers", "mlp_dim")

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.d_model={self.d_model} / num_heads={self.num_heads} "
                             "must be an even head_dim (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")


    @classmethod
    def tiny(cls) -> "LlamaConfig":
        return cls()

    @classmethod
    def small(cls) -> "LlamaConfig":
        return cls(max_seq_len=256, d_model=256, num_heads=8, num_kv_heads=4, num_layers=4,
                   mlp_dim=688)

    @classmethod
    def llama_1b(cls) -> "LlamaConfig":
        """TinyLlama-1.1B's shape (untied head)."""
        return cls(vocab_size=32000, max_seq_len=2048, d_model=2048, num_heads=32, num_kv_heads=4,
                   num_layers=22, mlp_dim=5632)

    @classmethod
    def llama_7b(cls) -> "LlamaConfig":
        return cls(vocab_size=32000, max_seq_len=4096, d_model=4096, num_heads=32, num_kv_heads=32,
                   num_layers=32, mlp_dim=11008)


class Block(nnx.Module):
    """x + attn(norm(x)), then x + swiglu(norm(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, g, k, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
        std = cfg.init_std
        self.rope_theta = cfg.rope_theta
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.wq = param(rngs, normal(std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.wk = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wv = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wo = param(rngs, normal(std), (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        self.mlp_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.w_gate = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_up = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_down = param(rngs, normal(std), (f, d), (axes.MLP, axes.EMBED))

    def __call__(self, x: jax.Array, positions: jax.Array,
                 cache: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict | None]:
        """x [B, T, D] -> (x, cache). With `cache` (this layer's {"k", "v"} [B, S, G, K]) the
        tokens' keys/values are written at `positions` and attended there
        (`cached_attention`); without, plain causal attention."""
        h = self.attn_norm(x)                                             # [B, T, D]
        q = rope(jnp.einsum("BTD,DHK->BTHK", h, self.wq[...]), positions, self.rope_theta)
        k = rope(jnp.einsum("BTD,DGK->BTGK", h, self.wk[...]), positions, self.rope_theta)
        v = jnp.einsum("BTD,DGK->BTGK", h, self.wv[...])
        if cache is None:
            a = causal_attention(q, k, v)                                 # [B, T, H, K]
        else:
            a, cache = cached_attention(q, k, v, positions, cache)
        x = x + jnp.einsum("BTHK,HKD->BTD", a, self.wo[...])
        h = self.mlp_norm(x)
        gate = jax.nn.silu(jnp.einsum("BTD,DF->BTF", h, self.w_gate[...]))
        up = jnp.einsum("BTD,DF->BTF", h, self.w_up[...])
        return x + jnp.einsum("BTF,FD->BTD", gate * up, self.w_down[...]), cache


class TokenEmbed(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.weight = param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                            (axes.VOCAB, axes.EMBED))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        del positions                       # Llama's positions enter through RoPE
        return self.weight[...][tokens]                                   # [B, T, D]


class Head(nnx.Module):
    """Final RMSNorm and the (untied) output projection."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.weight = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                            (axes.EMBED, axes.VOCAB))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("BTD,DV->BTV", self.norm(x), self.weight[...].astype(x.dtype),
                          preferred_element_type=at_least_float32(x.dtype))


class Llama(nnx.Module):
    """Llama: embed -> stacked blocks -> norm -> head."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = TokenEmbed(cfg, rngs)
        self.blocks = LayerStack(lambda r: Block(cfg, r), cfg.num_layers, rngs)
        self.head = Head(cfg, rngs)

    def init_cache(self, batch: int, max_len: int,
                   dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
        """A zeroed grouped-query KV cache for `batch` rows of up to `max_len` positions:
        {"k", "v"} [L, B, max_len, G, K], G = num_kv_heads. ValueError past max_seq_len (the
        maximum length rule, `ModelConfig.check_seq_len`)."""
        c = self.config
        c.check_seq_len(max_len, "KV cache length (max_len)")
        return init_kv_cache(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype)

    def decode(self, tokens: jax.Array, positions: jax.Array,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits float32 [B, T, V] of `tokens` [B, T] at `positions` [B, T], against and into
        `cache` (see `models.layers.decode`)."""
        return decode(self, tokens, positions, cache)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        self.config.check_seq_len(tokens.shape[1], "sequence length")
        if positions is None:
            positions = default_positions(tokens)
        x = self.embed(tokens, positions)
        x, _ = self.blocks(x, positions)
        return self.head(x)                                               # [B, T, V]

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """The final hidden states [B, T, D] (after the final RMSNorm, before the projection):
        HF's `LlamaModel(...).last_hidden_state`, which reward and value heads read."""
        self.config.check_seq_len(tokens.shape[1], "sequence length")
        if positions is None:
            positions = default_positions(tokens)
        x, _ = self.blocks(self.embed(tokens, positions), positions)
        return self.head.norm(x)
