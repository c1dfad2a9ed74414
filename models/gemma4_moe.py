"""Gemma 4's MoE block (transformers 5.23 `Gemma4TextRouter`, `Gemma4TextExperts` and the
`enable_moe_block` branch of `Gemma4TextDecoderLayer`): a top-k mixture of GeGLU experts that
runs beside the layer's dense MLP, on the same residual stream.

    router:  n = rms(x) * scale * D^-1/2;  p = softmax(n @ router) (float32);  the k largest,
             renormalised to sum 1, each times per_expert_scale[e]
    experts: y = sum_j w_j down_e(gelu_tanh(gate_e h) * up_e h),  h = pre_norm(x)
    block:   dense_norm(mlp(x)) + post_norm(y)     (then the layer's post-MLP norm)

x is the residual stream entering the MLP (not its normalised input). Dropless, through
`grouped_matmul.expert_ffn`: all E experts, or under expert parallelism (the call's `experts`,
an `ExpertParallel` the ZeRO step passes the model and the stack threads to every layer) E / EP
of them here and the rest on the expert axis (`expert_parallel.expert_parallel_ffn`); the
router, its scales and the dense MLP are whole on every device. transformers' Gemma 4 adds no
load-balancing loss: no router statistics are carried.

Routing records and replay (R3, `models.moe`'s contract): the block returns the experts its
live router chooses; called with a recorded selection it sends each token there instead, the
weights the live router's probabilities at those experts renormalised, times their
per_expert_scale (for the router's own choice, the unreplayed weights bit for bit).
`moe_half` threads the stack's carries of `models.moe_llama` (`Chosen` records each layer's
experts, `Replayed` / `Observed` follow or compare a record and count mismatches) through the
layer, as `moe_llama.moe_residual` does for the other MoE families; the dense MLP beside the
block is not routed and is unchanged by either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .expert_parallel import ExpertParallel, expert_parallel_ffn
from .grouped_matmul import TILE, expert_ffn
from .layers import RMSNorm, at_least_float32, normal, param
from .moe import check_expert_split, replay_mismatches, replayed_weights, route
from .moe_llama import Chosen, Observed, Replayed, token_mask


def rms(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last dim, in float32 (float64 for float64 x): an
    RMSNorm without a scale (transformers' `Gemma4RMSNorm(with_scale=False)`)."""
    acc = at_least_float32(x.dtype)
    h = x.astype(acc)
    return (h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The experts' inner activation: gelu_pytorch_tanh(gate) * up [.., F]."""
    return jax.nn.gelu(gate, approximate=True) * up


class Gemma4Moe(nnx.Module):
    """The MoE block of one layer. Parameters: router [D, E], router_scale [D],
    per_expert_scale [E], w_gate / w_up [E, D, F], w_down [E, F, D] (F = expert_mlp_dim);
    norms `dense_norm` (the dense MLP's output), `pre_norm` (the experts' input), `post_norm`
    (their output)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, e, f, eps = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim, cfg.norm_eps
        init = normal(cfg.init_std)
        self.top_k, self.eps, self.root = cfg.experts_per_token, eps, d ** -0.5     # static
        self.router = param(rngs, init, (d, e), (axes.EMBED, axes.ROUTER))
        self.router_scale = nnx.Param(jnp.ones((d,), jnp.float32), logical_axes=(axes.EMBED,))
        self.per_expert_scale = nnx.Param(jnp.ones((e,), jnp.float32),
                                          logical_axes=(axes.ROUTER,))
        self.w_gate = param(rngs, init, (e, d, f), (axes.EXPERTS, axes.EMBED, axes.EXPERT_MLP))
        self.w_up = param(rngs, init, (e, d, f), (axes.EXPERTS, axes.EMBED, axes.EXPERT_MLP))
        self.w_down = param(rngs, init, (e, f, d), (axes.EXPERTS, axes.EXPERT_MLP, axes.EMBED))
        self.dense_norm, self.pre_norm, self.post_norm = (RMSNorm(d, eps=eps) for _ in "abc")

    def __call__(self, x: jax.Array, dense: jax.Array, experts: ExpertParallel | None = None,
                 replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] (the residual stream), dense [B, T, D] (the dense MLP's output) ->
        (the block's sum [B, T, D], before the layer's post-MLP norm; the experts the live
        router chooses int32 [B, T, k]). `experts`: the expert axis this layer's E / EP
        experts are split over (inside `shard_map`); None: it holds all E (a layer holding
        fewer is refused, `moe.check_expert_split`). `replay` int32 [B, T, k]: a recorded
        selection the tokens are sent to instead (a negative first slot: routed live)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)                                            # [N, D]
        n = rms(flat, self.eps) * (self.router_scale[...].astype(x.dtype) * self.root)
        weights, chosen, probs = route(n, self.router[...], self.top_k, True)   # [N, k]
        used = chosen
        if replay is not None:
            record = replay.reshape(b * t, self.top_k).astype(jnp.int32)     # [N, k]
            used = jnp.where(record[:, :1] >= 0, record, chosen)
            weights = replayed_weights(probs, used, True)
        weights = weights * self.per_expert_scale[...].astype(weights.dtype)[used]
        w = [getattr(self, name)[...].astype(x.dtype) for name in ("w_gate", "w_up", "w_down")]
        check_expert_split(w[0].shape[0], self.router[...].shape[-1], experts)
        h, weights = self.pre_norm(flat), weights.astype(x.dtype)
        if experts is None:
            y, _, _ = expert_ffn(h, used, *w, activation=geglu)               # [N, k, D]
            y = jnp.sum(y * weights[..., None], axis=1)                       # [N, D]
        else:
            y = expert_parallel_ffn(h, used, weights, *w, experts, tile=TILE,
                                    implementation="auto", activation=geglu)  # [N, D]
        out = self.dense_norm(dense) + self.post_norm(y.reshape(b, t, d))
        return out, chosen.reshape(b, t, self.top_k)


def moe_half(moe: Gemma4Moe, carry, x: jax.Array, dense: jax.Array,
             segment_ids: jax.Array | None, experts: ExpertParallel | None = None,
             replay: jax.Array | None = None):
    """A layer's MLP half with the MoE block: (`moe(x, dense)` [B, T, D], `carry` with this
    layer's routing: `Chosen` its experts written at `carry.layer`; `Replayed` its entry of
    `replay` int32 [L, B, T, k] followed (`Observed`: only compared) and the tokens whose live
    choice differs counted (padding, segment id 0, not); plain hidden states as they are).
    The carry's hidden states are left to the layer, which replaces them with its output, and
    a `Replayed` carry's router statistics as they are (zero: Gemma 4 has no auxiliary loss)."""
    record = None
    if isinstance(carry, Replayed):          # `Observed` too: the record compared only
        record = jax.lax.dynamic_index_in_dim(replay, carry.layer, 0, keepdims=False)
    out, chosen = moe(x, dense, experts, None if isinstance(carry, Observed) else record)
    if isinstance(carry, Replayed):
        return out, carry._replace(layer=carry.layer + 1, mismatches=carry.mismatches
                                   + replay_mismatches(chosen, record, token_mask(segment_ids)))
    if isinstance(carry, Chosen):
        return out, carry._replace(
            experts=jax.lax.dynamic_update_index_in_dim(carry.experts, chosen, carry.layer, 0),
            layer=carry.layer + 1)
    return out, carry
