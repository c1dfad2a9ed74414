"""Gated DeltaNet's token mixer as a layer (Qwen3.5's linear attention; transformers 5.23
`Qwen3_5GatedDeltaNet`): the layer around the gated delta rule of `models.gated_delta`.

    q, k [B, T, Hk, K], v [B, T, H, V]   projections of the normed x, each through a causal
                                         depthwise conv1d over the last `W` tokens and SiLU
    beta = sigmoid(x Wb), g = -exp(A_log) softplus(x Wa + dt_bias)        [B, T, H]
    o = gated_delta(q, k, v, g, beta), q and k L2-normalised               [B, T, H, V]
    out = (RMSNorm(o) * w * silu(x Wz)) Wo                                 [B, T, D]

transformers fuses q | k | v into one projection and one conv (`in_proj_qkv`, `conv1d`); the
conv is depthwise, each channel its own filter, so ours are three of each (the checkpoint's are
cut and joined by the tensor map, `families.qwen3_5`) and name their heads.

Packing (`segment_ids` [B, T], 0 = padding): the conv window and the recurrent state restart at
each segment start, so a packed row's sequences compute as if each ran alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes
from .gated_delta import gated_delta_chunked
from .layers import at_least_float32, normal, param


def causal_conv(x_BTHK: jax.Array, w_WHK: jax.Array,
                segment_ids: jax.Array | None = None) -> jax.Array:
    """The causal depthwise conv1d then SiLU: out[t] = silu(sum_s w[W-1-s] x[t-s]) over the
    lags s < W, x before the row's start zero (transformers' `causal_conv1d_fn`: padding W - 1,
    cross-correlation). With `segment_ids` int [B, T], a lag reaching into another segment
    reads zero: the window restarts at each segment start."""
    width, t = w_WHK.shape[0], x_BTHK.shape[1]
    w_WHK = w_WHK.astype(x_BTHK.dtype)
    out_BTHK = x_BTHK * w_WHK[width - 1]
    for lag in range(1, width):
        shifted_BTHK = jnp.pad(x_BTHK, [(0, 0), (lag, 0), (0, 0), (0, 0)])[:, :t]
        if segment_ids is not None:
            earlier_BT = jnp.pad(segment_ids, [(0, 0), (lag, 0)], constant_values=-1)[:, :t]
            same_BT = earlier_BT == segment_ids
            shifted_BTHK = jnp.where(same_BT[:, :, None, None], shifted_BTHK, 0)
        out_BTHK = out_BTHK + shifted_BTHK * w_WHK[width - 1 - lag]
    return jax.nn.silu(out_BTHK)


class GatedRMSNorm(nnx.Module):
    """Per-head RMSNorm of the rule's output, gated by SiLU(z) (transformers'
    `Qwen3_5RMSNormGated`: a plain `w`, initialised to ones; the norm in float32, the weight
    applied in the input's dtype)."""

    def __init__(self, dim: int, *, eps: float):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axes.HEAD_DIM,))

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """o, z [..., V] -> [..., V] in o's dtype."""
        acc = at_least_float32(o.dtype)
        h = o.astype(acc)
        h = (h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps)).astype(o.dtype)
        h = self.scale[...].astype(o.dtype) * h
        return (h.astype(acc) * jax.nn.silu(z.astype(acc))).astype(o.dtype)


def _log_uniform(low: float, high: float):
    """An initializer drawing log(u), u ~ U(low, high) (transformers' A_log init)."""
    def init(key, shape, dtype):
        return jnp.log(jax.random.uniform(key, shape, dtype, low, high))
    return init


class DeltaNet(nnx.Module):
    """One Gated DeltaNet token mixer: h [B, T, D] (the normed residual) -> [B, T, D]."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, std, width = cfg.d_model, cfg.init_std, cfg.linear_conv_kernel_dim
        hk, k = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        h, v = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        key_axes, value_axes = (axes.KV_HEADS, axes.HEAD_DIM), (axes.HEADS, axes.HEAD_DIM)
        self.wq = param(rngs, normal(std), (d, hk, k), (axes.EMBED, *key_axes))
        self.wk = param(rngs, normal(std), (d, hk, k), (axes.EMBED, *key_axes))
        self.wv = param(rngs, normal(std), (d, h, v), (axes.EMBED, *value_axes))
        conv = normal(width ** -0.5)
        self.conv_q = param(rngs, conv, (width, hk, k), (axes.CONV_WINDOW, *key_axes))
        self.conv_k = param(rngs, conv, (width, hk, k), (axes.CONV_WINDOW, *key_axes))
        self.conv_v = param(rngs, conv, (width, h, v), (axes.CONV_WINDOW, *value_axes))
        self.wz = param(rngs, normal(std), (d, h, v), (axes.EMBED, *value_axes))
        self.wb = param(rngs, normal(std), (d, h), (axes.EMBED, axes.HEADS))
        self.wa = param(rngs, normal(std), (d, h), (axes.EMBED, axes.HEADS))
        self.dt_bias = param(rngs, nnx.initializers.ones, (h,), (axes.HEADS,))
        self.a_log = param(rngs, _log_uniform(0.01, 16.0), (h,), (axes.HEADS,))
        self.norm = GatedRMSNorm(v, eps=cfg.norm_eps)
        self.wo = param(rngs, normal(std), (h, v, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))

    def __call__(self, h_BTD: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None = None, sequence=None) -> jax.Array:
        """h [B, T, D] -> [B, T, D]; `segment_ids` restart the conv window and the state.
        `positions` are not read (the recurrence orders the tokens); `sequence` (sequence
        parallelism) is refused by name: the rule scans whole sequences."""
        del positions
        if sequence is not None:
            raise ValueError("qwen3_5: a Gated DeltaNet layer under sequence parallelism is "
                             "not built (its recurrence scans whole sequences, and no state "
                             "passes between sequence devices); accepted: sequence_parallel_"
                             "size=1 for this family")
        q = causal_conv(jnp.einsum("BTD,DHK->BTHK", h_BTD, self.wq[...]), self.conv_q[...],
                        segment_ids)
        k = causal_conv(jnp.einsum("BTD,DHK->BTHK", h_BTD, self.wk[...]), self.conv_k[...],
                        segment_ids)
        v = causal_conv(jnp.einsum("BTD,DHV->BTHV", h_BTD, self.wv[...]), self.conv_v[...],
                        segment_ids)
        z = jnp.einsum("BTD,DHV->BTHV", h_BTD, self.wz[...])
        beta = jax.nn.sigmoid(jnp.einsum("BTD,DH->BTH", h_BTD, self.wb[...]))
        acc = at_least_float32(h_BTD.dtype)
        a = jnp.einsum("BTD,DH->BTH", h_BTD, self.wa[...]).astype(acc)
        g = -jnp.exp(self.a_log[...].astype(acc)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(acc))                                    # [B, T, H]
        o, _ = gated_delta_chunked(q, k, v, g, beta, segment_ids=segment_ids,
                                   use_qk_l2norm_in_kernel=True)                  # [B, T, H, V]
        return jnp.einsum("BTHV,HVD->BTD", self.norm(o, z), self.wo[...])
