"""gpt-oss (OpenAI 2025; transformers 5.23 `models/gpt_oss/`): Llama's decoder with q/k/v and
output biases, YaRN RoPE, learned per-head attention sinks, sliding-window (128) and full
layers alternating, and a Mixture-of-Experts MLP in every layer whose router has a bias and
whose experts are a clamped SwiGLU with biases.

Definitions as transformers computes them:
- attention sinks `sinks` [H]: one more logit per head in every query's softmax, its column
  dropped (`GptOssAttention`'s `s_aux`; applied from the log-sum-exp in the memory-linear
  routes, `models.attention`);
- the router (`GptOssTopKRouter`): logits = h W^T + b over E experts, the k largest, softmax
  over those k: `moe.route` with the bias and `norm_topk_prob` (the k probabilities of the
  softmax over all E, renormalised, are the softmax over the k logits);
- each expert (`GptOssExperts._apply_gate`): gate = min(gate x + b, limit), up = clip(up x + b,
  -limit, limit), out = down((up + 1) * gate * sigmoid(alpha * gate)) + b (`clamped_swiglu`).

The alternation is built into the block, as Gemma 2's is: one `Pair` is a sliding-window layer
then a full one (transformers' default `layer_types`: even layers slide), so every block of the
`LayerStack` has one shape and static windows. `GptOssConfig.num_layers` counts pairs (HF's
num_hidden_layers / 2); a pair's KV cache holds both layers' keys side by side on the
head_dim, {"k", "v"} [L, B, S, G, 2K] (`gemma2.run_layers`). In training the stack carries
`moe.Routed` through both layers (router statistics of every HF layer). Routing records and
replay (`MoeLlama.router_choices`, `decode_choices`, `replayed_token_logprobs`) index MoE
layers, not blocks: a record is [.., 2L, k] (`GptOssConfig.moe_layers`), HF layer 2i + j at
2i + j, because the carry's layer counter (`moe_llama.Chosen`, `Replayed`) steps once per
`GptOssLayer` and a pair runs both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .expert_parallel import ExpertParallel
from .gemma2 import run_layers
from .grouped_matmul import ExpertBiases
from .layers import init_kv_cache, normal, param
from .moe import MoeMLP
from .moe_llama import MoeBlock, MoeLlama, MoeLlamaConfig
from .sequence_parallel import SequenceParallel


@dataclasses.dataclass(frozen=True)
class GptOssConfig(MoeLlamaConfig):
    """An MoE Llama config with gpt-oss' options; `num_layers` counts (sliding, full) pairs.

    sliding_window   the sliding layers' window (transformers' `sliding_window`, 128)
    swiglu_alpha     the experts' sigmoid gain (`swiglu_alpha`, 1.702)
    swiglu_limit     the clamp of gate (above) and up (both sides) (`swiglu_limit`, 7.0)
    """

    num_layers: int = 1
    sliding_window: int | None = 4
    qkv_bias: bool = True
    o_bias: bool = True
    norm_topk_prob: bool = True
    mlp_dim: int = 32         # config.json's one intermediate_size: the experts'
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    family: str = dataclasses.field(default="gpt_oss", init=False)
    ONE_INTERMEDIATE_SIZE = True
    BATCH_INVARIANT = False          # not built: its attention sinks and expert biases

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"{name}.sliding_window={self.sliding_window!r} is invalid: the "
                             "sliding layers' window; accepted: an integer >= 1")
        for field in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field}={getattr(self, field)!r} is invalid; "
                                 "accepted: a number > 0")
        if not self.norm_topk_prob:
            raise ValueError(f"{name}.norm_topk_prob=False is not gpt-oss' router (a softmax "
                             "over the k largest logits); accepted: True")

    @property
    def layers_per_block(self) -> int:
        """HF layers per block of the stack: a (sliding, full) pair (`models.hf`'s `{unit[j]}`)."""
        return 2

    @property
    def moe_layers(self) -> int:
        """L of a routing record [B, T, L, k]: every HF layer is an MoE layer, two per pair."""
        return self.layers_per_block * self.num_layers


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss' expert activation of gate, up [.., F]: (clip(up, -limit, limit) + 1) x g x
    sigmoid(alpha g), g = min(gate, limit) (transformers' `GptOssExperts._apply_gate`)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class GptOssMLP(MoeMLP):
    """`MoeMLP` with gpt-oss' router bias `b_router` [E] and expert biases b_gate / b_up
    [E, F], b_down [E, D] (named `experts`: split with their experts), and the clamped SwiGLU."""

    def __init__(self, cfg: GptOssConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim
        zeros = nnx.initializers.zeros
        self.alpha, self.limit = float(cfg.swiglu_alpha), float(cfg.swiglu_limit)    # static
        self.b_router = param(rngs, normal(cfg.init_std), (e,), (axes.ROUTER,))
        self.b_gate = param(rngs, zeros, (e, f), (axes.EXPERTS, axes.EXPERT_MLP))
        self.b_up = param(rngs, zeros, (e, f), (axes.EXPERTS, axes.EXPERT_MLP))
        self.b_down = param(rngs, zeros, (e, d), (axes.EXPERTS, axes.EMBED))

    def router_bias(self) -> jax.Array:
        return self.b_router[...]

    def expert_biases(self, dtype) -> ExpertBiases:
        return ExpertBiases(*(getattr(self, n)[...].astype(dtype)
                              for n in ("b_gate", "b_up", "b_down")))

    def activation(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return clamped_swiglu(gate, up, self.alpha, self.limit)


class GptOssLayer(MoeBlock):
    """One gpt-oss decoder layer: x + attn(norm(x)) with biases and sinks [H] (named
    `heads`), then x + moe(norm(x)); `window` its sliding window (None: full)."""

    def __init__(self, cfg: GptOssConfig, window: int | None, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.window = window                                                  # static
        self.sinks = param(rngs, normal(cfg.init_std), (cfg.num_heads,), (axes.HEADS,))

    def init_mlp(self, cfg: GptOssConfig, rngs: nnx.Rngs) -> None:
        self.moe = GptOssMLP(cfg, rngs)


class Pair(nnx.Module):
    """A sliding-window layer (`local`, HF layer 2i) then a full one (`glob`, 2i + 1): one
    block of the stack."""

    def __init__(self, cfg: GptOssConfig, rngs: nnx.Rngs):
        self.local = GptOssLayer(cfg, cfg.sliding_window, rngs)
        self.glob = GptOssLayer(cfg, None, rngs)

    def __call__(self, x, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None, replay: jax.Array | None = None,
                 cache=None):
        """x [B, T, D], `moe.Routed`, `Replayed` or `Chosen` -> (the same kind, cache);
        `experts` reaches both MoE layers, and so does `replay` int32 [2L, B, T, k] (every MoE
        layer's record: each layer reads its own at the carry's layer counter). With `cache`
        {"k", "v"} [B, S, G, 2K] (or a paged cache) the local layer owns [..., :K], the global
        one [..., K:] (`gemma2.run_layers`)."""
        if cache is None:
            for layer in (self.local, self.glob):
                x, _ = layer(x, positions, segment_ids, sequence, experts, replay)
            return x, None
        layers = [lambda h, p, s, q, c, layer=layer: layer(h, p, s, q, experts, cache=c)
                  for layer in (self.local, self.glob)]
        return run_layers(layers, x, positions, segment_ids, sequence, cache)


class GptOss(MoeLlama):
    """gpt-oss: embed -> stacked (sliding, full) pairs of MoE layers -> RMSNorm -> untied head.
    The forwards, `experts=`, the router statistics and the routing records and replay (per
    MoE layer, `GptOssConfig.moe_layers`) are `MoeLlama`'s."""

    BLOCK = Pair

    def init_cache(self, batch: int, max_len: int,
                   dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
        """A zeroed KV cache {"k", "v"} [L, B, max_len, G, 2K] (a pair's layers side by side,
        `gemma2.run_layers`). ValueError past max_seq_len (`ModelConfig.check_seq_len`)."""
        c = self.config
        c.check_seq_len(max_len, "KV cache length (max_len)")
        return init_kv_cache(c.num_layers, batch, max_len, c.num_kv_heads,
                             c.layers_per_block * c.head_dim, dtype)

