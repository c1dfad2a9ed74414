"""Hybrid Engine generation on one device against the plain single-device decode.

    python benchmarks/gpu/generation.py [--prompts 32] [--prompt-len 16] [--new-tokens 32] [--tiny]

The initial state of a ZeRO-3 step of GPT-2 124M (`models.GPTConfig.gpt2_124m`; `--tiny`:
gpt-tiny) on a 1 x 1 mesh, float32 (no training step: the decode's speed does not depend on the
weights, and the step's compile would cost more device time than the whole measurement); then
greedy generation of the same prompts (lengths 1..--prompt-len, random tokens, seed 0) by

* `single-device`: `SingleDeviceGenerator`: the gathered float32 model, the decode loop and KV
  cache the engine uses, no collectives (benchmarks/hybrid.py's baseline);
* `hybrid tp=1`: `HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=1))`: the
  reshard once (excluded from the time, reported apart), then its decode program.

tokens/s = prompts x new tokens / median seconds of 3 timed generations after one warm-up
(compile). The engine's tokens are checked equal to the single-device ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import common
import zeroxla
from zeroxla import models
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.inference.baseline import SingleDeviceGenerator

SECTION = "generation"


def timed(generate, runs: int = 3):
    """(median seconds, outputs) of `generate()` after one untimed call (its compile)."""
    generate()
    times, out = [], None
    for _ in range(runs):
        start = time.perf_counter()
        out = generate()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help=common.TINY_HELP)
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.new_tokens = 4, 8
    config = models.GPTConfig.tiny() if args.tiny else models.GPTConfig.gpt2_124m()
    max_out = args.prompt_len + args.new_tokens
    step = zeroxla.make_step(models.GPT(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(1, 1), optimizer=optax.adamw(1e-4),
                             config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, rng.integers(1, args.prompt_len + 1))
               .astype(np.int32) for _ in range(args.prompts)]
    tokens = args.prompts * args.new_tokens
    shape = dict(model="gpt-tiny" if args.tiny else "gpt2-124m", prompts=args.prompts,
                 prompt_len_max=args.prompt_len, new_tokens=args.new_tokens)

    single = SingleDeviceGenerator(step.layout, max_out)
    single_s, single_out = timed(lambda: single.generate(state, prompts, args.new_tokens))
    common.record(SECTION, generator="single-device", seconds=single_s,
                  tokens_per_s=round(tokens / single_s, 1), **shape)

    def hybrid():
        engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=1,
                                                              max_out_tokens=max_out,
                                                              batching="static"))
        engine.generate(state, prompts, 1)                        # reshard, pin, compile
        engine.release()
        start = time.perf_counter()
        jax.block_until_ready(engine.inference_params(state))
        reshard_s = time.perf_counter() - start
        seconds, out = timed(lambda: engine.generate(state, prompts, args.new_tokens))
        same = all(np.array_equal(a, b) for a, b in zip(out, single_out))
        engine.release()
        common.record(SECTION, generator="hybrid tp=1", seconds=seconds,
                      tokens_per_s=round(tokens / seconds, 1), reshard_s=reshard_s,
                      vs_single_device=round(single_s / seconds, 3),
                      tokens_equal_single_device=same, **shape)
    common.guarded(SECTION, "hybrid tp=1", hybrid)


if __name__ == "__main__":
    main()
