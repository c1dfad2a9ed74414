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

Sequence parallelism (`models.sequence_parallel`): DeepSpeed-Ulysses alone. The projections,
the gated norm and the output projection run on the device's T/P tokens; around the conv and
the rule, all-to-alls swap the token split for a head split (`DeltaNet.ulysses_mix`), so each
device scans whole sequences of Hk/P key heads and the H/P value heads they serve. Ring,
all-gather and USP would pass chunk states between the sequence devices, which is not built:
they are refused by name (`check_sequence_parallel`).

Decoding (`DeltaNet.decode`) carries a per-row recurrent cache instead of a KV cache: the conv
window, the last `W - 1` inputs of each conv, and the rule's float32 state [H, K, V]
(`init_recurrent_cache`, its dims named by `RECURRENT_CACHE_AXES`). A prefill of right-padded
rows marks its pads as segment 0, so they leave the state as the last prompt token left it and
the window holds the last real inputs. Under continuous batching each sequence's cache is a
slot of a pool and a step's places run through it in position order (`DeltaNet.decode_slots`,
`models.recurrent_slots`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from . import axes
from .gated_delta import PAD_SEGMENT, gated_delta_chunked, gated_delta_recurrent
from .layers import at_least_float32, normal, param
from .recurrent_slots import RecurrentSlots, scan_places
from .sequence_parallel import ATTENTION_SCOPE, SequenceParallel

# The dims of a DeltaNet layer's decode cache, each entry per row (`init_recurrent_cache`): the
# conv windows [W - 1, heads, head dim] and the rule's state [H, K, V].
RECURRENT_CACHE_AXES = (
    ("conv_q", (axes.CONV_WINDOW, axes.KV_HEADS, axes.HEAD_DIM)),
    ("conv_k", (axes.CONV_WINDOW, axes.KV_HEADS, axes.HEAD_DIM)),
    ("conv_v", (axes.CONV_WINDOW, axes.HEADS, axes.HEAD_DIM)),
    ("state", (axes.HEADS, axes.HEAD_DIM, axes.HEAD_DIM)),
)


def chunked_prefill() -> bool:
    """Whether a decode block of several tokens (a prefill) runs the chunked rule (else the
    recurrent one, token by token; both equal transformers'): on accelerators. On XLA:CPU's
    host devices the engine's program with a chunked prefill of 8 rows x 51 tokens per device
    stalls, its devices waiting in the rendezvous of the attention layer's one all-reduce (the
    largest position); the token-by-token prefill completes."""
    return jax.default_backend() != "cpu"


def init_recurrent_cache(cfg, lead: tuple[int, ...],
                         dtype: jnp.dtype = jnp.float32) -> dict[str, jax.Array]:
    """Zeroed decode caches of DeltaNet layers, each entry with the leading dims `lead` (e.g.
    [L, B, N]: periods, rows, DeltaNet layers of a period): conv_q, conv_k [*lead, W - 1, Hk, K]
    and conv_v [*lead, W - 1, H, V] in `dtype`, state [*lead, H, K, V] in float32 (or wider)."""
    window = cfg.linear_conv_kernel_dim - 1
    hk, k = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    h, v = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {"conv_q": jnp.zeros((*lead, window, hk, k), dtype),
            "conv_k": jnp.zeros((*lead, window, hk, k), dtype),
            "conv_v": jnp.zeros((*lead, window, h, v), dtype),
            "state": jnp.zeros((*lead, h, k, v), at_least_float32(dtype))}


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


def check_sequence_parallel(sequence: SequenceParallel, key_heads: int, value_heads: int) -> None:
    """ValueError unless a DeltaNet layer runs under `sequence`: Ulysses alone (each device
    scans whole sequences of its heads; no chunk state passes between sequence devices, which
    ring, all-gather and USP would need), its size dividing the key and the value heads."""
    if sequence.strategy != "ulysses":
        raise ValueError(f"sequence_parallel_strategy={sequence.strategy!r} is not built for "
                         "Gated DeltaNet layers (qwen3_5, qwen3_5_moe: the recurrence scans "
                         "whole sequences, and no chunk state passes between sequence "
                         "devices); accepted: 'ulysses' (heads split, whole sequences per "
                         "device)")
    for name, heads in (("linear_num_key_heads", key_heads),
                        ("linear_num_value_heads", value_heads)):
        if heads % sequence.size:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"sequence parallel size {sequence.size} does not divide the "
                             f"Gated DeltaNet layers' {name}={heads}: Ulysses splits the heads "
                             f"over the sequence devices; accepted sizes: {divisors}")


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
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None) -> jax.Array:
        """h [B, T, D] -> [B, T, D]; `segment_ids` restart the conv window and the state.
        `positions` are not read (the recurrence orders the tokens). Under `sequence`
        (Ulysses alone: `ulysses_mix`) h is this device's T/P tokens [B, T/P, D] of each row."""
        del positions
        inputs, z, g, beta = self._project(h_BTD)
        if sequence is None:
            o = self._mix(inputs, g, beta, self._conv_weights(), segment_ids)
        else:
            o = self.ulysses_mix(inputs, g, beta, segment_ids, sequence)
        return jnp.einsum("BTHV,HVD->BTD", self.norm(o, z), self.wo[...])

    @jax.named_scope(ATTENTION_SCOPE)
    def ulysses_mix(self, inputs: tuple[jax.Array, ...], g: jax.Array, beta: jax.Array,
                    segment_ids: jax.Array | None, sequence: SequenceParallel) -> jax.Array:
        """The mixer under DeepSpeed-Ulysses: this device's tokens of every head (q, k
        [B, T/P, Hk, K], v [B, T/P, H, V], g and beta [B, T/P, H], segment_ids [B, T/P]) ->
        o [B, T/P, H, V]. The all-to-alls give each device whole rows of Hk/P key heads and the
        H/P value heads they serve (value head j reads key head j // (H / Hk), so the r-th
        slices match); the conv (its filters cut to those heads) and the rule run on whole
        sequences, the row's segment ids gathered; the output goes back to the token split.
        Ulysses' split is P runs of consecutive tokens, so the gathered rows are in sequence
        order, as `ulysses_attention`'s are."""
        full = self._conv_weights()                                     # [W, heads, dim]
        check_sequence_parallel(sequence, full[0].shape[1], full[2].shape[1])
        q, k, v = (sequence.to_heads(x) for x in inputs)                 # [B, T, ./P, .]
        g, beta = (sequence.to_heads(x[..., None])[..., 0] for x in (g, beta))   # [B, T, H/P]
        r, p = sequence.index(), sequence.size
        weights = tuple(lax.dynamic_slice_in_dim(w, r * (w.shape[1] // p), w.shape[1] // p,
                                                 axis=1)
                        for w in full)                                  # [W, ./P, .]
        segments = None if segment_ids is None else sequence.gather(segment_ids)   # [B, T]
        o = self._mix((q, k, v), g, beta, weights, segments)             # [B, T, H/P, V]
        return sequence.to_sequence(o)                                   # [B, T/P, H, V]

    @staticmethod
    def _mix(inputs: tuple[jax.Array, ...], g: jax.Array, beta: jax.Array,
             weights: tuple[jax.Array, ...], segment_ids: jax.Array | None) -> jax.Array:
        """The conv then the chunked rule over whole rows: q, k [B, T, Hk, K], v [B, T, H, V]
        (before the conv), g, beta [B, T, H], the conv filters [W, heads, dim] -> o
        [B, T, H, V]."""
        q, k, v = (causal_conv(x, w, segment_ids) for x, w in zip(inputs, weights))
        o, _ = gated_delta_chunked(q, k, v, g, beta, segment_ids=segment_ids,
                                   use_qk_l2norm_in_kernel=True)                  # [B, T, H, V]
        return o

    def decode(self, h_BTD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """h [B, T, D] against and into this layer's cache (`init_recurrent_cache` with lead
        [B]) -> ([B, T, D], the cache after the rows' last real tokens).

        A row whose first position is 0 starts a sequence: its window and state start from
        zeros, whatever an earlier generation left there. `segment_ids` int [B, T] marks a
        prefill's right pads (`PAD_SEGMENT`, else one segment id): pads write nothing, so the
        state is the last prompt token's and the window holds the last W - 1 real inputs.
        T = 1 steps through the recurrent rule, a longer block through `chunked_prefill`'s."""
        t = h_BTD.shape[1]
        fresh_B = positions[:, 0] == 0
        real_B = (jnp.full(h_BTD.shape[:1], t) if segment_ids is None
                  else jnp.sum(segment_ids != PAD_SEGMENT, axis=1))
        inputs, z, g, beta = self._project(h_BTD)
        convolved, written = [], {}
        for name, x, w in zip(("conv_q", "conv_k", "conv_v"), inputs, self._conv_weights()):
            window = jnp.where(fresh_B[:, None, None, None], 0, cache[name]).astype(x.dtype)
            width = window.shape[1]
            x_ext = jnp.concatenate([window, x], axis=1)               # [B, W - 1 + T, ., .]
            convolved.append(causal_conv(x_ext, w)[:, width:])
            # x_ext is the window then the T inputs: its last W - 1 real ones start at `real`
            last_BW = real_B[:, None] + jnp.arange(width)
            written[name] = jnp.take_along_axis(x_ext, last_BW[:, :, None, None],
                                                axis=1).astype(cache[name].dtype)
        state = jnp.where(fresh_B[:, None, None, None], 0.0, cache["state"])
        rule = gated_delta_chunked if t > 1 and chunked_prefill() else gated_delta_recurrent
        o, state = rule(*convolved, g, beta, initial_state=state, segment_ids=segment_ids,
                        use_qk_l2norm_in_kernel=True)                           # [B, T, H, V]
        written["state"] = state.astype(cache["state"].dtype)
        return jnp.einsum("BTHV,HVD->BTD", self.norm(o, z), self.wo[...]), written

    def decode_slots(self, h_DND: jax.Array, positions: jax.Array, slots: RecurrentSlots,
                     states: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """A continuous-batching step's places h [D, N, D] (`models.recurrent_slots`) against
        their sequences' slots: `states` this layer's entries of `init_recurrent_cache` with
        lead [D, S + 1] (conv windows and the [H, K, V] state of each slot) -> ([D, N, D], the
        states after the step). The projections, the output norm and the output projection run
        over all N places at once; the conv and the recurrent rule one place at a time, in each
        sequence's position order (`scan_places`)."""
        inputs, z, g, beta = self._project(h_DND)
        names = ("conv_q", "conv_k", "conv_v")

        def token(state, x):
            raw, g_H, beta_H = x                      # raw: q, k [Hk, K], v [H, V]; g, beta [H]
            new, convolved = {}, []
            for name, x_HK, w_WHK in zip(names, raw, self._conv_weights()):
                window_WHK = jnp.concatenate([state[name].astype(x_HK.dtype), x_HK[None]])
                convolved.append(causal_conv(window_WHK[None], w_WHK)[0, -1])
                new[name] = window_WHK[1:]                              # the last W - 1 inputs
            q, k, v = (c[None, None] for c in convolved)                # [1, 1, heads, dim]
            o, state_1HKV = gated_delta_recurrent(
                q, k, v, g_H[None, None], beta_H[None, None], initial_state=state["state"][None],
                use_qk_l2norm_in_kernel=True)
            new["state"] = state_1HKV[0]
            return new, o[0, 0]                                         # [H, V]

        states, o = scan_places(token, states, (inputs, g, beta), positions, slots.slots,
                                slots.order)                            # o [D, N, H, V]
        return jnp.einsum("BTHV,HVD->BTD", self.norm(o, z), self.wo[...]), states

    def _conv_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.conv_q[...], self.conv_k[...], self.conv_v[...]

    def _project(self, h_BTD: jax.Array) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array,
                                                  jax.Array]:
        """((q, k [B, T, Hk, K], v [B, T, H, V]) before the conv, z [B, T, H, V], the log-decay
        g and the write strength beta [B, T, H]) of the normed residual h [B, T, D]."""
        inputs = (jnp.einsum("BTD,DHK->BTHK", h_BTD, self.wq[...]),
                  jnp.einsum("BTD,DHK->BTHK", h_BTD, self.wk[...]),
                  jnp.einsum("BTD,DHV->BTHV", h_BTD, self.wv[...]))
        z = jnp.einsum("BTD,DHV->BTHV", h_BTD, self.wz[...])
        beta = jax.nn.sigmoid(jnp.einsum("BTD,DH->BTH", h_BTD, self.wb[...]))
        acc = at_least_float32(h_BTD.dtype)
        a = jnp.einsum("BTD,DH->BTH", h_BTD, self.wa[...]).astype(acc)
        g = -jnp.exp(self.a_log[...].astype(acc)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(acc))                                    # [B, T, H]
        return inputs, z, g, beta
