"""The Hybrid Engine against ZeRO-3 re-gather generation, on 8 simulated CPU devices.

    python benchmarks/hybrid.py [--model gpt-small] [--prompts 16] [--new-tokens 32]

One process, one ZeRO-3 training step (2 nodes x 4 local, persistence threshold 0, two
optimizer steps taken), then greedy generation of the same prompts by:

* `zero3-regather`: `Zero3Generator`, parameters left partitioned, every layer re-gathered at
  every decoded token (DeepSpeed without the Hybrid Engine), same KV cache and decode loop;
* `hybrid tp=T`: `HybridEngine` with `inference_tp_size=T` (T = 1, 2, 4): one reshard, then
  tensor-parallel decoding, 8/T prompt shards data-parallel.

Columns: tokens/s (median of 3 timed runs after a warm-up, reshard excluded; pinned params),
the speed-up over the baseline of the same run, bytes each device sends per generated token
(from the compiled one-token decode step, `comm_report`'s convention), reshard bytes per device
(the compiled reshard program) and its time, and the bytes resident per device during
generation (training state + inference copy + KV cache) with XLA's temporaries of the decode
step. The outputs of all rows are checked equal to the baseline's. CPU times say little about
a GPU; bytes and memory are properties of the programs.
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

import zeroxla  # noqa: E402
from zeroxla import models  # noqa: E402
from zeroxla.analysis.comm_report import comm_report  # noqa: E402
from zeroxla.inference import HybridEngine, HybridEngineConfig  # noqa: E402
from zeroxla.inference.baseline import Zero3Generator  # noqa: E402


def per_device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays held by device 0."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def timed(generate, runs=3):
    generate()                                                    # compile
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = generate()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    max_out = args.prompt_len + args.new_tokens

    step = zeroxla.make_step(models.build(args.model), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state = step.init()
    rng = np.random.default_rng(0)
    for _ in range(2):
        t = rng.integers(0, 65, (8, 65)).astype(np.int32)
        state, _ = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
    prompts = [rng.integers(0, 65, rng.integers(1, args.prompt_len + 1)).astype(np.int32)
               for _ in range(args.prompts)]
    tokens = args.prompts * args.new_tokens
    train_bytes = per_device_bytes(state)

    baseline = Zero3Generator(step, max_out)
    base_time, base_out = timed(lambda: baseline.generate(state, prompts, args.new_tokens))
    base_comm = comm_report(baseline.token_program(state, len(prompts)), mesh=step.mesh)
    rows = [("zero3-regather", tokens / base_time, 1.0, base_comm.total_bytes, 0.0, 0.0,
             train_bytes)]
    for tp in args.tp:
        engine = HybridEngine(step, HybridEngineConfig(inference_tp_size=tp,
                                                       max_out_tokens=max_out))
        start = time.perf_counter()
        reshard = engine.reshard_program(state)
        params = reshard(state.params)
        jax.block_until_ready(params)
        del params
        engine.generate(state, prompts, 1)                        # reshard + pin
        start = time.perf_counter()
        engine.release()
        engine.inference_params(state)
        jax.block_until_ready(engine._params)
        reshard_time = time.perf_counter() - start
        gen_time, out = timed(lambda: engine.generate(state, prompts, args.new_tokens))
        for a, b in zip(out, base_out):
            np.testing.assert_array_equal(a, b)
        resident = per_device_bytes((state, engine._params, list(engine._caches.values())))
        comm = comm_report(engine.token_program(state, len(prompts)), mesh=engine.mesh)
        reshard_bytes = comm_report(reshard, mesh=engine.mesh).total_bytes
        rows.append((f"hybrid tp={tp}", tokens / gen_time, base_time / gen_time,
                     comm.total_bytes, reshard_bytes, reshard_time, resident))
        engine.release()

    print(f"{args.model}, 8 CPU devices (2 x 4), {args.prompts} prompts of 1..{args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens each, greedy; training state "
          f"{train_bytes / 2**20:.2f} MiB/device")
    print(f"| {'generator':<15}| tokens/s | vs baseline | bytes/token/device | reshard "
          "bytes/device | reshard s | resident MiB/device |")
    print("|---|---|---|---|---|---|---|")
    for name, rate, ratio, per_token, rb, rt, resident in rows:
        print(f"| {name:<15}| {rate:8.1f} | {ratio:10.1f}x | {per_token / 1024:15.1f} KiB | "
              f"{rb / 2**20:16.2f} MiB | {rt:9.3f} | {resident / 2**20:19.2f} |")


if __name__ == "__main__":
    main()
