"""The batch-invariant mode's cost (`LlamaConfig.batch_invariant`, `models.invariant`): a tiny
Llama's ZeRO-3 training step and its static-batching decode at tp 1, in the default mode and in
the mode, in one run, and the ratios.

    python benchmarks/batch_invariant.py [--rounds 7] [--batch 16] [--seq 64] [--answers 32]

The model: `LlamaConfig.tiny()` (d_model 60, 6 heads, 2 KV heads, 2 layers, MLP 164, vocabulary
65), the same weights in both modes. Step: ZeRO-3 over a 2 x 4 mesh of 8 CPU devices, AdamW,
`--batch` rows of `--seq` tokens. Decode: the Hybrid Engine over the step's layout
(`batching="static"`, inference_tp_size 1), `--answers` prompts of 8 tokens, 32 new tokens each,
temperature 1, a fixed seed. Each figure is the median over `--rounds` rounds after a warm-up
(compile) call; in each round every run goes once, the order rotated, so a change in the
machine's load falls on both modes alike. The last line is
`batch-invariant / default: step R1x, decode R2x`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.inference import HybridEngine, HybridEngineConfig  # noqa: E402

PROMPT, NEW = 8, 32


def runs(invariant: bool, mesh, batch, prompts) -> dict:
    """{"step": one ZeRO-3 step, "decode": one static decode of `prompts`} of the mode."""
    config = models.LlamaConfig.tiny().replace(batch_invariant=invariant)
    step = zeroxla.make_step(lambda: models.Llama(config, rngs=nnx.Rngs(0)), mesh,
                             optimizer=optax.adamw(1e-3), config=zeroxla.ZeroConfig(stage=3))
    holder = {"state": step.init(0)}
    engine = HybridEngine(step.layout, HybridEngineConfig(
        batching="static", inference_tp_size=1, max_out_tokens=PROMPT + NEW))

    def train():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    def decode():
        return engine.generate(holder["state"], prompts, max_new_tokens=NEW, temperature=1.0,
                               seed=7)
    return {"step": train, "decode": decode}


def interleaved(named: dict, rounds: int) -> dict[str, float]:
    """{label: median seconds}: each run once untimed (compile), then `rounds` rounds of each
    run once, the order rotated every round."""
    for run in named.values():
        jax.block_until_ready(run())
    labels, times = list(named), {label: [] for label in named}
    for k in range(rounds):
        for label in labels[k % len(labels):] + labels[:k % len(labels)]:
            start = time.perf_counter()
            jax.block_until_ready(named[label]())
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--answers", type=int, default=32)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 65, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    prompts = [rng.integers(0, 65, PROMPT).astype(np.int32) for _ in range(args.answers)]
    mesh = zeroxla.make_mesh(2, 4)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"llama tiny; step: ZeRO-3 mesh 2x4, AdamW, {args.batch} x {args.seq} tokens; "
          f"decode: static, tp 1, {args.answers} prompts x {NEW} new tokens; median of "
          f"{args.rounds} interleaved rounds")
    named = {}
    for mode, invariant in (("default", False), ("batch-invariant", True)):
        for kind, run in runs(invariant, mesh, batch, prompts).items():
            named[(mode, kind)] = run
    medians = interleaved(named, args.rounds)
    new_tokens = args.answers * NEW
    print(f"{'mode':<17}{'step ms':>10}{'decode ms':>11}{'decode tokens/s':>17}")
    for mode in ("default", "batch-invariant"):
        step_s, decode_s = medians[(mode, "step")], medians[(mode, "decode")]
        print(f"{mode:<17}{step_s * 1e3:>10.1f}{decode_s * 1e3:>11.1f}"
              f"{new_tokens / decode_s:>17.0f}")
    ratio = {kind: medians[("batch-invariant", kind)] / medians[("default", kind)]
             for kind in ("step", "decode")}
    print(f"batch-invariant / default: step {ratio['step']:.2f}x, decode "
          f"{ratio['decode']:.2f}x")


if __name__ == "__main__":
    main()
