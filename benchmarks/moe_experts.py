"""Dropless expert compute on a Qwen3-30B-A3B-shaped MoE layer: executed expert FLOPs of the
tiled grouped matmul (`models.grouped_matmul`) against the ideal and against `ragged_dot`'s
CPU lowering, measured in the same run.

    python benchmarks/moe_experts.py [--tokens 4096] [--tiles 32,64,128] [--time]
                                     [--expert-parallel 8]

The layer: d_model 2048, 128 experts of inner size 768, top-8 (Qwen3-30B-A3B's config.json),
float32, one device. Tokens are routed by a random router over random hidden states, plus two
adversarial routings (every token's k experts the same 8; half the experts never chosen).

* ideal: tokens x top-k x 6 x D x F (gate, up and down projections of each assignment);
* tiled: the program's own `tiles_used` (each expert's assignments padded to whole tiles,
  only tiles holding one run) x tile x 6 x D x F, per tile size;
* ragged_dot: `jax.lax.ragged_dot`'s three products as XLA:CPU compiles them, FLOPs from the
  compiled program's `cost_analysis()` (compiled, never run: it expands to a dense product
  over every expert).

`--time` also runs the tiled forward (median of 3 after a warm-up). `--expert-parallel EP`:
the same count under expert parallelism (`models.expert_parallel`), EP devices of `--tokens`
tokens each, routed alike: device d runs experts [d E / EP, (d + 1) E / EP) on each source
device's tokens in turn (one tile plan per chunk, other devices' assignments skipped), summed
over the devices and against the busiest one's fair share (ideal / EP). The last line is
`tiled / ideal FLOPs (tile 64, random routing): R`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.models.grouped_matmul import expert_ffn, plan_tiles
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


def expert_parallel_tiles(experts: np.ndarray, ep: int, tile: int) -> np.ndarray:
    """Tiles run by each of `ep` devices ([ep]) on `experts` int [ep x tokens, K] (source device
    c's tokens are rows [c tokens, (c + 1) tokens)), as `expert_parallel_ffn` plans them."""
    local = E // ep
    chunks = jnp.asarray(experts.reshape(ep, -1), jnp.int32)           # [EP sources, tokens K]

    @jax.jit
    def used(chunk, first):
        ids = jnp.where((chunk >= first) & (chunk < first + local), chunk - first, local)
        return plan_tiles(ids, local + 1, tile, skip_last=True).tiles_used

    return np.asarray([sum(int(used(chunks[c], d * local)) for c in range(ep))
                       for d in range(ep)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--tiles", default="32,64,128")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--expert-parallel", type=int, default=0, metavar="EP")
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
    ep = args.expert_parallel
    for name, experts in (routings(args.tokens * ep, np.random.default_rng(2)).items()
                          if ep else ()):
        for tile in tiles:
            per_device = expert_parallel_tiles(experts, ep, tile) * tile * 6 * D * F
            print(f"EP {ep} {name:<25} tile {tile:>4}: executed {per_device.sum() / 1e9:7.1f} "
                  f"G = {per_device.sum() / (ep * ideal):.3f}x ideal over the {ep} devices, "
                  f"busiest {per_device.max() / ideal:.3f}x its fair share")
    print(f"tiled / ideal FLOPs (tile 64, random routing): {result:.3f}")


if __name__ == "__main__":
    main()
