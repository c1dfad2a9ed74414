"""The gated delta rule, Gated DeltaNet's token mixer (Yang, Kautz & Hatamizadeh 2024), in JAX.

Per value head a state S [K, V] is decayed, corrected towards the token's value and read:

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (β_t (v_t - S_tᵀ k_t))ᵀ
    o_t = S_tᵀ q_t                                  (q times 1/sqrt(K))

`gated_delta_recurrent` is that recurrence, a `lax.scan` over tokens (decode, and the plain
form). `gated_delta_chunked` is the chunked form for training and prefill (the WY / UT-transform
form of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule", §3): inside a
chunk of C tokens the corrections δ solve one unit lower-triangular system
(I + L) δ = β v - β A k S_0, with L_ij = β_i (k_i · k_j) exp(cum_i - cum_j) below the diagonal,
so a chunk costs a few [C, C] and [C, K] matmuls; a `lax.scan` over chunks carries S. Each
chunk's body is rematerialised (`jax.checkpoint`), so the backward pass keeps only the inputs and
one state per chunk: memory O(T * d + T / C * K * V), never O(T²).

Both equal transformers' `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`
(Qwen3.5 / Qwen3-Next), grouped key heads and `use_qk_l2norm_in_kernel` included. State and
accumulation are float32 (float64 for float64 input) whatever the input dtype; outputs are in
v's dtype.

Packing (`segment_ids` [B, T], `PAD_SEGMENT` = 0 is padding): the state is zeroed at the first
token of each segment. The reset is exact inside a chunk: the pairwise decays are masked to zero
across a segment start (never a -inf log-decay, whose differences would be NaN), and the carried
state reaches only the tokens before the chunk's first reset. Padding tokens are inert (no decay,
no write) and give zeros, so a right-padded row's final state is its last segment's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Segment id of padding (`layers.PAD_SEGMENT`, MaxText's convention).
PAD_SEGMENT = 0

# Tokens per chunk: the [C, C] solve and matmuls against one state read per chunk (FLA's and
# transformers' default).
CHUNK = 64

# l2norm's epsilon, inside the square root (transformers' `l2norm`, after FLA).
L2NORM_EPS = 1e-6


def gated_delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                          beta: jax.Array, *, initial_state: jax.Array | None = None,
                          segment_ids: jax.Array | None = None,
                          use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule token by token.

    q, k [B, T, Hk, K], v [B, T, H, V] with H a multiple of Hk (each key head serves H / Hk
    consecutive value heads), g (log-decay, <= 0) and beta [B, T, H], `initial_state`
    [B, H, K, V] (default zeros), `segment_ids` int [B, T] (packing; see the module docstring).
    `use_qk_l2norm_in_kernel` L2-normalises q and k first, as transformers' flag does.
    Returns (out [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32).
    """
    _check(q, k, v, g, beta, initial_state, segment_ids)
    acc = _accumulation_dtype(v)
    reset_BT, g, beta, real_BT = _segments(segment_ids, g, beta)
    q, k = _prepare_qk(q, k, v.shape[2], use_qk_l2norm_in_kernel, acc)
    state = _initial_state(initial_state, q, v, acc)

    def step(state_BHKV, xs):
        q_BHK, k_BHK, v_BHV, g_BH, beta_BH, reset_B = xs
        state_BHKV = jnp.where(reset_B[:, None, None, None], 0.0, state_BHKV)
        state_BHKV = state_BHKV * jnp.exp(g_BH)[..., None, None]
        read_BHV = jnp.einsum("bhkv,bhk->bhv", state_BHKV, k_BHK)
        delta_BHV = (v_BHV.astype(acc) - read_BHV) * beta_BH[..., None]
        state_BHKV = state_BHKV + jnp.einsum("bhk,bhv->bhkv", k_BHK, delta_BHV)
        return state_BHKV, jnp.einsum("bhkv,bhk->bhv", state_BHKV, q_BHK)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset_BT)]
    state, out_TBHV = lax.scan(step, state, time_major)
    out_BTHV = jnp.moveaxis(out_TBHV, 0, 1)
    return _finish(out_BTHV, real_BT, v.dtype), state


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                        beta: jax.Array, *, chunk: int = CHUNK,
                        initial_state: jax.Array | None = None,
                        segment_ids: jax.Array | None = None,
                        use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule chunk by chunk (WY / UT transform), memory-linear in T.

    Takes and returns what `gated_delta_recurrent` does, and equals it. `chunk`: tokens per
    chunk (clipped to T); T need not be a multiple of it (padded inside with inert tokens).
    """
    _check(q, k, v, g, beta, initial_state, segment_ids, chunk=chunk)
    acc = _accumulation_dtype(v)
    b, t, h = v.shape[:3]
    chunk = min(chunk, t)
    reset_BT, g, beta, real_BT = _segments(segment_ids, g, beta)
    state = _initial_state(initial_state, q, v, acc)
    n = -(-t // chunk)

    def chunk_major(x):
        """[B, T, ...] -> [N, B, C, ...], T padded with zeros (inert: no decay, no write)."""
        x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    body = functools.partial(_chunk_step, l2norm=use_qk_l2norm_in_kernel, acc=acc)
    body = jax.checkpoint(body, prevent_cse=False)
    state, out_NBCHV = lax.scan(body, state, [chunk_major(x) for x in
                                              (q, k, v, g, beta, reset_BT)])
    out_BTHV = jnp.moveaxis(out_NBCHV, 0, 1).reshape(b, n * chunk, h, -1)[:, :t]
    return _finish(out_BTHV, real_BT, v.dtype), state


def _chunk_step(state_BHKV, xs, *, l2norm, acc):
    """One chunk: its outputs from the carried state and its own tokens, and the next state.

    xs: q, k [B, C, Hk, K], v [B, C, H, V], g, beta [B, C, H], reset [B, C]. A_i (the carried
    state's decay to token i) and D_ij (token j's write's decay to token i) are zero across a
    segment start, which makes the reset exact."""
    q_BCHK, k_BCHK, v_BCHV, g_BCH, beta_BCH, reset_BC = xs
    q_BCHK, k_BCHK = _prepare_qk(q_BCHK, k_BCHK, v_BCHV.shape[2], l2norm, acc)
    q_BHCK, k_BHCK, v_BHCV = (jnp.swapaxes(x, 1, 2) for x in (q_BCHK, k_BCHK, v_BCHV))
    v_BHCV = v_BHCV.astype(acc)
    cum_BHC = jnp.cumsum(jnp.swapaxes(g_BCH, 1, 2), axis=-1)
    beta_BHC1 = jnp.swapaxes(beta_BCH, 1, 2)[..., None]

    # seg_i: segment starts in [0, i] of this chunk; i and j share a segment iff seg_i == seg_j.
    seg_BC = jnp.cumsum(reset_BC.astype(jnp.int32), axis=1)
    c = seg_BC.shape[1]
    causal_CC = jnp.tril(jnp.ones((c, c), bool))
    visible_B1CC = (causal_CC & (seg_BC[:, :, None] == seg_BC[:, None, :]))[:, None]
    decay_BHCC = jnp.exp(jnp.where(visible_B1CC, cum_BHC[..., :, None] - cum_BHC[..., None, :],
                                   -jnp.inf))
    from_start_BHC = jnp.where((seg_BC == 0)[:, None], jnp.exp(cum_BHC), 0.0)            # A_i
    to_end_BHC = jnp.where((seg_BC == seg_BC[:, -1:])[:, None],
                           jnp.exp(cum_BHC[..., -1:] - cum_BHC), 0.0)
    chunk_decay_BH = jnp.where((seg_BC[:, -1] == 0)[:, None], jnp.exp(cum_BHC[..., -1]), 0.0)

    # The UT transform: (I + L) [u | w] = [β v | β A k]; the corrections are δ = u - w S_0.
    k_beta_BHCK = k_BHCK * beta_BHC1
    system_BHCC = jnp.einsum("bhik,bhjk->bhij", k_beta_BHCK, k_BHCK) * decay_BHCC
    rhs_BHCM = jnp.concatenate([v_BHCV * beta_BHC1, k_beta_BHCK * from_start_BHC[..., None]], -1)
    solved_BHCM = lax.linalg.triangular_solve(system_BHCC, rhs_BHCM, left_side=True, lower=True,
                                              unit_diagonal=True)
    u_BHCV, w_BHCK = jnp.split(solved_BHCM, [v_BHCV.shape[-1]], axis=-1)
    delta_BHCV = u_BHCV - jnp.einsum("bhck,bhkv->bhcv", w_BHCK, state_BHKV)

    attn_BHCC = jnp.einsum("bhik,bhjk->bhij", q_BHCK, k_BHCK) * decay_BHCC
    out_BHCV = (jnp.einsum("bhck,bhkv->bhcv", q_BHCK * from_start_BHC[..., None], state_BHKV)
                + jnp.einsum("bhij,bhjv->bhiv", attn_BHCC, delta_BHCV))
    state_BHKV = (state_BHKV * chunk_decay_BH[..., None, None]
                  + jnp.einsum("bhck,bhcv->bhkv", k_BHCK * to_end_BHC[..., None], delta_BHCV))
    return state_BHKV, jnp.swapaxes(out_BHCV, 1, 2).astype(v_BCHV.dtype)


def _prepare_qk(q, k, heads, l2norm, acc):
    """q, k [B, T, Hk, K] -> [B, T, H, K] in `acc`: key heads repeated for their value heads,
    L2-normalised if asked, q times 1/sqrt(K) (transformers' order)."""
    q, k = (jnp.repeat(x.astype(acc), heads // x.shape[2], axis=2) for x in (q, k))
    if l2norm:
        q, k = (x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
                for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


def _segments(segment_ids, g, beta):
    """(reset [B, T] bool, g and beta [B, T, H] in float32 or wider, real [B, T] bool or None).

    A token resets the state when it is real and its segment differs from the last real token's
    before it (padding between two tokens of one segment does not split it; the row's first
    segment starts from `initial_state`). Padding tokens get g = 0 and beta = 0: inert."""
    acc = jnp.promote_types(g.dtype, jnp.float32)
    g, beta = g.astype(acc), beta.astype(jnp.promote_types(beta.dtype, jnp.float32))
    b, t = g.shape[:2]
    if segment_ids is None:
        return jnp.zeros((b, t), bool), g, beta, None
    real_BT = segment_ids != PAD_SEGMENT
    # The index of the last real token at or before each position (-1: none yet).
    last_real_BT = lax.cummax(jnp.where(real_BT, jnp.arange(t), -1), axis=1)
    previous_BT = jnp.pad(last_real_BT[:, :-1], [(0, 0), (1, 0)], constant_values=-1)
    previous_id_BT = jnp.take_along_axis(segment_ids, jnp.maximum(previous_BT, 0), axis=1)
    reset_BT = real_BT & (previous_BT >= 0) & (previous_id_BT != segment_ids)
    g = jnp.where(real_BT[..., None], g, 0.0)
    beta = jnp.where(real_BT[..., None], beta, 0.0)
    return reset_BT, g, beta, real_BT


def _finish(out_BTHV, real_BT, dtype):
    """Padding tokens' outputs zeroed; the output in the input's dtype."""
    if real_BT is not None:
        out_BTHV = jnp.where(real_BT[..., None, None], out_BTHV, 0.0)
    return out_BTHV.astype(dtype)


def _accumulation_dtype(v):
    """float32, or float64 for float64 input: the state's and every sum's dtype."""
    return jnp.promote_types(v.dtype, jnp.float32)


def _initial_state(initial_state, q, v, acc):
    """The state [B, H, K, V] to start from, in `acc` (zeros when none is given)."""
    b, _, h, dv = v.shape
    if initial_state is None:
        return jnp.zeros((b, h, q.shape[-1], dv), acc)
    return initial_state.astype(acc)


def _check(q, k, v, g, beta, initial_state, segment_ids, *, chunk=CHUNK):
    """Refuses, by name, shapes and options the rule does not take."""
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, K]; got q {q.shape}, k {k.shape}")
    b, t, hk, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (b, t) or v.shape[2] % hk:
        raise ValueError(f"v must be [B, T, H, V] with B, T = {(b, t)} and H a multiple of the "
                         f"{hk} key heads; got v {v.shape}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(f"{name} must be [B, T, H] = {v.shape[:3]}; got {x.shape}")
    state_shape = (b, v.shape[2], dk, v.shape[3])
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [B, H, K, V] = {state_shape}; got "
                         f"{initial_state.shape}")
    if segment_ids is not None and (segment_ids.shape != (b, t)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids must be int [B, T] = {(b, t)}; got {segment_ids.dtype} "
                         f"{segment_ids.shape}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive int (tokens per chunk, e.g. 64)")
