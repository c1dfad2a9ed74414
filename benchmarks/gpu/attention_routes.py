"""Attention routes on one Qwen3-0.6B-shaped layer, forward + backward, bf16, side by side.

    python benchmarks/gpu/attention_routes.py [--lengths 2048 8192] [--repeats 5] [--tiny]

The layer (benchmarks/attention.py's): x [1, T, 1024] -> q (16 heads), k, v (8 kv heads) of head
dim 128 -> causal GQA attention -> output projection; bfloat16 arrays, B = 1. Timed: the value
and gradient of sum(layer(x) * cotangent) with respect to x and the four weights, jitted,
median of --repeats runs after 2 warm-ups. Routes:

* `naive`, `blockwise`, `cudnn`, `pallas`: `models.attention.attention(..., implementation=...)`,
  the dispatch every family calls (`ModelConfig.attention`; "auto" picks cudnn on a CUDA GPU
  where it applies, else pallas where it applies, else blockwise);
* `jax_cudnn`, `jax_xla`: `jax.nn.dot_product_attention(is_causal=True, implementation=...)`
  called directly (k and v with their 8 heads: it takes GQA);
* `pallas_mha`: `jax.experimental.pallas.ops.gpu.attention.mha` (Triton flash attention; k and
  v repeated to 16 heads, as it takes no GQA).

`--packed`: every row packs sequences of 64..T/4 tokens (random lengths, seed 0) and ends in
64 padding tokens (segment ids, id 0 padding), so only the routes that take segment ids run
(naive, blockwise, pallas).

Each route's loss and gradients are compared with the naive route's (largest difference
relative to the largest naive value, over the loss and the five gradients): a fast route that
computes something else is reported, not hidden. Routes a platform cannot run (cuDNN off a
CUDA GPU, the Triton kernel off a GPU) are skipped with the reason printed.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import common
from zeroxla.models import attention as dispatch

SECTION = "attention_routes"
D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 1024, 16, 8, 128          # Qwen3-0.6B
DTYPE = jnp.bfloat16


def pallas_mha(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(a, groups, axis=2) for a in (k, v))
    return pallas_attention.mha(q, k, v, None, sm_scale=1.0 / np.sqrt(q.shape[-1]), causal=True)


def ours(implementation):
    return lambda q, k, v, seg=None: dispatch.attention(q, k, v, segment_ids=seg,
                                                        implementation=implementation)


ROUTES = {
    "naive": ours("naive"),
    "blockwise": ours("blockwise"),
    "cudnn": ours("cudnn"),
    "pallas": ours("pallas"),
    "jax_cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation="cudnn"),
    "jax_xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="xla"),
    "pallas_mha": pallas_mha,
}


PACKED_ROUTES = ("naive", "blockwise", "pallas")


def skip_reason(route: str, packed: bool = False) -> str | None:
    """Why `route` cannot run on this platform (None: it can)."""
    q = jax.ShapeDtypeStruct((1, 128, HEADS, HEAD_DIM), DTYPE)
    if packed and route not in PACKED_ROUTES:
        return "takes no segment ids"
    if route in ("cudnn", "jax_cudnn"):
        reasons = dispatch.cudnn_refusals(q, q, q)
        if jax.default_backend() != "gpu":
            reasons.append(f"no CUDA GPU (backend {jax.default_backend()})")
        return "; ".join(reasons) or None
    if route == "pallas_mha" and not common.on_gpu():
        return f"the Triton kernel needs a GPU (backend {jax.default_backend()})"
    return None


def layer(attend, x, wq, wk, wv, wo, seg):
    q = jnp.einsum("BTD,DHK->BTHK", x, wq)
    k = jnp.einsum("BTD,DGK->BTGK", x, wk)
    v = jnp.einsum("BTD,DGK->BTGK", x, wv)
    out = attend(q, k, v) if seg is None else attend(q, k, v, seg)
    return jnp.einsum("BTHK,HKD->BTD", out, wo)


def value_and_grads(attend, seg=None):
    def loss(x, wq, wk, wv, wo, cotangent):
        out = layer(attend, x, wq, wk, wv, wo, seg).astype(jnp.float32)
        return jnp.sum(out * cotangent.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def inputs(t: int) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    shapes = [(1, t, D_MODEL), (D_MODEL, HEADS, HEAD_DIM), (D_MODEL, KV_HEADS, HEAD_DIM),
              (D_MODEL, KV_HEADS, HEAD_DIM), (HEADS, HEAD_DIM, D_MODEL), (1, t, D_MODEL)]
    scales = [1.0, D_MODEL ** -0.5, D_MODEL ** -0.5, D_MODEL ** -0.5, (HEADS * HEAD_DIM) ** -0.5,
              1.0]
    return [jnp.asarray(rng.standard_normal(s) * c, DTYPE) for s, c in zip(shapes, scales)]


def largest_gap(got, want) -> float:
    """max |got - want| / max |want| over every leaf (float32)."""
    gaps = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        gaps.append(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)))
    return max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--routes", nargs="+", choices=sorted(ROUTES), default=list(ROUTES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--packed", action="store_true",
                        help="packed rows with segment ids (module docstring)")
    parser.add_argument("--tiny", action="store_true", help=common.TINY_HELP)
    args = parser.parse_args()
    if args.tiny:
        args.lengths, args.repeats = [256], 2
    print(f"{jax.devices()[0]}, Qwen3-0.6B attention layer (d_model {D_MODEL}, {HEADS} q heads, "
          f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}), bf16, B=1, forward + backward"
          f"{', packed rows' if args.packed else ''}", flush=True)
    for route in args.routes:
        reason = skip_reason(route, args.packed)
        if reason:
            print(f"skipped {route}: {reason}")
            common.record(SECTION, route=route, packed=args.packed, skipped=reason)
    runnable = [r for r in args.routes if not skip_reason(r, args.packed)]
    for t in args.lengths:
        xs = inputs(t)
        seg = (jnp.asarray(common.packed_rows(np.random.default_rng(0), 1, t)["segment_ids"])
               if args.packed else None)
        reference = common.guarded(SECTION, f"naive T={t}",
                                   lambda: jax.block_until_ready(
                                       value_and_grads(ROUTES["naive"], seg)(*xs)))
        for route in runnable:
            def measure(route=route, xs=xs, reference=reference):
                fn = value_and_grads(ROUTES[route], seg)
                result = jax.block_until_ready(fn(*xs))
                gap = None if reference is None else largest_gap(result, reference)
                del result
                seconds = common.median_seconds(lambda: fn(*xs), warmup=2,
                                                repeats=args.repeats)
                common.record(SECTION, route=route, seq=t, packed=args.packed, seconds=seconds,
                              ms=round(seconds * 1e3, 3), max_rel_gap_vs_naive=gap)
            common.guarded(SECTION, f"{route} T={t}", measure)


if __name__ == "__main__":
    main()
