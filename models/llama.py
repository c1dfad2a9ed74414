"""Llama family (Touvron et al. 2023): RMSNorm, RoPE, SwiGLU, grouped-query attention.

The module also runs the families that are Llama plus options (`models.families`: Qwen2, Qwen3,
Mistral), each option a `LlamaConfig` field: scaled RoPE (`rope_type` linear / llama3 / yarn),
q/k/v and output biases, MLP biases, an explicit head_dim, per-head RMSNorm of q and k (Qwen3), a
sliding attention window (Mistral) and a head tied to the embedding (one parameter).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes, invariant, invariant_attention
from .chunked_logits import (LOGITS_CHUNK, chunked_token_logprobs, tied_projection,
                             untied_projection)
from .config import ModelConfig
from .attention import attention, cached_attention
from .sequence_parallel import SequenceParallel
from .layers import LayerStack, RMSNorm, forward_stack, init_kv_cache, normal, param
from .tiled_mlp import tiled_map
from .rope import ROPE_TYPES, inv_freq, rope, yarn_attention_factor


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
    # RoPE scaling (`models.rope.inv_freq`): rope_type default | linear | llama3 | yarn.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_beta_fast: float = 32.0           # yarn: the ramp's ends, in turns over original_max_len
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True             # yarn: the ramp's ends rounded outwards to whole dims
    rope_attention_factor: float | None = None   # yarn: cos/sin multiplier; None: 0.1 ln f + 1
    explicit_head_dim: int | None = None   # HF's head_dim when not d_model // num_heads
    qkv_bias: bool = False                 # q/k/v projection biases (Qwen2; Llama attention_bias)
    o_bias: bool = False                   # output projection bias (Llama attention_bias)
    mlp_bias: bool = False                 # gate/up/down biases (Llama mlp_bias)
    qk_norm: bool = False                  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None      # keys within the last `sliding_window` positions
    tie_word_embeddings: bool = False      # the head is the embedding (one parameter)
    family: str = dataclasses.field(default="llama", init=False)

    # RoPE could rotate past max_seq_len, but the model is built and trained for max_seq_len
    # positions (Hugging Face's max_position_embeddings), so past it is refused as GPT's is.
    MAX_SEQ_LEN_REASON = ("RoPE: the positions the model is built and trained for, Hugging "
                          "Face's max_position_embeddings")

    POSITIVE_FIELDS = ("vocab_size", "max_seq_len", "d_model", "num_heads", "num_kv_heads",
                       "num_layers", "mlp_dim")
    BATCH_INVARIANT = True

    def __post_init__(self) -> None:
        self.check_sizes()
        name = type(self).__name__
        if self.head_dim % 2:
            raise ValueError(f"{name}: head_dim={self.head_dim} must be even (RoPE rotates "
                             "pairs); accepted: an even explicit_head_dim or d_model / num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name}.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"{name}.rope_type={self.rope_type!r} is not built; accepted: "
                             f"{', '.join(ROPE_TYPES)}")
        if self.rope_type != "default" and not self.rope_factor > 0:
            raise ValueError(f"{name}.rope_factor={self.rope_factor!r} is invalid for rope_type="
                             f"{self.rope_type!r}; accepted: a number > 0")
        if self.rope_type == "llama3" and self.rope_low_freq_factor == self.rope_high_freq_factor:
            raise ValueError(f"{name}: llama3 RoPE needs rope_low_freq_factor != "
                             f"rope_high_freq_factor (both {self.rope_low_freq_factor})")
        for field in ("explicit_head_dim", "sliding_window"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}.{field}={value!r} is invalid; accepted: None or an "
                                 "integer >= 1")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.num_heads

    def rope_inv_freq(self):
        """float32 [head_dim / 2]: the RoPE frequencies of this config (`models.rope`)."""
        return inv_freq(self.head_dim, self.rope_theta, self.rope_type, factor=self.rope_factor,
                        low_freq_factor=self.rope_low_freq_factor,
                        high_freq_factor=self.rope_high_freq_factor,
                        original_max_len=self.rope_original_max_len,
                        beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow,
                        truncate=self.rope_truncate)

    def rope_scaling(self) -> float:
        """What RoPE multiplies cos and sin by: YaRN's attention factor, else 1."""
        if self.rope_type != "yarn":
            return 1.0
        return yarn_attention_factor(self.rope_factor, self.rope_attention_factor)

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
        d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        std, zeros = cfg.init_std, nnx.initializers.zeros
        # [K/2] as Python floats (exact float32 values): static, hashable module data.
        self.inv_freq = tuple(float(f) for f in cfg.rope_inv_freq())
        self.rope_scaling = cfg.rope_scaling()                            # a Python float
        self.window = cfg.sliding_window
        self.implementation, self.mlp_chunk = cfg.attention, cfg.mlp_chunk    # static
        self.invariant = cfg.batch_invariant                                  # static
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps, invariant=self.invariant)
        self.wq = param(rngs, normal(std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.wk = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wv = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wo = param(rngs, normal(std), (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        if cfg.qkv_bias:
            self.bq = param(rngs, zeros, (h, k), (axes.HEADS, axes.HEAD_DIM))
            self.bk = param(rngs, zeros, (g, k), (axes.KV_HEADS, axes.HEAD_DIM))
            self.bv = param(rngs, zeros, (g, k), (axes.KV_HEADS, axes.HEAD_DIM))
        if cfg.o_bias:
            self.bo = param(rngs, zeros, (d,), (axes.EMBED,))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(k, eps=cfg.norm_eps, axis=axes.HEAD_DIM,
                                  invariant=self.invariant)
            self.k_norm = RMSNorm(k, eps=cfg.norm_eps, axis=axes.HEAD_DIM,
                                  invariant=self.invariant)
        self.mlp_norm = RMSNorm(d, eps=cfg.norm_eps, invariant=self.invariant)
        self.init_mlp(cfg, rngs)

    def init_mlp(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        """The dense SwiGLU's parameters (an MoE block has experts instead, `models.moe`)."""
        d, f, std, zeros = cfg.d_model, cfg.mlp_dim, cfg.init_std, nnx.initializers.zeros
        self.w_gate = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_up = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_down = param(rngs, normal(std), (f, d), (axes.MLP, axes.EMBED))
        if cfg.mlp_bias:
            self.b_gate = param(rngs, zeros, (f,), (axes.MLP,))
            self.b_up = param(rngs, zeros, (f,), (axes.MLP,))
            self.b_down = param(rngs, zeros, (d,), (axes.EMBED,))

    def project(self, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """`jnp.einsum(spec, x, w)`; in the batch-invariant mode `invariant.einsum`."""
        return invariant.einsum(spec, x, w) if self.invariant else jnp.einsum(spec, x, w)

    def _bias(self, name: str) -> jax.Array | float:
        """The bias parameter `name`, or 0 when the config has none."""
        bias = getattr(self, name, None)
        return 0.0 if bias is None else bias[...]

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict | None]:
        """x [B, T, D] -> (x, cache). With `cache` (this layer's {"k", "v"} [B, S, G, K]) the
        tokens' keys/values are written at `positions` and attended there
        (`attention.cached_attention`); without, causal attention (`attention.attention`,
        within each segment of `segment_ids` int [B, T] when given). The per-token parts run in
        chunks of `mlp_chunk` tokens when set (`tiled_mlp.tiled_map`)."""
        # With `mlp_chunk`, every per-token part of the block runs chunk by chunk (`tiled_map`):
        # the norms, projections and RoPE as well as the MLP, so that only attention and the
        # [B, T, .] inputs and outputs of each part exist whole (ALST tiles the MLP alone; the
        # norms' float32 intermediates and their gradients were, after it, what a long
        # sequence's layer held most of).
        a, cache = self.attend(x, positions, segment_ids, sequence, cache)
        return tiled_map(self._out_and_mlp, (x, a), self.mlp_chunk), cache

    def attend(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
               sequence: SequenceParallel | None,
               cache: dict[str, jax.Array] | None) -> tuple[jax.Array, dict | None]:
        """The attention half: x [B, T, D] -> (the heads' outputs [B, T, H, K], cache)."""
        q, k, v = tiled_map(self._qkv, (x, positions), self.mlp_chunk)
        if cache is not None and sequence is not None:
            raise ValueError("a KV cache under sequence parallelism: decoding runs on whole "
                             "sequences (the Hybrid Engine's inference mesh); sequence=None")
        sinks = self.attention_sinks()
        if self.invariant:
            return invariant_attention.attend(q, k, v, positions, cache, window=self.window,
                                              segment_ids=segment_ids, sequence=sequence,
                                              sinks=sinks)
        if cache is None:
            a = attention(q, k, v, window=self.window, segment_ids=segment_ids, sinks=sinks,
                          implementation=self.implementation,
                          sequence=sequence)                              # [B, T, H, K]
        else:
            a, cache = cached_attention(q, k, v, positions, cache, window=self.window,
                                        segment_ids=segment_ids, sinks=sinks,
                                        implementation=self.implementation)
        return a, cache

    def attention_sinks(self) -> jax.Array | None:
        """The learned per-head sink logits [H] (gpt-oss' layers, `models.gpt_oss`); None for
        a layer without them."""
        sinks = getattr(self, "sinks", None)
        return None if sinks is None else sinks[...]

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """x [B, T, D], positions [B, T] -> q [B, T, H, K], k and v [B, T, G, K], RoPE'd."""
        h = self.attn_norm(x)                                             # [B, T, D]
        q = self.project("BTD,DHK->BTHK", h, self.wq[...]) + self._bias("bq")
        k = self.project("BTD,DGK->BTGK", h, self.wk[...]) + self._bias("bk")
        v = self.project("BTD,DGK->BTGK", h, self.wv[...]) + self._bias("bv")
        q, k = self.qk_normed(q, k)
        return (rope(q, positions, self.inv_freq, self.rope_scaling, exact=self.invariant),
                rope(k, positions, self.inv_freq, self.rope_scaling, exact=self.invariant), v)

    def qk_normed(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q [B, T, H, K], k [B, T, G, K] per-head RMSNormed when the config says (Qwen3:
        before RoPE), else as they are."""
        if getattr(self, "q_norm", None) is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def _out_and_mlp(self, x: jax.Array, a: jax.Array) -> jax.Array:
        """x [B, T, D], attention's a [B, T, H, K] -> the block's output [B, T, D]."""
        x = self.attention_out(x, a)
        return x + self._mlp(self.mlp_norm(x))

    def attention_out(self, x: jax.Array, a: jax.Array) -> jax.Array:
        """The residual after attention: x [B, T, D] + the output projection of a [B, T, H, K]."""
        return x + self.project("BTHK,HKD->BTD", a, self.wo[...]) + self._bias("bo")

    def _mlp(self, h: jax.Array) -> jax.Array:
        """SwiGLU: h [B, T, D] -> [B, T, D] through the [B, T, F] gate and up projections."""
        gate = jax.nn.silu(self.project("BTD,DF->BTF", h, self.w_gate[...])
                           + self._bias("b_gate"))
        up = self.project("BTD,DF->BTF", h, self.w_up[...]) + self._bias("b_up")
        return self.project("BTF,FD->BTD", gate * up, self.w_down[...]) + self._bias("b_down")


class TokenEmbed(nnx.Module):
    """The token embedding; `attend` / `attend_logprobs` are the tied head. `logits_chunk`:
    tokens per chunk of the chunked head (static)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.logits_chunk = LOGITS_CHUNK
        self.invariant = cfg.batch_invariant                                  # static
        self.project = invariant.tied_projection if self.invariant else tied_projection
        self.weight = param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                            (axes.VOCAB, axes.EMBED))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        del positions                       # Llama's positions enter through RoPE
        return self.weight[...][tokens]                                   # [B, T, D]

    def attend(self, h: jax.Array) -> jax.Array:
        """The tied head: h [B, T, D] -> logits float32 [B, T, V] = h @ weight^T. A method of
        the module owning the weight, so that ZeRO-3 gathers the weight around the call."""
        return self.project(self.weight[...].astype(h.dtype), h)

    def attend_logprobs(self, h: jax.Array, labels: jax.Array,
                        vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """The tied head's log-probs of `labels` int [B, T] from h [B, T, D] -> float32
        [B, T], `logits_chunk` tokens at a time (`models.chunked_logits`): one method, so
        ZeRO-3 gathers the weight once for every chunk."""
        return chunked_token_logprobs(h, labels, self.weight[...].astype(h.dtype), self.project,
                                      vocab_limit=vocab_limit, chunk=self.logits_chunk,
                                      invariant=self.invariant)


class Head(nnx.Module):
    """Final RMSNorm and the output projection: its own `weight` [D, V], or, tied
    (`tie_word_embeddings`), none: the caller passes the embedding module (`TokenEmbed`),
    whose `attend` projects."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.logits_chunk = LOGITS_CHUNK     # tokens per chunk of `logprobs` (static)
        self.invariant = cfg.batch_invariant                                  # static
        self.project = invariant.untied_projection if self.invariant else untied_projection
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, invariant=self.invariant)
        if not cfg.tie_word_embeddings:
            self.weight = param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size),
                                (axes.EMBED, axes.VOCAB))

    def __call__(self, x: jax.Array, embed: TokenEmbed | None = None) -> jax.Array:
        """x [B, T, D] -> logits float32 [B, T, V]; `embed` (the tied embedding's module) when
        tied."""
        h = self.norm(x)
        if embed is not None:
            return embed.attend(h)
        return self.project(self.weight[...].astype(x.dtype), h)

    def logprobs(self, h: jax.Array, labels: jax.Array,
                 vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """The untied projection's log-probs of `labels` int [B, T] from the normed hidden
        states h [B, T, D] -> float32 [B, T], `logits_chunk` tokens at a time
        (`models.chunked_logits`)."""
        return chunked_token_logprobs(h, labels, self.weight[...].astype(h.dtype), self.project,
                                      vocab_limit=vocab_limit, chunk=self.logits_chunk,
                                      invariant=self.invariant)


class Llama(nnx.Module):
    """Llama: embed -> stacked blocks -> norm -> head."""

    BLOCK = Block          # the layer class (`models.moe_llama.MoeBlock` for MoE families)

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = TokenEmbed(cfg, rngs)
        self.blocks = LayerStack(lambda r: self.BLOCK(cfg, r), cfg.num_layers, rngs)
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
        `cache` (the protocol of `models.layers.decode`)."""
        x, cache = self.blocks(self.embed(tokens, positions), positions, cache=cache)
        return self.logits(x), cache

    def logits(self, x: jax.Array) -> jax.Array:
        """The head of the final hidden states x [B, T, D]: logits float32 [B, T, V], through
        the embedding when tied."""
        return self.head(x, self.embed if self.config.tie_word_embeddings else None)

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None) -> jax.Array:
        """log p(labels | tokens) float32 [B, T] for tokens, labels int [B, T]: the head's
        log-softmax at each label, the logits never whole (`models.chunked_logits`). Equals
        `token_logprobs(model(tokens), labels)` (`zeroxla.engine.loss`)."""
        h = self.hidden(tokens, positions, segment_ids, sequence)                    # [B, T, D]
        return self.head_logprobs(h, labels, vocab_limit)

    def head_logprobs(self, h: jax.Array, labels: jax.Array,
                      vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """The chunked head's log-probs of `labels` int [B, T] from the normed hidden states
        h [B, T, D] -> float32 [B, T], through the embedding when tied."""
        if self.config.tie_word_embeddings:
            return self.embed.attend_logprobs(h, labels, vocab_limit)
        return self.head.logprobs(h, labels, vocab_limit)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None) -> jax.Array:
        """Logits float32 [B, T, V] of tokens int [B, T] at `positions` (default 0..T-1); a
        packed batch gives `segment_ids` int [B, T] and its own positions
        (`layers.stack_args`)."""
        return self.logits(forward_stack(self, tokens, positions, segment_ids, sequence))  # [B, T, V]

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None) -> jax.Array:
        """The final hidden states [B, T, D] (after the final RMSNorm, before the projection):
        HF's `LlamaModel(...).last_hidden_state`, which reward and value heads read. The norm
        runs in chunks of `mlp_chunk` tokens when set (`tiled_map`), as the blocks' do."""
        return self.final_norm(forward_stack(self, tokens, positions, segment_ids, sequence))

    def final_norm(self, x: jax.Array) -> jax.Array:
        """The final RMSNorm of the stack's output x [B, T, D], in chunks of `mlp_chunk` tokens
        when set."""
        return tiled_map(self.head.norm, (x,), self.config.mlp_chunk)
