"""ZeRO-Offload (optimizer) and ZeRO-Infinity's parameter offload: device and host bytes with and
without them, on 8 simulated CPU devices (2 nodes x 4 local), AdamW, persistence threshold 1000.

    python benchmarks/offload.py [--model gpt-small] [--steps 3] [--batch-size 16] [--stages 1,2,3]

For each stage (1-3), compute dtype (float32, bfloat16) and what is offloaded ("none"; "opt":
`offload_optimizer="cpu"` with pinned host memory; at stage 3 also "param": `offload_param="cpu"`,
and "opt+param"): the per-device state in device memory and in host memory
(`zeroxla.memory_report`: the state's shards by memory kind), the compiled step's per-device
arguments by memory kind (`zeroxla.analysis.memory.argument_bytes_by_memory_kind`, read from the
compiled program's input shardings; XLA:CPU's `memory_analysis()` counts host-kind arguments as
device bytes, so it is not used for the split), XLA's temporaries, and the median step time. On
the CPU backend "device" and "host" memory are the same RAM, so the step time says nothing about
PCIe transfers; the bytes are properties of the programs. First, before anything is compiled,
`estimate_memory` for Llama-2-70B on one node of 8 beside DeepSpeed's own estimators.
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
from zeroxla.analysis.memory import argument_bytes_by_memory_kind  # noqa: E402
from deepspeed_estimators import (  # noqa: E402  (benchmarks/, beside this file)
    GPUS, LARGEST_LAYER_PARAMS, LLAMA2_70B, TOTAL_PARAMS, deepspeed_zero2_mem_needs,
    deepspeed_zero3_mem_needs)

MIB = 2 ** 20


OFFLOADS = {"none": {}, "opt": {"offload_optimizer": "cpu", "offload_pin_memory": True},
            "param": {"offload_param": "cpu"},
            "opt+param": {"offload_optimizer": "cpu", "offload_param": "cpu",
                          "offload_pin_memory": True}}


def measure(model_name: str, stage: int, dtype: str, offload: str, batch: dict,
            steps: int) -> dict:
    """One configuration's bytes (MiB per device) and median step time (s)."""
    config = zeroxla.ZeroConfig(stage=stage, compute_dtype=dtype, persistence_threshold=1000,
                                **OFFLOADS[offload])
    step = zeroxla.make_step(models.build(model_name), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3), config=config)
    state = step.init()
    report = zeroxla.memory_report(step.compile(state, batch), state, layout=step.layout)
    split = argument_bytes_by_memory_kind(step.compile(state, batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return {"device_state": report.training_state / MIB, "host_state": report.host_state / MIB,
            "device_args": split.get("device", 0) / MIB,
            "host_args": sum(v for k, v in split.items() if k != "device") / MIB,
            "temporaries": report.temporaries / MIB,
            "step_s": statistics.median(times[1:] or times)}


def llama2_70b_table() -> list[str]:
    """`estimate_memory` for Llama-2-70B on 1 node x 8 (bf16, AdamW), GB, against DeepSpeed's
    estimators for the same settings (`deepspeed_estimators`; per device on the accelerator,
    per node on the host; DeepSpeed's host figure less its 1.5 buffer factor)."""
    mesh = zeroxla.make_mesh(1, GPUS)
    rows = [f"Llama-2-70B, 1 x {GPUS}, bf16, AdamW: GB (device: per device; host: per node)",
            f"{'stage':>5} {'offload':>9} {'zeroxla dev':>11} {'DeepSpeed dev':>13} "
            f"{'zeroxla host':>12} {'DeepSpeed host':>14}"]
    for stage, offload in ((2, "opt"), (3, "opt"), (3, "opt+param")):
        config = zeroxla.ZeroConfig(stage=stage, compute_dtype="bfloat16", **OFFLOADS[offload])
        estimate = zeroxla.estimate_memory(LLAMA2_70B, mesh, config)
        if stage == 2:
            cpu, gpu = deepspeed_zero2_mem_needs(TOTAL_PARAMS, GPUS, 1, cpu_offload=True)
        else:
            cpu, gpu, _ = deepspeed_zero3_mem_needs(
                TOTAL_PARAMS, LARGEST_LAYER_PARAMS, GPUS, 1, cpu_offload=True,
                cpu_offload_params=offload == "opt+param")
        rows.append(f"{stage:>5} {offload:>9} {estimate.training_state / 1e9:>11.2f} "
                    f"{gpu / 1e9:>13.2f} {GPUS * estimate.host_state / 1e9:>12.1f} "
                    f"{cpu / 1.5 / 1e9:>14.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages")
    args = parser.parse_args()
    print("\n".join(llama2_70b_table()) + "\n")
    vocab = models.PRESETS[args.model][1]().vocab_size
    inputs = np.random.default_rng(0).integers(0, vocab, (args.batch_size, 64)).astype(np.int32)
    batch = {"inputs": inputs, "targets": (inputs + 1) % vocab}
    print(f"{args.model}, AdamW, 2 x 4 CPU devices, batch {inputs.shape}; MiB per device")
    print(f"{'stage':>5} {'dtype':>9} {'offload':>9} {'dev state':>10} {'host state':>10} "
          f"{'dev args':>9} {'host args':>9} {'temps':>8} {'step s':>7}")
    for stage in (int(s) for s in args.stages.split(",")):
        for dtype in ("float32", "bfloat16"):
            for offload in (OFFLOADS if stage == 3 else ("none", "opt")):
                r = measure(args.model, stage, dtype, offload, batch, args.steps)
                print(f"{stage:>5} {dtype:>9} {offload:>9} {r['device_state']:>10.2f} "
                      f"{r['host_state']:>10.2f} {r['device_args']:>9.2f} "
                      f"{r['host_args']:>9.2f} {r['temporaries']:>8.2f} {r['step_s']:>7.3f}")


if __name__ == "__main__":
    main()
