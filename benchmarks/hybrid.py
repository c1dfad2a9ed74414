"""The Hybrid Engine against ZeRO-3 re-gather generation and a single-device decode, and its
reshard against the byte floor, on 8 simulated CPU devices.

    python benchmarks/hybrid.py [--model gpt-small] [--prompts 16] [--new-tokens 32]
                                [--tp 1 2 4 8] [--persistence-threshold 0]

One process, one ZeRO-3 training step (2 nodes x 4 local, persistence threshold 0 unless given,
two optimizer steps taken), then greedy generation of the same prompts by:

* `zero3-regather`: `Zero3Generator`, parameters left partitioned, every layer re-gathered at
  every decoded token (DeepSpeed without the Hybrid Engine), same KV cache and decode loop;
* `single-device`: `SingleDeviceGenerator`, the gathered float32 model on one device, same
  decode loop and KV cache, no collectives (the limit on this machine);
* `hybrid tp=T`: `HybridEngine` with `inference_tp_size=T`: one reshard, then
  tensor-parallel decoding, 8/T prompt shards data-parallel, through the static decode loop
  (`batching="static"`) the baselines run too (continuous batching: `rollout.py`).

Columns: tokens/s (median of 3 timed runs after a warm-up, reshard excluded; pinned params),
the speed-up over the re-gather baseline and the ratio to the single-device decode, bytes each
device sends per generated token (from the compiled one-token decode step, `comm_report`'s
convention), reshard bytes per device (the compiled reshard program) and its time, and the
bytes resident per device during generation (training state + inference copy + KV cache).
The outputs of all rows are checked equal to the baseline's.

The second table is the reshard against its floor W/T (1 - T/N) (W the model's bytes, N = 8):
measured (compiled program), the floor, their ratio, and the bytes over the floor by reason
(`zeroxla.inference.reshard.reshard_account`: leaves tensor parallelism replicates, tensor
dims N does not divide, padded tensor dims, replicated KV heads). CPU times say little about a
GPU; bytes and memory are properties of the programs.
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
from zeroxla.inference.baseline import SingleDeviceGenerator, Zero3Generator  # noqa: E402
from zeroxla.inference.reshard import reshard_account  # noqa: E402


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


def hybrid_row(step, state, prompts, tp, max_out, new_tokens, base_out):
    """(table row, floor row) of `HybridEngine` at `inference_tp_size=tp`."""
    engine = HybridEngine(step.layout,
                          HybridEngineConfig(inference_tp_size=tp, max_out_tokens=max_out,
                                             batching="static"))
    reshard = engine.reshard_program(state)
    jax.block_until_ready(reshard(engine.reshard_inputs(state)))  # compile outside the time
    engine.generate(state, prompts, 1)                            # reshard + pin
    engine.release()
    start = time.perf_counter()
    jax.block_until_ready(engine.inference_params(state))
    reshard_time = time.perf_counter() - start
    gen_time, out = timed(lambda: engine.generate(state, prompts, new_tokens))
    for a, b in zip(out, base_out):
        np.testing.assert_array_equal(a, b)
    resident = per_device_bytes((state, *engine.kept_arrays()))
    comm = comm_report(engine.token_program(state, len(prompts)), mesh=engine.mesh)
    reshard_bytes = comm_report(reshard, mesh=engine.mesh).total_bytes
    account = reshard_account(step.layout.plan, engine.layout)
    over: dict[str, list[float]] = {}
    for leaf in account:
        if leaf.reason:       # a leaf above its floor: why, and by how much
            over.setdefault(leaf.reason, []).append((leaf.received or 0.0) - leaf.floor)
    engine.release()
    return ((f"hybrid tp={tp}", gen_time, comm.total_bytes, reshard_bytes, reshard_time,
             resident), (tp, reshard_bytes, sum(leaf.floor for leaf in account), over))


def print_tables(header, rows, floors, tokens, base_time, single_time):
    print(header)
    print(f"| {'generator':<15}| tokens/s | vs re-gather | vs 1 device | bytes/token/device "
          "| reshard bytes/device | reshard s | resident MiB/device |")
    print("|---|---|---|---|---|---|---|---|")
    for name, seconds, per_token, rb, rt, resident in rows:
        print(f"| {name:<15}| {tokens / seconds:8.1f} | {base_time / seconds:11.2f}x | "
              f"{single_time / seconds:10.2f}x | {per_token / 1024:15.1f} KiB | "
              f"{rb / 2**20:16.3f} MiB | {rt:9.3f} | {resident / 2**20:19.2f} |")
    print("\nreshard bytes received per device vs the floor W/T (1 - T/N), N = 8")
    print("| T | measured KiB | floor KiB | measured / floor | over the floor (leaves, KiB) |")
    print("|---|---|---|---|---|")
    for tp, measured, floor, over in floors:
        ratio = f"{measured / floor:.3f}" if floor else ("0 = floor" if not measured else "inf")
        why = "; ".join(f"{reason} ({len(v)}, {sum(v) / 1024:.1f})"
                        for reason, v in over.items()) or "-"
        print(f"| {tp} | {measured / 1024:.1f} | {floor / 1024:.1f} | {ratio} | {why} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--persistence-threshold", type=int, default=0)
    args = parser.parse_args()
    max_out = args.prompt_len + args.new_tokens

    step = zeroxla.make_step(models.build(args.model), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(
                                 stage=3, persistence_threshold=args.persistence_threshold))
    state = step.init()
    rng = np.random.default_rng(0)
    for _ in range(2):
        t = rng.integers(0, 65, (8, 65)).astype(np.int32)
        state, _ = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
    prompts = [rng.integers(0, 65, rng.integers(1, args.prompt_len + 1)).astype(np.int32)
               for _ in range(args.prompts)]
    tokens = args.prompts * args.new_tokens
    train_bytes = per_device_bytes(state)

    baseline = Zero3Generator(step.layout, max_out)
    base_time, base_out = timed(lambda: baseline.generate(state, prompts, args.new_tokens))
    base_comm = comm_report(baseline.token_program(state, len(prompts)), mesh=step.layout.mesh)
    single = SingleDeviceGenerator(step.layout, max_out)
    single_time, single_out = timed(lambda: single.generate(state, prompts, args.new_tokens))
    for a, b in zip(single_out, base_out):
        np.testing.assert_array_equal(a, b)
    rows = [("zero3-regather", base_time, base_comm.total_bytes, 0.0, 0.0, train_bytes),
            ("single-device", single_time, 0.0, 0.0, 0.0,
             per_device_bytes((state, single.params(state))))]
    floors = []
    for tp in args.tp:
        row, floor = hybrid_row(step, state, prompts, tp, max_out, args.new_tokens, base_out)
        rows.append(row)
        floors.append(floor)
    print_tables(f"{args.model}, 8 CPU devices (2 x 4), persistence threshold "
                 f"{args.persistence_threshold}, {args.prompts} prompts of 1..{args.prompt_len} "
                 f"tokens, {args.new_tokens} new tokens each, greedy; training state "
                 f"{train_bytes / 2**20:.2f} MiB/device", rows, floors, tokens, base_time,
                 single_time)


if __name__ == "__main__":
    main()
