"""Gemma 4 text (transformers 5.23 `models/gemma4/`, `Gemma4ForCausalLM` and the text model of
`Gemma4ForConditionalGeneration`): Gemma 3's period of sliding layers and one global layer
(`models.gemma3`), sqrt(d)-scaled embedding, tied head and final soft-capping (`models.gemma2`),
with what Gemma 4 changes:

- every RMSNorm scales by `w` itself (Gemma 2 and 3: `1 + w`); values are RMS-normalised
  without a scale (`v_norm`), queries and keys per head with one (`q_norm`, `k_norm`), and the
  scores are not scaled (transformers' `scaling = 1.0`: the norms fix the logits' size);
- the global layer has its own head dim (`global_head_dim`), its own key-value head count
  (`num_global_kv_heads`, read only with `attention_k_eq_v`, as transformers does), and its own
  RoPE: "proportional", the first `rope_partial` of the head dim's frequency pairs rotated at
  base^(-2i / global_head_dim), the rest not at all (`proportional_inv_freq`);
- `attention_k_eq_v`: the global layer has no value projection; its values are its keys'
  projection before the key norm and RoPE (then `v_norm`);
- each layer's output is multiplied by `layer_scalar` [1] (a buffer in transformers: read from
  the checkpoint, never trained; here a parameter behind `stop_gradient`);
- the MoE block (`num_experts` > 0, transformers' `enable_moe_block`): beside the dense GeGLU
  MLP, a top-k mixture of GeGLU experts reads the layer's residual stream (`models.gemma4_moe`);
  the two outputs are each normalised, summed, and normalised once more; under expert
  parallelism the forwards take `experts=` (the ZeRO step's `ExpertParallel`) to every
  MoE block, which then holds E / EP of its experts. Routing records and replay run over
  every HF layer (`moe_layers` = periods x `sliding_window_pattern`), as `models.moe_llama`'s:
  `router_choices` (a full forward or the cached decode), `decode_choices` (what a rollout
  records, on the static and the paged cache) and `replayed_token_logprobs` read and write
  records [.., L, k] (`gemma4_moe.moe_half`); a Gemma 4 without the MoE block has none.

Decoding with a KV cache: a period's layers side by side on the cache's last dim
(`gemma2.run_layers`), each in its own shape, {"k", "v"} [L, B, S, C, (P - 1) G K / C + G' K' /
C] for C = gcd(G, G') head groups (`kv_groups`: a layer keeps G / C of its heads side by side
in a group, so tensor parallelism splits every layer's heads as it splits its weights). The
memory is each layer's own, (P - 1) G K + G' K' per period and slot for keys and for values
(the global layer stores values even with k = v: they are normalised, its keys rotated),
nothing padded to the largest layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import axes
from .attention import attention, cached_attention
from .config import ModelConfig
from .expert_parallel import ExpertParallel
from .gemma2 import Embed, Gemma2, run_layers
from .gemma4_moe import Gemma4Moe, moe_half, rms
from .kv_groups import cache_groups, fold_widths
from .layers import LayerStack, RMSNorm, forward_stack, init_kv_cache, normal, param, stack_args
from .moe_llama import Chosen, replayed_stack
from .rope import inv_freq, rope
from .sequence_parallel import SequenceParallel
from .tiled_mlp import tiled_mlp


@dataclasses.dataclass(frozen=True)
class Gemma4Config(ModelConfig):
    """Shape of a Gemma 4 text model; `num_layers` counts periods of `sliding_window_pattern`
    layers (pattern - 1 sliding, then one global). `explicit_head_dim`, `num_kv_heads`,
    `rope_local_theta`: the sliding layers'; `global_head_dim`, `num_global_kv_heads` (None: as
    the sliding layers), `rope_theta`, `rope_partial`, `rope_factor`: the global layer's.
    `num_experts` 0: no MoE block; else `experts_per_token` of them, each `expert_mlp_dim`
    wide, beside the dense MLP."""

    vocab_size: int = 65
    max_seq_len: int = 128
    d_model: int = 48
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int = 1
    mlp_dim: int = 96
    explicit_head_dim: int | None = 16
    global_head_dim: int = 32
    num_global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    rope_theta: float = 1_000_000.0
    rope_partial: float = 0.25
    rope_factor: float = 1.0
    rope_local_theta: float = 10_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    final_softcap: float | None = None
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    num_experts: int = 0
    experts_per_token: int = 2
    expert_mlp_dim: int = 0
    family: str = dataclasses.field(default="gemma4", init=False)

    MAX_SEQ_LEN_REASON = ("RoPE: the positions the model is built and trained for, Hugging "
                          "Face's max_position_embeddings")
    POSITIVE_FIELDS = ("vocab_size", "max_seq_len", "d_model", "num_heads", "num_kv_heads",
                       "num_layers", "mlp_dim", "global_head_dim", "sliding_window",
                       "sliding_window_pattern")

    def __post_init__(self) -> None:
        self.check_sizes()
        name = type(self).__name__
        for field, dim, kv in (("explicit_head_dim", self.head_dim, self.num_kv_heads),
                               ("global_head_dim", self.global_head_dim, self.global_kv_heads)):
            if dim % 2 or self.num_heads % kv:
                raise ValueError(f"{name}.{field}={dim} must be even and num_heads="
                                 f"{self.num_heads} a multiple of its key-value heads {kv}")
        if self.sliding_window_pattern < 2:
            raise ValueError(f"{name}.sliding_window_pattern={self.sliding_window_pattern} is "
                             "invalid; accepted: an integer >= 2 (sliding layers, then one "
                             "global layer)")
        if not 0 < self.rope_partial <= 1 or not self.rope_factor > 0:
            raise ValueError(f"{name}.rope_partial={self.rope_partial!r}, rope_factor="
                             f"{self.rope_factor!r}: accepted a fraction in (0, 1] and a "
                             "positive number")
        if self.final_softcap is not None and not self.final_softcap > 0:
            raise ValueError(f"{name}.final_softcap={self.final_softcap!r} is invalid; "
                             "accepted: None or a positive number")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.expert_mlp_dim > 0):
            raise ValueError(f"{name}: num_experts={self.num_experts} needs 1 <= "
                             f"experts_per_token={self.experts_per_token} <= num_experts and "
                             f"expert_mlp_dim={self.expert_mlp_dim} >= 1")

    @property
    def head_dim(self) -> int:
        """The sliding layers' head dim."""
        return self.explicit_head_dim or self.d_model // self.num_heads

    @property
    def global_kv_heads(self) -> int:
        """The global layer's key-value heads."""
        return self.num_global_kv_heads or self.num_kv_heads

    @property
    def layers_per_block(self) -> int:
        """HF layers per block of the stack (`models.hf`'s `{unit[j]}` names)."""
        return self.sliding_window_pattern

    @property
    def moe_layers(self) -> int:
        """L, the MoE layers a routing record indexes ([B, T, L, k]): every HF layer when
        the MoE block is built (`num_experts` > 0), else 0."""
        return self.num_layers * self.sliding_window_pattern if self.num_experts else 0

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """(key-value heads, head dim) of each layer of a period, the global one last."""
        return (((self.num_kv_heads, self.head_dim),) * (self.sliding_window_pattern - 1)
                + ((self.global_kv_heads, self.global_head_dim),))


def proportional_inv_freq(head_dim: int, theta: float, partial: float,
                          factor: float) -> np.ndarray:
    """float32 [head_dim / 2]: transformers' "proportional" RoPE
    (`_compute_proportional_rope_parameters`): the first int(partial head_dim / 2) pairs at
    theta^(-2i / head_dim), the others 0 (not rotated), all divided by `factor`."""
    angles = int(partial * head_dim // 2)
    rotated = inv_freq(head_dim, theta)[:angles]
    out = np.zeros(head_dim // 2, np.float32)
    out[:angles] = rotated
    return (out / np.float32(factor)).astype(np.float32)


class Layer(nnx.Module):
    """One Gemma 4 decoder layer with `kv_heads` key-value heads of `head_dim`: x +
    post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x)) [+ the MoE block's]), times
    `layer_scalar`. `window`: the sliding window (None: global); `freqs`: its RoPE inverse
    frequencies [head_dim / 2]; `k_eq_v`: values from the key projection."""

    def __init__(self, cfg: Gemma4Config, window: int | None, head_dim: int, kv_heads: int,
                 freqs: Sequence[float], rngs: nnx.Rngs, *, k_eq_v: bool = False):
        d, h, g, k, f = cfg.d_model, cfg.num_heads, kv_heads, head_dim, cfg.mlp_dim
        std, eps = cfg.init_std, cfg.norm_eps
        self.window, self.eps, self.k_eq_v = window, eps, k_eq_v                # static
        self.implementation, self.mlp_chunk = cfg.attention, cfg.mlp_chunk
        self.inv_freq = tuple(float(x) for x in freqs)
        self.q_norm = RMSNorm(k, eps=eps, axis=axes.HEAD_DIM)
        self.k_norm = RMSNorm(k, eps=eps, axis=axes.HEAD_DIM)
        self.attn_norm, self.attn_post_norm = (RMSNorm(d, eps=eps) for _ in "ab")
        self.mlp_norm, self.mlp_post_norm = (RMSNorm(d, eps=eps) for _ in "ab")
        self.wq = param(rngs, normal(std), (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        self.wk = param(rngs, normal(std), (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        if not k_eq_v:
            self.wv = param(rngs, normal(std), (d, g, k),
                            (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM))
        self.wo = param(rngs, normal(std), (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        self.w_gate = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_up = param(rngs, normal(std), (d, f), (axes.EMBED, axes.MLP))
        self.w_down = param(rngs, normal(std), (f, d), (axes.MLP, axes.EMBED))
        self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.float32), logical_axes=(None,))
        self.moe = Gemma4Moe(cfg, rngs) if cfg.num_experts else None

    def __call__(self, x, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: dict[str, jax.Array] | None = None,
                 experts: ExpertParallel | None = None,
                 replay: jax.Array | None = None) -> tuple[Any, dict | None]:
        """x [B, T, D] or a routing carry (`gemma4_moe.moe_half`) -> (the same kind, cache):
        attention within each segment of `segment_ids` (when given; against `cache` by
        `attention.cached_attention`), then the MLP (and MoE, its experts split over `experts`
        when given; `replay` int32 [L, B, T, k] with a `Replayed` carry)."""
        carry, x = x, (x if isinstance(x, jax.Array) else x.hidden)
        h = self.attn_norm(x)                                             # [B, T, D]
        q = self.q_norm(jnp.einsum("BTD,DHK->BTHK", h, self.wq[...]))
        k_raw = jnp.einsum("BTD,DGK->BTGK", h, self.wk[...])
        v_raw = k_raw if self.k_eq_v else jnp.einsum("BTD,DGK->BTGK", h, self.wv[...])
        v = rms(v_raw, self.eps)                                          # v_norm: no scale
        q = rope(q, positions, self.inv_freq)
        k = rope(self.k_norm(k_raw), positions, self.inv_freq)
        kw = dict(window=self.window, scale=1.0, softcap=None, segment_ids=segment_ids,
                  implementation=self.implementation)
        if cache is not None and sequence is not None:
            raise ValueError("a KV cache under sequence parallelism: decoding runs on whole "
                             "sequences (the Hybrid Engine's inference mesh); sequence=None")
        if cache is None:
            a = attention(q, k, v, **kw, sequence=sequence)               # [B, T, H, K]
        else:
            a, cache = cached_attention(q, k, v, positions, cache, **kw)
        x = x + self.attn_post_norm(jnp.einsum("BTHK,HKD->BTD", a, self.wo[...]))
        mlp = tiled_mlp(self._mlp, self.mlp_norm(x), self.mlp_chunk)     # [B, T, D]
        if self.moe is not None:
            mlp, carry = moe_half(self.moe, carry, x, mlp, segment_ids, experts, replay)
        x = x + self.mlp_post_norm(mlp)
        x = x * jax.lax.stop_gradient(self.layer_scalar[...]).astype(x.dtype)
        return (x if isinstance(carry, jax.Array) else carry._replace(hidden=x)), cache

    def _mlp(self, h: jax.Array) -> jax.Array:
        """GeGLU: h [B, T, D] -> [B, T, D] through the [B, T, F] gate and up projections."""
        gate = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", h, self.w_gate[...]), approximate=True)
        up = jnp.einsum("BTD,DF->BTF", h, self.w_up[...])
        return jnp.einsum("BTF,FD->BTD", gate * up, self.w_down[...])


class Period(nnx.Module):
    """`sliding_window_pattern - 1` sliding-window layers (`local`), then a global one
    (`glob`) with its own head dim, key-value heads and proportional RoPE: one block of the
    stack, HF layers P*i .. P*i + P - 1 of block i."""

    def __init__(self, cfg: Gemma4Config, rngs: nnx.Rngs):
        local = inv_freq(cfg.head_dim, cfg.rope_local_theta)
        glob = proportional_inv_freq(cfg.global_head_dim, cfg.rope_theta, cfg.rope_partial,
                                     cfg.rope_factor)
        self.local = nnx.List([Layer(cfg, cfg.sliding_window, cfg.head_dim, cfg.num_kv_heads,
                                     local, rngs)
                               for _ in range(cfg.sliding_window_pattern - 1)])
        self.glob = Layer(cfg, None, cfg.global_head_dim, cfg.global_kv_heads, glob, rngs,
                          k_eq_v=cfg.attention_k_eq_v)
        self.kv_widths = fold_widths(cfg.kv_shapes)                            # static

    def __call__(self, x, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None, replay: jax.Array | None = None,
                 cache: object = None) -> tuple[Any, object]:
        """x [B, T, D] or a routing carry -> (the same kind, cache); with `cache` [B, S, C,
        sum(kv_widths)] layer j reads and writes its `kv_widths[j]` entries of the last dim
        (`run_layers`, `kv_groups`). `experts` (expert parallelism, `layers.stack_args`) and
        `replay` (a record int32 [L, B, T, k]) reach every layer's MoE block."""
        layers = [functools.partial(layer, experts=experts, replay=replay)
                  for layer in (*self.local, self.glob)]
        return run_layers(layers, x, positions, segment_ids, sequence, cache, self.kv_widths)


class Gemma4(Gemma2):
    """Gemma 4 text: scaled embed -> stacked periods (sliding layers, then a global one) ->
    RMSNorm (scale w) -> tied head -> logits, soft-capped where configured."""

    BLOCK = Period

    def __init__(self, cfg: Gemma4Config, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embed(cfg, rngs)
        self.blocks = LayerStack(lambda r: self.BLOCK(cfg, r), cfg.num_layers, rngs)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None,
                       experts: ExpertParallel | None = None) -> jax.Array:
        """`Gemma2.token_logprobs`, the MoE blocks' experts split over `experts` when given."""
        h = self.hidden(tokens, positions, segment_ids, sequence, experts)          # [B, T, D]
        return self.embed.attend_logprobs(h, labels, vocab_limit)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None) -> jax.Array:
        """Logits float32 [B, T, V] (`Gemma2.__call__`); `experts`: expert parallelism's
        `ExpertParallel` (the ZeRO step passes it), to every MoE block."""
        return self.head(forward_stack(self, tokens, positions, segment_ids, sequence,
                                       experts=experts))

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None,
               experts: ExpertParallel | None = None) -> jax.Array:
        """The final hidden states [B, T, D] after the final norm (reward and value heads)."""
        return self.norm(forward_stack(self, tokens, positions, segment_ids, sequence,
                                       experts=experts))

    def init_cache(self, batch: int, max_len: int,
                   dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
        """A zeroed KV cache {"k", "v"} [L, B, max_len, C, W]: C = gcd of the layers' key-value
        heads, W = a period's layers' widths side by side (`Period.kv_widths`, `kv_groups`).
        ValueError past max_seq_len (`ModelConfig.check_seq_len`)."""
        c = self.config
        c.check_seq_len(max_len, "KV cache length (max_len)")
        return init_kv_cache(c.num_layers, batch, max_len,
                             cache_groups([g for g, _ in c.kv_shapes]),
                             sum(fold_widths(c.kv_shapes)), dtype)

    def replayed_token_logprobs(self, tokens: jax.Array, labels: jax.Array, replay: jax.Array,
                                *, positions: jax.Array | None = None,
                                segment_ids: jax.Array | None = None,
                                vocab_limit: jax.Array | int | None = None,
                                sequence: SequenceParallel | None = None,
                                experts: ExpertParallel | None = None,
                                follow_record: bool = True) -> tuple[jax.Array, None, jax.Array]:
        """`MoeLlama.replayed_token_logprobs`' contract: `replay` int32 [B, T, L, k] (L every
        HF layer, `moe_layers`) -> (log-probs float32 [B, T], None: Gemma 4 carries no router
        statistics, per token the layers whose live choice is not the record int32 [B, T])."""
        # the stack carries zero router statistics; Gemma 4 reports none (None below)
        out = replayed_stack(self, tokens, replay, self._moe_layers(), positions=positions,
                             segment_ids=segment_ids, sequence=sequence, experts=experts,
                             follow_record=follow_record)
        logprobs = self.embed.attend_logprobs(self.norm(out.hidden), labels, vocab_limit)
        return logprobs, None, out.mismatches

    def router_choices(self, tokens: jax.Array, positions: jax.Array | None = None,
                       cache: dict | None = None) -> tuple[jax.Array, dict | None]:
        """(the experts every HF layer routes each token to, int32 [L, B, T, k], the cache): a
        full forward, or with `cache` the cached decode (`decode`'s path)."""
        _, experts, cache = self._chosen_forward(tokens, positions, cache)
        return experts, cache

    def decode_choices(self, tokens: jax.Array, positions: jax.Array, cache: Any
                       ) -> tuple[jax.Array, jax.Array, Any]:
        """`decode`'s (logits float32 [B, T, V], cache) with the experts every HF layer routed
        each token to, int32 [L, B, T, k], between them: what a rollout records for routing
        replay (`zeroxla.inference.decode`, `continuous`: the KV cache or the paged one)."""
        x, experts, cache = self._chosen_forward(tokens, positions, cache)
        return self.head(x), experts, cache

    def _chosen_forward(self, tokens: jax.Array, positions: jax.Array | None, cache: Any):
        """(the final hidden states [B, T, D] before the norm, the experts int32
        [L, B, T, k], the cache) of the stack carrying `Chosen`."""
        c = self.config
        args = stack_args(tokens, positions, None)
        b, t = tokens.shape
        chosen = Chosen(self.embed(tokens, args[0]),
                        jnp.zeros((self._moe_layers(), b, t, c.experts_per_token), jnp.int32),
                        jnp.int32(0))
        out, cache = self.blocks(chosen, *args, cache=cache)
        return out.hidden, out.experts, cache

    def _moe_layers(self) -> int:
        """`moe_layers`; ValueError for a Gemma 4 without the MoE block (no routing)."""
        if not self.config.moe_layers:
            raise ValueError("routing records and replay of a Gemma 4 with num_experts=0: it "
                             "has no MoE block; accepted: a config with num_experts > 0")
        return self.config.moe_layers
