"""LoRA in the Hybrid Engine: what the switch (the reshard) moves, and what applying the adapters
in the decode program costs against decoding the fused model, on 8 simulated CPU devices.

    python benchmarks/lora.py [--model llama-small] [--lora-dim 8] [--tp 2] [--new-tokens 32]

One ZeRO-3 step (2 nodes x 4 local, persistence threshold 0) of the model with adapters on every
block projection (`only_optimize_lora`), two optimizer steps, then:

* switch bytes per device: the compiled full reshard program's (`comm_report`), the share of
  the adapters and of the frozen base in it (`reshard_account`, per leaf), and the compiled
  adapter-only switch's (`HybridEngine.trainable_reshard_program`, run when the frozen base is
  bitwise unchanged since the last switch) against the adapters' float32 bytes;
* decode: tokens/s (median of 3 runs after a warm-up, pinned parameters) of the LoRA model
  (adapters applied in the decode program: W + (alpha / r) A @ B formed per layer per step)
  and of the fused model (`fuse_lora_weight`, plain weights) under its own ZeRO-3 step; both
  outputs are checked equal. CPU times say little about a GPU; bytes are properties of the
  programs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.analysis.comm_report import comm_report  # noqa: E402
from zeroxla.inference import HybridEngine, HybridEngineConfig  # noqa: E402
from zeroxla.inference.reshard import reshard_account  # noqa: E402
from zeroxla.lora import (LoRAConfig, convert_linear_layer_to_lora, fuse_lora_weight,  # noqa: E402
                          lora_trainable)


def tokens_per_second(engine, state, prompts, new_tokens):
    engine.generate(state, prompts, max_new_tokens=new_tokens)        # compile, reshard
    times = []
    for _ in range(3):
        start = time.perf_counter()
        outs = engine.generate(state, prompts, max_new_tokens=new_tokens)
        times.append(time.perf_counter() - start)
    return len(prompts) * new_tokens / statistics.median(times), outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--lora-dim", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    lora = LoRAConfig(dim=args.lora_dim, alpha=2.0 * args.lora_dim, only_optimize_lora=True)
    model = models.build(args.model, seed=0)
    convert_linear_layer_to_lora(model, lora, rngs=nnx.Rngs(1))
    mesh, config = zeroxla.make_mesh(2, 4), zeroxla.ZeroConfig(stage=3, persistence_threshold=0)
    step = zeroxla.make_step(model, mesh, optimizer=optax.adam(1e-2), config=config,
                             trainable=lora_trainable(lora))
    vocab = step.layout.vocab_size
    rng = np.random.default_rng(0)
    state = step.init()
    for _ in range(2):
        tokens = rng.integers(0, vocab, (8, 33)).astype(np.int32)
        state, _ = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=args.tp,
                                                          max_out_tokens=128,
                                                          batching="static"))
    program = engine.reshard_program(state)
    moved = comm_report(program, mesh=engine.mesh).traffic()
    account = reshard_account(step.layout.plan, engine.layout)
    adapters = sum(t.received or 0 for t in account if "/lora_" in t.path)
    base = sum(t.received or 0 for t in account if "/lora_" not in t.path)
    print(f"switch (reshard) bytes per device, compiled program: {moved.max_total / 2**20:.3f} MiB"
          f"\n  by leaf (reshard_account): adapters {adapters / 2**20:.3f} MiB, "
          f"base {base / 2**20:.3f} MiB")
    prompts = [rng.integers(0, vocab, 8).astype(np.int32) for _ in range(args.prompts)]
    lora_tps, lora_outs = tokens_per_second(engine, state, prompts, args.new_tokens)
    inputs = engine.reshard_inputs(state)
    trainable = {leaf.path: inputs[leaf.path] for leaf in step.layout.plan.trainable_leaves}
    switch = comm_report(engine.trainable_reshard_program().lower(trainable).compile(),
                         mesh=engine.mesh).traffic()
    bound = sum(4 * leaf.numel for leaf in step.layout.plan.trainable_leaves)
    print(f"adapter-only switch (base unchanged), compiled program: "
          f"{switch.max_total / 2**20:.3f} MiB per device; the adapters' float32 bytes "
          f"{bound / 2**20:.3f} MiB")
    engine.release()
    fused = fuse_lora_weight(zeroxla.gathered_model(state))
    fused_step = zeroxla.make_step(fused, mesh, optimizer=optax.adam(1e-2), config=config)
    fused_engine = HybridEngine(fused_step.layout, HybridEngineConfig(
        inference_tp_size=args.tp, max_out_tokens=128, batching="static"))
    fused_tps, fused_outs = tokens_per_second(fused_engine, fused_step.init(), prompts,
                                              args.new_tokens)
    same = all(np.array_equal(a, b) for a, b in zip(lora_outs, fused_outs))
    print(f"decode tp={args.tp}: adapters in the program {lora_tps:.1f} tokens/s, fused weights "
          f"{fused_tps:.1f} tokens/s (ratio {lora_tps / fused_tps:.2f}); same tokens: {same}")


if __name__ == "__main__":
    main()
