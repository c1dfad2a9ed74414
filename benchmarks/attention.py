"""Attention at long sequence lengths: the naive [T, T] path against the blockwise one
(`models.blockwise_attention`), on one Qwen3-0.6B-shaped layer's attention.

The layer: x [B, T, 1024] -> q (16 heads), k, v (8 kv heads) of head dim 128 -> causal GQA
attention -> output projection [B, T, 1024]; float32 throughout, B = 1. Two measurements:

1. Memory: the compiled program's temporaries (`compiled.memory_analysis().temp_size_in_bytes`,
   XLA's own accounting; compiled from `jax.ShapeDtypeStruct`s, nothing allocated), forward
   alone and forward + backward (the gradient of every input and weight), at T = 2K ... 32K.
2. CPU time: forward + backward, run, median of `--repeats` runs, naive and blockwise
   interleaved (each round times both, so both see the same load), at `--time-lengths`.

    python benchmarks/attention.py                      # the table in docs/benchmarks.md
    python benchmarks/attention.py --time-lengths 2048  # shorter
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.models import layers
from zeroxla.models.blockwise_attention import KV_BLOCK, Q_BLOCK, blockwise_attention

D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 1024, 16, 8, 128     # Qwen3-0.6B
LENGTHS = (2048, 4096, 8192, 16384, 32768)
TIME_LENGTHS = (2048, 8192)
DTYPE = jnp.float32
PATHS = {"naive": layers.causal_attention, "blockwise": blockwise_attention}


def layer_attention(attend, x, wq, wk, wv, wo):
    """x [B, T, D] -> [B, T, D]: projections, causal GQA attention by `attend`, output
    projection."""
    q = jnp.einsum("BTD,DHK->BTHK", x, wq)
    k = jnp.einsum("BTD,DGK->BTGK", x, wk)
    v = jnp.einsum("BTD,DGK->BTGK", x, wv)
    return jnp.einsum("BTHK,HKD->BTD", attend(q, k, v), wo)


def shapes(t: int) -> list[jax.ShapeDtypeStruct]:
    dims = ((1, t, D_MODEL), (D_MODEL, HEADS, HEAD_DIM), (D_MODEL, KV_HEADS, HEAD_DIM),
            (D_MODEL, KV_HEADS, HEAD_DIM), (HEADS, HEAD_DIM, D_MODEL))
    return [jax.ShapeDtypeStruct(d, DTYPE) for d in dims]


def forward(attend):
    return jax.jit(lambda *a: layer_attention(attend, *a))


def forward_backward(attend):
    """The loss sum(layer(x) * cotangent)'s value and gradient of x and every weight."""
    def loss(x, wq, wk, wv, wo, cotangent):
        return jnp.sum(layer_attention(attend, x, wq, wk, wv, wo) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def temporaries(t: int) -> dict[tuple[str, str], float | None]:
    """GiB of compiled temporaries per (path, "fwd" | "fwd+bwd"); None where compiling fails."""
    out = {}
    for name, attend in PATHS.items():
        for kind, build, extra in (("fwd", forward, ()),
                                   ("fwd+bwd", forward_backward, (shapes(t)[0],))):
            try:
                compiled = build(attend).lower(*shapes(t), *extra).compile()
                out[name, kind] = compiled.memory_analysis().temp_size_in_bytes / 2**30
            except Exception as error:                  # noqa: BLE001  (reported, not hidden)
                print(f"  {name} {kind} at T={t} did not compile: {type(error).__name__}: "
                      f"{str(error)[:200]}")
                out[name, kind] = None
    return out


def _inputs(t: int, seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s.shape) for s in shapes(t) + [shapes(t)[0]]]
    arrays[1:5] = [a / np.sqrt(D_MODEL if i < 3 else HEADS * HEAD_DIM)
                   for i, a in enumerate(arrays[1:5])]
    return [jnp.asarray(a, DTYPE) for a in arrays]


def cpu_times(t: int, repeats: int) -> dict[str, float]:
    """Median seconds of one forward + backward per path (compiled first; rounds interleave
    the paths), and the largest difference of their results as a check."""
    inputs = _inputs(t)
    steps = {name: forward_backward(attend) for name, attend in PATHS.items()}
    results = {name: jax.block_until_ready(step(*inputs)) for name, step in steps.items()}
    diff = max(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b))))
               for a, b in zip(jax.tree.leaves(results["blockwise"]),
                               jax.tree.leaves(results["naive"])))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*inputs))
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {**medians, "max_rel_diff": diff}


def _gib(x: float | None) -> str:
    return "    n/a" if x is None else f"{x:7.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "   n/a" if a is None or b is None else f"{a / b:6.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=LENGTHS)
    parser.add_argument("--time-lengths", type=int, nargs="*", default=TIME_LENGTHS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, Qwen3-0.6B attention layer "
          f"(d_model {D_MODEL}, {HEADS} q heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}), "
          f"{jnp.dtype(DTYPE).name}, B=1, blocks {Q_BLOCK}x{KV_BLOCK}")
    print("compiled temporaries, GiB")
    header = (f"{'T':>6} | {'naive fwd':>9} {'block fwd':>9} {'ratio':>6} | "
              f"{'naive f+b':>9} {'block f+b':>9} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    table = {}
    for t in args.lengths:
        table[t] = m = temporaries(t)
        print(f"{t:>6} | {_gib(m['naive', 'fwd']):>9} {_gib(m['blockwise', 'fwd']):>9} "
              f"{_ratio(m['naive', 'fwd'], m['blockwise', 'fwd'])} | "
              f"{_gib(m['naive', 'fwd+bwd']):>9} {_gib(m['blockwise', 'fwd+bwd']):>9} "
              f"{_ratio(m['naive', 'fwd+bwd'], m['blockwise', 'fwd+bwd'])}", flush=True)
    if 8192 in table and 32768 in table:
        for name in PATHS:
            print(f"growth 8K -> 32K, fwd+bwd, {name}: "
                  f"{_ratio(table[32768][name, 'fwd+bwd'], table[8192][name, 'fwd+bwd']).strip()}x")
    if args.time_lengths:
        print(f"\nCPU time, forward + backward, median of {args.repeats} interleaved runs, s")
        print(f"{'T':>6} | {'naive':>8} {'blockwise':>9} {'block/naive':>11} | max rel diff")
        for t in args.time_lengths:
            r = cpu_times(t, args.repeats)
            print(f"{t:>6} | {r['naive']:8.2f} {r['blockwise']:9.2f} "
                  f"{r['blockwise'] / r['naive']:11.2f} | {r['max_rel_diff']:.1e}", flush=True)


if __name__ == "__main__":
    main()
