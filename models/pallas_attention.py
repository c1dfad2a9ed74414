"""The Pallas (Triton) flash attention route: jax's own FlashAttention-2 kernel,
`jax.experimental.pallas.ops.gpu.attention.mha`, forward and backward, behind our contract.

Where it serves: on a CUDA GPU where cuDNN's fused attention cannot run the call, above all
packed rows (segment ids, which `jax.nn.dot_product_attention` does not take) and float32. On an
H100 it ran one causal Qwen3-0.6B-shaped layer at T = 8K in 7.5 ms forward + backward against
35 ms for the plain-JAX blockwise route (docs/benchmarks.md, "One GPU"). Off a GPU the kernel
runs interpreted (`interpret=True`): the tests' route, exact but slow.

What our contract adds to the kernel's (`pallas_refusals` lists what it does not take):
- grouped-query attention: k and v repeated to q's heads (the kernel takes H = G only);
- segment id 0 is padding whose output is zeros (the kernel lets padding attend to padding):
  those rows are zeroed, which also zeroes every gradient through them;
- the scale defaults to 1/sqrt(K), as every other route.

jax 0.11 and 0.12 mark the kernel's module deprecated (its successor is tokamax's
`dot_product_attention`, a separate package); where a jax no longer has it, the route is
refused by name (`pallas_refusals`) and "auto" takes the blockwise route.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

# The kernel's default blocks: 128 query / key rows forward, 32 in the backward kernels; the
# sequence must split into whole blocks of both.
FORWARD_BLOCK, BACKWARD_BLOCK = 128, 32
KERNEL_MODULE = "jax.experimental.pallas.ops.gpu.attention"


def _kernel() -> ModuleType | None:
    """jax's flash attention module, or None where this jax has none (its deprecation notice,
    which names its successor, is not repeated at every trace)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module(KERNEL_MODULE)
    except ImportError:
        return None


def pallas_refusals(q: Any, k: Any, v: Any, *, window: int | None = None,
                    softcap: float | None = None, sinks: Any = None) -> list[str]:
    """Why the Pallas flash kernel cannot run this call (empty when it can): each reason names
    the argument, its value and what the kernel accepts."""
    reasons = []
    if _kernel() is None:
        reasons.append(f"{KERNEL_MODULE} is not in jax {jax.__version__} (tokamax's "
                       "dot_product_attention is its successor)")
    t, head_dim = q.shape[1], q.shape[-1]
    if t % min(FORWARD_BLOCK, t) or t % BACKWARD_BLOCK:
        reasons.append(f"sequence length T={t} (the Pallas kernel takes a multiple of "
                       f"{FORWARD_BLOCK}, or of {BACKWARD_BLOCK} below {FORWARD_BLOCK})")
    if head_dim & (head_dim - 1):
        reasons.append(f"head_dim={head_dim} (the Pallas kernel takes a power of two)")
    if window is not None:
        reasons.append(f"window={window} (the Pallas kernel has no sliding window)")
    if softcap is not None:
        reasons.append(f"softcap={softcap} (the Pallas kernel has no soft-capping)")
    if sinks is not None:     # its residual logsumexp has no cotangent: sinks would get none
        reasons.append("sinks given (the Pallas kernel's logsumexp has no gradient to apply "
                       "attention sinks from)")
    if not q.dtype == k.dtype == v.dtype:
        reasons.append(f"dtype q {q.dtype}, k {k.dtype}, v {v.dtype} (one dtype for all three)")
    return reasons


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
                     segment_ids: jax.Array | None = None,
                     interpret: bool | None = None) -> jax.Array:
    """Causal attention q [B, T, H, K], k and v [B, T, G, K] -> [B, T, H, K] by the Pallas
    flash kernel; `pallas_refusals` must be empty. `interpret` None: compiled on a GPU,
    interpreted elsewhere (False lowers the Triton kernel for CUDA from a CPU host)."""
    flash = _kernel()
    groups = q.shape[2] // k.shape[2]
    if groups > 1:                                    # [B, T, G, K] -> [B, T, H, K]
        k, v = (jnp.repeat(a, groups, axis=2) for a in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    segments = None if segment_ids is None else segment_ids.astype(jnp.int32)
    out = flash.mha(q, k, v, segments, sm_scale=float(scale), causal=True,
                    interpret=jax.default_backend() != "gpu" if interpret is None else interpret)
    if segment_ids is None:
        return out
    return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


__all__ = ["pallas_attention", "pallas_refusals"]
