"""The one attention every family calls: which implementation runs, per platform, and its
refusals.

Implementations of causal grouped-query attention (all equal to `layers.causal_attention`):

- "naive": `layers.causal_attention`, the reference; holds the [B, H, T, T] scores.
- "blockwise": `blockwise_attention` (FlashAttention-2 in plain JAX), memory-linear in T; runs
  on every platform and takes every option (window, scale, soft-cap, segment ids).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash
  attention on NVIDIA GPUs, where its constraints hold (`cudnn_refusals`).
- "pallas": jax's Pallas (Triton) flash attention kernel (`pallas_attention`), compiled on a GPU
  and interpreted elsewhere, where its constraints hold (`pallas_refusals`); takes segment ids
  and float32, which cuDNN's route does not.
- "auto": on a CUDA GPU cudnn where its constraints hold, else pallas where its hold and q, k,
  v are 16-bit (the Triton kernel's float32 dots may run in TF32: float32 stays blockwise);
  blockwise elsewhere (MaxText likewise picks a fused kernel per platform and falls back to
  its own).

Attention sinks (gpt-oss's learned per-head logit, `sinks` [H]) are applied from the
log-sum-exp of every route that has one with a gradient (`online_softmax.sink_rescale`:
blockwise, ring, all-gather, Ulysses, cached and paged decode) and directly by "naive"; cuDNN's
and the Pallas kernel's refuse them by name, and so does USP.

An explicit choice whose constraints do not hold raises ValueError naming which: never a silent
fallback. Decode against a KV cache (`cached_attention`) is blockwise over the cache
(`layers.cached_attention`) for every choice but "naive"; against a paged cache it is
`paged_attention` for every choice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import layers
from .blockwise_attention import blockwise_attention
from .pallas_attention import pallas_attention, pallas_refusals
from .paged_attention import is_paged, paged_attention
from .ring_attention import ring_attention
from .sequence_parallel import SequenceParallel, allgather_attention, ulysses_attention
from .usp_attention import usp_attention

IMPLEMENTATIONS = ("auto", "naive", "blockwise", "cudnn", "pallas")

# What cuDNN's fused attention takes (jax's `check_is_flash_attention`): 16-bit q, k, v of one
# dtype, a head dim that is a multiple of 8 and at most 256 from compute capability 9.0
# (Hopper) on, 128 before (and when lowering with no GPU attached).
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_HEAD_DIM_MULTIPLE = 8
CUDNN_HEAD_DIM_MAX = {True: 256, False: 128}          # keyed by "Hopper or later"


def check_implementation(implementation: str, owner: str = "attention") -> None:
    """ValueError naming `owner`'s implementation, its value and the accepted ones."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{owner}={implementation!r} is not an attention implementation; "
                         f"accepted: {', '.join(IMPLEMENTATIONS)}")


def _cuda_device() -> Any | None:
    """The first local CUDA GPU, or None (a CPU or TPU host, or a ROCm GPU)."""
    if jax.default_backend() != "gpu":
        return None
    device = jax.local_devices()[0]
    version = getattr(getattr(device, "client", None), "platform_version", "")
    return device if "cuda" in str(version).lower() else None


def cudnn_head_dim_max() -> int:
    """The largest head dim cuDNN's flash attention takes on this host's GPU (128 without
    one: what cuDNN itself assumes when lowering for CUDA on a CPU)."""
    device = _cuda_device()
    capability = getattr(device, "compute_capability", "0.0") if device is not None else "0.0"
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return CUDNN_HEAD_DIM_MAX[(major, minor) >= (9, 0)]


def cudnn_refusals(q: Any, k: Any, v: Any, *, softcap: float | None = None,
                   segment_ids: Any = None, sinks: Any = None) -> list[str]:
    """Why cuDNN's fused attention cannot run this call (empty when it can): each reason names
    the argument, its value and what cuDNN accepts."""
    reasons = []
    if q.dtype not in CUDNN_DTYPES or not q.dtype == k.dtype == v.dtype:
        reasons.append(f"dtype q {q.dtype}, k {k.dtype}, v {v.dtype} (cuDNN takes bfloat16 or "
                       "float16, all three alike)")
    head_dim, limit = q.shape[-1], cudnn_head_dim_max()
    if head_dim % CUDNN_HEAD_DIM_MULTIPLE or head_dim > limit:
        reasons.append(f"head_dim={head_dim} (cuDNN takes a multiple of "
                       f"{CUDNN_HEAD_DIM_MULTIPLE} up to {limit} on this device)")
    if softcap is not None:
        reasons.append(f"softcap={softcap} (cuDNN's fused attention has no soft-capping)")
    if segment_ids is not None:
        reasons.append("segment_ids given (jax.nn.dot_product_attention takes no segment ids)")
    if sinks is not None:
        reasons.append("sinks given (jax.nn.dot_product_attention has no attention sinks)")
    return reasons


def choose(q: Any, k: Any, v: Any, *, window: int | None = None, softcap: float | None = None,
           segment_ids: Any = None, sinks: Any = None, implementation: str = "auto") -> str:
    """The implementation that runs: `implementation` itself when explicit (ValueError naming
    each unmet constraint of an explicit "cudnn" or "pallas"), else per platform (module
    docstring)."""
    check_implementation(implementation)
    refusals = {"cudnn": lambda: cudnn_refusals(q, k, v, softcap=softcap,
                                                segment_ids=segment_ids, sinks=sinks),
                "pallas": lambda: pallas_refusals(q, k, v, window=window, softcap=softcap,
                                                  sinks=sinks)}
    if implementation in refusals and (reasons := refusals[implementation]()):
        raise ValueError(f"attention implementation={implementation!r} cannot run this call: "
                         f"{'; '.join(reasons)}; accepted: 'blockwise' or 'naive' for it, or "
                         "'auto' (blockwise where no fused kernel can)")
    if implementation != "auto":
        return implementation
    if _cuda_device() is None:
        return "blockwise"
    if not refusals["cudnn"]():
        return "cudnn"
    # float32 stays blockwise: the Triton kernel's float32 dots may run in TF32.
    return "pallas" if q.dtype in CUDNN_DTYPES and not refusals["pallas"]() else "blockwise"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | None = None,
              scale: float | None = None, softcap: float | None = None,
              segment_ids: jax.Array | None = None, sinks: jax.Array | None = None,
              implementation: str = "auto",
              sequence: SequenceParallel | None = None) -> jax.Array:
    """Causal softmax attention: q [B, T, H, K], k and v [B, T, G, K] (H a multiple of G) ->
    [B, T, H, K], by `implementation` (module docstring). Sliding `window`, `scale` (default
    1/sqrt(K)) and Gemma 2's `softcap`: `layers.causal_attention`; `segment_ids` int [B, T]
    packs sequences in a row, each attending within itself (0: padding, output zeros);
    `sinks` float [H]: gpt-oss's attention sinks, one logit per query head in every row's
    softmax, its column dropped (module docstring).

    `sequence` (sequence parallelism): q, k, v and segment_ids hold this device's T/P tokens of
    each sequence; the attention of the whole sequences is computed by DeepSpeed-Ulysses,
    all-gather context parallelism, ring attention or USP (Ulysses x ring) (`sequence_parallel`,
    its `strategy`) and this device's slice of it returned. Context parallelism (allgather,
    ring, usp) runs the blockwise attention only."""
    check_sinks(sinks, q.shape[2], sequence)
    if sequence is not None and sequence.size > 1 and sequence.zigzag:
        check_implementation(implementation)
        if implementation not in ("auto", "blockwise"):
            raise ValueError(f"attention implementation={implementation!r} under "
                             f"{sequence.strategy!r} context parallelism: its query chunks at "
                             "an offset run the blockwise attention only; accepted: 'auto' or "
                             "'blockwise'")
        if sequence.strategy == "ring":
            return ring_attention(q, k, v, sequence, segment_ids, window=window, scale=scale,
                                  softcap=softcap, sinks=sinks)
        if sequence.strategy == "usp":
            return usp_attention(attention, q, k, v, sequence, segment_ids, window=window,
                                 scale=scale, softcap=softcap, implementation=implementation)
        return allgather_attention(q, k, v, sequence, segment_ids, window=window, scale=scale,
                                   softcap=softcap, sinks=sinks)
    if sequence is not None and sequence.size > 1:
        return ulysses_attention(attention, q, k, v, sequence, segment_ids, window=window,
                                 scale=scale, softcap=softcap, sinks=sinks,
                                 implementation=implementation)
    if segment_ids is not None and (segment_ids.shape != q.shape[:2]
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids {segment_ids.shape} {segment_ids.dtype} must be int "
                         f"[B, T] = {q.shape[:2]}")
    route = choose(q, k, v, window=window, softcap=softcap, segment_ids=segment_ids,
                   sinks=sinks, implementation=implementation)
    if route == "naive":
        return layers.causal_attention(q, k, v, window=window, scale=scale, softcap=softcap,
                                       segment_ids=segment_ids, sinks=sinks)
    if route == "blockwise":
        return blockwise_attention(q, k, v, window=window, scale=scale, softcap=softcap,
                                   segment_ids=segment_ids, sinks=sinks)
    if route == "pallas":
        return pallas_attention(q, k, v, scale=scale, segment_ids=segment_ids)
    # cuDNN's sliding window (pos - L, pos] is ours; jax's (left, 0) passes L = left + 1.
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0))


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     cache: dict[str, jax.Array], *, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     segment_ids: jax.Array | None = None, sinks: jax.Array | None = None,
                     implementation: str = "auto") -> tuple[jax.Array, dict[str, jax.Array]]:
    """Attention of new tokens against one layer's KV cache (`layers.cached_attention`): the
    naive reference for "naive", read block by block (flash-decoding) otherwise; a `PagedKV`
    (`paged_attention`) is read page by page whatever the choice. A cache holds one sequence
    per row: `segment_ids` (packing) are refused. `sinks` [H]: as `attention`'s."""
    check_implementation(implementation)
    check_sinks(sinks, q.shape[2])
    if segment_ids is not None:
        raise ValueError("segment_ids given with a KV cache: a cache row holds one sequence; "
                         "decode packed sequences as separate rows (segment_ids=None)")
    if is_paged(cache):                 # a continuous-batching engine's pages
        return paged_attention(q, k, v, positions, cache, window=window, scale=scale,
                               softcap=softcap, sinks=sinks)
    attend = (layers.cached_attention_naive if implementation == "naive"
              else layers.cached_attention)
    return attend(q, k, v, positions, cache, window=window, scale=scale, softcap=softcap,
                  sinks=sinks)


def check_sinks(sinks: Any, heads: int, sequence: SequenceParallel | None = None) -> None:
    """ValueError naming `sinks`' shape or dtype unless a float [H] for q's `heads`, or the
    sequence-parallel strategy that does not take them (USP)."""
    if sinks is None:
        return
    if sinks.shape != (heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks {sinks.shape} {sinks.dtype} must be float [H] = ({heads},): "
                         "one logit per query head")
    if sequence is not None and sequence.size > 1 and sequence.strategy == "usp":
        raise ValueError("sinks under sequence_parallel_strategy='usp': its Ulysses groups "
                         "regroup the heads; accepted with sinks: 'ulysses', 'ring' or "
                         "'allgather'")


__all__ = ["IMPLEMENTATIONS", "attention", "cached_attention", "check_implementation",
           "check_sinks", "choose", "cudnn_refusals", "pallas_refusals"]
