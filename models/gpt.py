"""GPT-2 family (Radford et al. 2019): learned positions, pre-LayerNorm, GELU MLP, tied head.

Contract shared by all models here (what the engine, the pipeline and generation drive):

    model.embed(tokens int32[B, T], positions int32[B, T]) -> x [B, T, D]
    model.blocks(x, positions, cache=None) -> (x, cache)      one `LayerStack` (a packed
                                                              batch: x, positions, segment_ids)
    model.head(x) -> logits float32[B, T, V]
    model(tokens, positions=None, segment_ids=None) -> logits the three in a row
    model.token_logprobs(tokens, labels) -> float32[B, T]     the head's log-softmax at labels,
                                                              chunked (`chunked_logits`)
    model.init_cache(batch, max_len) -> cache                 {"k", "v"} [L, B, S, G, K]
    model.decode(tokens, positions, cache) -> (logits, cache) the three, with a KV cache

Parameters are tagged with logical axes; positions default to 0..T-1.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .chunked_logits import LOGITS_CHUNK, chunked_token_logprobs, tied_projection
from .config import ModelConfig
from .attention import attention, cached_attention
from .sequence_parallel import SequenceParallel
from .layers import (LayerNorm, LayerStack, decode, default_positions, forward_stack,
                     init_kv_cache, normal, param)
from .tiled_mlp import tiled_mlp


@dataclasses.dataclass(frozen=True)
class GPTConfig(ModelConfig):
    """Shape of a GPT-2 model. Presets: `tiny()`, `small()`, `gpt2_124m()`, `gpt2_350m()`..."""

    vocab_size: int = 65
    max_seq_len: int = 128
    d_model: int = 60
    num_heads: int = 4
    num_layers: int = 2
    mlp_dim: int = 240
    init_std: float = 0.02
    family: str = dataclasses.field(default="gpt2", init=False)

    # Learned positions: `wpe` has max_seq_len rows, and no embedding exists past them.
    MAX_SEQ_LEN_REASON = "learned positions: the embedding has max_seq_len rows"

    POSITIVE_FIELDS = ("vocab_size", "max_seq_len", "d_model", "num_heads", "num_layers",
                       "mlp_dim")

    def __post_init__(self) -> None:
        self.check_sizes()

    # Presets. `tiny` uses d_model=60 on purpose: the embeddings (65 x 60) and every [60]
    # vector are not multiples of 8 elements, so ZeRO's partition padding is exercised.
    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls()

    @classmethod
    def small(cls) -> "GPTConfig":
        return cls(max_seq_len=256, d_model=256, num_heads=8, num_layers=4, mlp_dim=1024)

    @classmethod
    def gpt2_124m(cls) -> "GPTConfig":
        return cls(vocab_size=50257, max_seq_len=1024, d_model=768, num_heads=12, num_layers=12,
                   mlp_dim=3072)

    @classmethod
    def gpt2_350m(cls) -> "GPTConfig":
        return cls(vocab_size=50257, max_seq_len=1024, d_model=1024, num_heads=16, num_layers=24,
                   mlp_dim=4096)

    @classmethod
    def gpt2_1_5b(cls) -> "GPTConfig":
        return cls(vocab_size=50257, max_seq_len=1024, d_model=1600, num_heads=25, num_layers=48,
                   mlp_dim=6400)


class Embed(nnx.Module):
    """Token and learned position embeddings; `attend` / `attend_logprobs` are the tied output
    head. `logits_chunk`: tokens per chunk of the chunked head (static)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.logits_chunk = LOGITS_CHUNK
        self.wte = param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model),
                         (axes.VOCAB, axes.EMBED))
        self.wpe = param(rngs, normal(0.01), (cfg.max_seq_len, cfg.d_model),
                         (axes.POSITION, axes.EMBED))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        if positions is None:
            positions = default_positions(tokens)
        return self.wte[...][tokens] + self.wpe[...][positions]         # [B, T, D]

    def attend(self, x: jax.Array) -> jax.Array:
        return tied_projection(self.wte[...].astype(x.dtype), x)

    def attend_logprobs(self, h: jax.Array, labels: jax.Array,
                        vocab_limit: jax.Array | int | None = None) -> jax.Array:
        """The tied head's log-probs of `labels` int [B, T] from h [B, T, D] (after `ln_f`)
        -> float32 [B, T], `logits_chunk` tokens at a time (`models.chunked_logits`): one
        method, so ZeRO-3 gathers `wte` once for every chunk."""
        return chunked_token_logprobs(h, labels, self.wte[...].astype(h.dtype), tied_projection,
                                      vocab_limit=vocab_limit, chunk=self.logits_chunk)


class Block(nnx.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, h, k, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
        proj_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)   # GPT-2 §2.3 residual scaling
        self.implementation, self.mlp_chunk = cfg.attention, cfg.mlp_chunk    # static
        self.ln1 = LayerNorm(d)
        self.wq = param(rngs, normal(cfg.init_std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.wk = param(rngs, normal(cfg.init_std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.wv = param(rngs, normal(cfg.init_std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.bq = param(rngs, nnx.initializers.zeros, (h, k), (axes.HEADS, axes.HEAD_DIM))
        self.bk = param(rngs, nnx.initializers.zeros, (h, k), (axes.HEADS, axes.HEAD_DIM))
        self.bv = param(rngs, nnx.initializers.zeros, (h, k), (axes.HEADS, axes.HEAD_DIM))
        self.wo = param(rngs, normal(proj_std), (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        self.bo = param(rngs, nnx.initializers.zeros, (d,), (axes.EMBED,))
        self.ln2 = LayerNorm(d)
        self.w_fc = param(rngs, normal(cfg.init_std), (d, f), (axes.EMBED, axes.MLP))
        self.b_fc = param(rngs, nnx.initializers.zeros, (f,), (axes.MLP,))
        self.w_proj = param(rngs, normal(proj_std), (f, d), (axes.MLP, axes.EMBED))
        self.b_proj = param(rngs, nnx.initializers.zeros, (d,), (axes.EMBED,))

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict | None]:
        """x [B, T, D] -> (x, cache). With `cache` (this layer's {"k", "v"} [B, S, H, K]) the
        tokens are written at `positions` and attend to the cache
        (`attention.cached_attention`); without, causal attention (`attention.attention`,
        within each segment of `segment_ids` int [B, T] when given; positions enter in `Embed`
        only). The MLP runs in chunks of `mlp_chunk` tokens when set (`tiled_mlp`)."""
        h = self.ln1(x)                                                   # [B, T, D]
        q = jnp.einsum("BTD,DHK->BTHK", h, self.wq[...]) + self.bq[...]
        k = jnp.einsum("BTD,DHK->BTHK", h, self.wk[...]) + self.bk[...]
        v = jnp.einsum("BTD,DHK->BTHK", h, self.wv[...]) + self.bv[...]
        if cache is not None and sequence is not None:
            raise ValueError("a KV cache under sequence parallelism: decoding runs on whole "
                             "sequences (the Hybrid Engine's inference mesh); sequence=None")
        if cache is None:
            a = attention(q, k, v, segment_ids=segment_ids,
                          implementation=self.implementation,
                          sequence=sequence)                              # [B, T, H, K]
        else:
            a, cache = cached_attention(q, k, v, positions, cache, segment_ids=segment_ids,
                                        implementation=self.implementation)
        x = x + jnp.einsum("BTHK,HKD->BTD", a, self.wo[...]) + self.bo[...]
        return x + tiled_mlp(self._mlp, self.ln2(x), self.mlp_chunk), cache

    def _mlp(self, h: jax.Array) -> jax.Array:
        """GELU MLP: h [B, T, D] -> [B, T, D] through the [B, T, F] hidden layer."""
        h = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h, self.w_fc[...]) + self.b_fc[...],
                        approximate=True)
        return jnp.einsum("BTF,FD->BTD", h, self.w_proj[...]) + self.b_proj[...]


class GPT(nnx.Module):
    """GPT-2: embed -> stacked blocks -> final LayerNorm -> tied head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embed(cfg, rngs)
        self.blocks = LayerStack(lambda r: Block(cfg, r), cfg.num_layers, rngs)
        self.ln_f = LayerNorm(cfg.d_model)

    def head(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm and the tied output projection -> logits float32 [B, T, V]."""
        return self.embed.attend(self.ln_f(x))          # float32 (float64 for float64 x)

    def init_cache(self, batch: int, max_len: int,
                   dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
        """A zeroed KV cache for `batch` rows of up to `max_len` positions; GPT's keys and
        values have one head per query head: {"k", "v"} [L, B, max_len, H, K]. ValueError past
        max_seq_len (the maximum length rule, `ModelConfig.check_seq_len`)."""
        c = self.config
        c.check_seq_len(max_len, "KV cache length (max_len)")
        return init_kv_cache(c.num_layers, batch, max_len, c.num_heads, c.head_dim, dtype)

    def decode(self, tokens: jax.Array, positions: jax.Array,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Logits float32 [B, T, V] of `tokens` [B, T] at `positions` [B, T], against and into
        `cache` (see `models.layers.decode`)."""
        return decode(self, tokens, positions, cache)

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None) -> jax.Array:
        """log p(labels | tokens) float32 [B, T] for tokens, labels int [B, T], the logits
        never whole (`models.chunked_logits`). Equals `token_logprobs(model(tokens), labels)`
        (`zeroxla.engine.loss`)."""
        h = self.hidden(tokens, positions, segment_ids, sequence)                    # [B, T, D]
        return self.embed.attend_logprobs(h, labels, vocab_limit)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None) -> jax.Array:
        """Logits float32 [B, T, V] of tokens int [B, T] at `positions` (default 0..T-1); a
        packed batch gives `segment_ids` int [B, T] and its own positions
        (`layers.stack_args`)."""
        return self.head(forward_stack(self, tokens, positions, segment_ids, sequence))    # [B, T, V]

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None) -> jax.Array:
        """The final hidden states [B, T, D] (after `ln_f`, before the head): HF's
        `GPT2Model(...).last_hidden_state`, which reward and value heads read."""
        return self.ln_f(forward_stack(self, tokens, positions, segment_ids, sequence))
