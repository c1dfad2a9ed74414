"""Dropless expert compute on a Qwen3-30B-A3B-shaped MoE layer: executed expert FLOPs of the
tiled grouped matmul (`models.grouped_matmul`) against the ideal and against `ragged_dot`'s
CPU lowering, measured in the same run.

    python benchmarks/moe_experts.py [--tokens 4096] [--tiles 32,64,128] [--time]

The layer: d_model 2048, 128 experts of inner size 768, top-8 (Qwen3-30B-A3B's config.json),
float32, one device. Tokens are routed by a random router over random hidden states, plus two
adversarial routings (every token's k experts the same 8; half the experts never chosen).

* ideal: tokens x top-k x 6 x D x F (gate, up and down projections of each assignment);
* tiled: the program's own `tiles_used` (each expert's assignments padded to whole tiles,
  only tiles holding one run) x tile x 6 x D x F, per tile size;
* ragged_dot: `jax.lax.ragged_dot`'s three products as XLA:CPU compiles them, FLOPs from the
  compiled program's `cost_analysis()` (compiled, never run: it expands to a dense product
  over every expert).

`--time` also runs the tiled forward (median of 3 after a warm-up). The last line is
`tiled / ideal FLOPs (tile 64, random routing): R`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.models.grouped_matmul import expert_ffn
from zeroxla.models.moe import route

D, E, F, K = 2048, 128, 768, 8


def routings(tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each routing's experts int [tokens, K]."""
    h = jnp.asarray(rng.standard_normal((tokens, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((D, E)) * 0.02, jnp.float32)
    _, experts, _ = route(h, router, K, True)
    return {"random": np.asarray(experts),
            "all tokens to experts 0-7": np.tile(np.arange(K), (tokens, 1)),
            "half the experts empty": np.asarray(experts) % (E // 2) * 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--tiles", default="32,64,128")
    parser.add_argument("--time", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tiles = [int(t) for t in args.tiles.split(",")]
    a = args.tokens * K
    ideal = a * 6 * D * F
    x = jnp.asarray(rng.standard_normal((a, D)) * 0.1, jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)
         for s in ((E, D, F), (E, D, F), (E, F, D))]
    print(f"layer: D {D}, {E} experts of {F}, top-{K}; {args.tokens} tokens = {a} assignments; "
          f"ideal expert FLOPs {ideal / 1e9:.1f} G")

    def ragged(x, experts, *w):
        return expert_ffn(x, experts, *w, implementation="ragged_dot")[0]

    # x holds one row per assignment, each routed alone ([A, 1]): the same rows and tiles as
    # the layer's tokens x top-8 (the tokens' gather into sorted rows is not counted).
    experts0 = jnp.asarray(routings(args.tokens, rng)["random"].reshape(-1, 1), jnp.int32)
    compiled = jax.jit(ragged).lower(x, experts0, *w).compile()
    ragged_flops = float(compiled.cost_analysis()["flops"])
    print(f"ragged_dot (XLA:CPU lowering, cost_analysis): {ragged_flops / 1e9:.1f} G = "
          f"{ragged_flops / ideal:.1f}x ideal")
    result = None
    for name, experts in routings(args.tokens, np.random.default_rng(1)).items():
        flat = jnp.asarray(experts.reshape(-1, 1), jnp.int32)
        for tile in tiles:
            run = jax.jit(lambda x, e, *w, tile=tile: expert_ffn(x, e, *w, tile=tile,
                                                                 implementation="tiled"))
            _, _, used = run(x, flat, *w)
            executed = int(used) * tile * 6 * D * F
            line = (f"{name:<28} tile {tile:>4}: tiles run {int(used):>5}, executed "
                    f"{executed / 1e9:7.1f} G = {executed / ideal:.3f}x ideal")
            if args.time:
                times = []
                jax.block_until_ready(run(x, flat, *w))
                for _ in range(3):
                    start = time.perf_counter()
                    jax.block_until_ready(run(x, flat, *w))
                    times.append(time.perf_counter() - start)
                line += f", forward {statistics.median(times):.2f} s"
            print(line)
            if name == "random" and tile == 64:
                result = executed / ideal
    print(f"tiled / ideal FLOPs (tile 64, random routing): {result:.3f}")


if __name__ == "__main__":
    main()
