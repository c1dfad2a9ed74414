"""Pipeline parallelism (1F1B, ZB-H1, GPipe) against the unpipelined ZeRO-3 step, on 8 simulated
CPU devices.

    python benchmarks/pipeline.py [--model gpt-small] [--steps 3] [--micro-batch 2]
                                  [--runs zero-3,1f1b,zb-h1,gpipe,1f1b-step] [--no-memory]
                                  [--num-layers 4]

One process, one model, AdamW float32, ZeRO-3 (persistence threshold 1000) everywhere:

* `zero-3`: the plain ZeRO-3 step on a 1 x 8 mesh (no pipeline), the batch split in
  `micro_batches` gradient-accumulation steps so every run sees the same micro-batches.
* `1f1b` / `zb-h1` / `gpipe`: the pipelined step on a 4-stage x 1 x 2 mesh, ZeRO-3 over the 2
  data devices of each stage, gathering the stage's layers per micro-batch
  (`zero3_gather="micro_batch"`; ZB-H1's weight-only W gathers nothing: B gathered what
  its weight gradients read, W reduce-scatters them);
  `1f1b-step`: 1F1B gathering them once per step (`zero3_gather="step"`).

Printed: median step time and its ratios to `zero-3` and to `1f1b`; the schedule's bubble
fraction from its table (ZB-H1's is (S - 1) / (3M + S - 1), counting F, B and W one step each;
1F1B's (S - 1) / (M + S - 1)); the collective-permute bytes a data replica's stages send per
step (from `compiled.as_text()` with loop trip counts and how often each step's send branch
runs: each permute op is one stage pair's send) and, beside them, what the table's sends imply (one [mb, T, D] activation per
SendActivation / SendGrad: the two agree); the layer all-gather bytes
per device per step of the stage's blocks, counted from the schedule (micro_batch: a forward
gather and a backward re-gather per micro-batch, with the default `remat="none"`, ZB-H1's
included; step: one); then the compiled temporaries (`memory_analysis()`) of 1F1B,
ZB-H1 and GPipe at micro_batches 4 / 8 / 16 with the micro-batch size fixed. CPU step times say
little about a GPU cluster (collectives are memory copies, all devices share two cores, so an
idle step is free and the lockstep of the stages, which ZB-H1 shortens, costs nothing; what the
CPU measures is the total compute, which ZB-H1's weight-only W keeps at 1F1B's);
bytes and memory are properties of the programs.
"""

from __future__ import annotations

import argparse
import math
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
from zeroxla.analysis.comm_report import report_from_collectives  # noqa: E402
from zeroxla.analysis.hlo import collectives  # noqa: E402

SEQ = {"gpt-tiny": 64, "gpt-small": 128, "llama-tiny": 64, "llama-small": 128}
STAGES = 4
THRESHOLD = 1000


def _batch(model_name: str, batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 65, (batch_size, SEQ[model_name] + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _step(model_name: str, micro_batches: int, schedule: str | None, gather: str = "micro_batch",
          num_layers: int | None = None):
    build = {} if num_layers is None else {"num_layers": num_layers}
    if schedule is None:
        return zeroxla.make_step(
            lambda: models.build(model_name, **build), zeroxla.make_mesh(1, 8),
            optimizer=optax.adamw(1e-3),
            config=zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD,
                                      gradient_accumulation_steps=micro_batches))
    return zeroxla.make_step(
        lambda: models.build(model_name, **build), zeroxla.make_mesh(1, stages=STAGES),
        optimizer=optax.adamw(1e-3),
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD),
        pipeline=zeroxla.PipelineConfig(micro_batches, schedule=schedule, zero3_gather=gather))


def _time(step, batch, steps: int) -> tuple[float, list[float], object]:
    state = step.init()
    compiled = step.compile(state, batch)
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])                  # compile + first step
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    return statistics.median(times), losses, compiled


def _permute_bytes(step, compiled) -> int:
    """Bytes one data replica's stages send per step in collective-permutes (each op: one
    stage pair's send of its operand, as often as the step's send branch holding it runs:
    the loop's trip count times the branch's share, `comm_report`'s `executions`)."""
    report = report_from_collectives(collectives(compiled), step.layout.mesh,
                                     step.pipeline.branch_executions())
    return int(sum(e.collective.operand_bytes * e.executions for e in report.entries
                   if e.collective.kind == "collective-permute"))


def _stage_block_bytes(step) -> int:
    """float32 bytes of the most blocks one stage holds, gathered whole."""
    per_layer = sum(4 * math.prod(leaf.shape[1:]) for leaf in step.layout.plan.leaves
                    if leaf.stacked)
    return per_layer * step.pipeline.split.max_layers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", choices=sorted(SEQ))
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--micro-batch", type=int, default=2,
                        help="examples per micro-batch per data replica")
    parser.add_argument("--micro-batches", type=int, default=8, help="M of the timed runs")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="blocks of the model (default: its preset's; gpt-tiny has 2, "
                        "fewer than the 4 stages)")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated, of: "
                        + ", ".join(RUNS))
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="also compile each schedule at M = 4 / 8 / 16 for its temporaries")
    args = parser.parse_args(argv)
    m, mb = args.micro_batches, args.micro_batch
    data_replicas = jax.device_count() // STAGES
    batch = _batch(args.model, mb * m * data_replicas)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"{args.model} seq {SEQ[args.model]}, global batch {len(batch['inputs'])} = "
          f"{m} micro-batches x {mb} x {data_replicas} replicas, AdamW float32, ZeRO-3, "
          f"median of {args.steps} steps")

    runs = [(label, *RUNS[label]) for label in args.runs.split(",")]
    header = (f"{'run':<14}{'step ms':>9}{'x zero-3':>9}{'x 1f1b':>8}{'bubble':>8}"
              f"{'permute MiB':>12}{'table':>8}{'layer AG MiB':>13}{'loss':>9}")
    print(header)
    print("-" * len(header))
    d_model, seconds_of = models.build(args.model).config.d_model, {}
    for label, schedule, gather in runs:
        # The unpipelined step accumulates over the same micro-batches: 8 replicas, so M / 4.
        step = _step(args.model, m * data_replicas // 8 if schedule is None else m, schedule,
                     gather, args.num_layers)
        seconds, losses, compiled = _time(step, batch, args.steps)
        seconds_of[label] = seconds
        base = seconds_of.get("zero-3")
        ratio = (f"{seconds / seconds_of['1f1b']:>8.2f}" if "1f1b" in seconds_of
                 else f"{'-':>8}")
        if schedule is None:
            extra = f"{'-':>8}{'-':>12}{'-':>8}{'-':>13}"
        else:
            table = step.pipeline.table
            sends = sum(b >= 0 for grid in (table.send_activation, table.send_grad)
                        for row in grid for b in row)             # per data replica
            activation = 4 * mb * SEQ[args.model] * d_model            # [mb, T, D] float32
            needed = sends * activation                               # per data replica
            gathers = 2 * m if gather == "micro_batch" else 1       # forward, backward (B)
            extra = (f"{table.bubble_fraction:>8.3f}{_permute_bytes(step, compiled) / 2**20:>12.2f}"
                     f"{needed / 2**20:>8.2f}{gathers * _stage_block_bytes(step) / 2**20:>13.2f}")
        versus = f"{seconds / base:>9.2f}" if base else f"{'-':>9}"
        print(f"{label:<14}{1e3 * seconds:>9.1f}{versus}{ratio}{extra}"
              f"{losses[-1]:>9.4f}", flush=True)
    if args.memory:
        _temporaries(args.model, mb, data_replicas, args.num_layers)


RUNS = {"zero-3": (None, "micro_batch"), "1f1b": ("1f1b", "micro_batch"),
        "zb-h1": ("zb-h1", "micro_batch"), "gpipe": ("gpipe", "micro_batch"),
        "1f1b-step": ("1f1b", "step")}


def _temporaries(model: str, mb: int, data_replicas: int, num_layers: int | None) -> None:
    """Compiled temporaries of each schedule at M = 4 / 8 / 16, the micro-batch size fixed."""
    print(f"\ncompiled temporaries, MiB (micro-batch {mb} fixed, {STAGES} stages, ZeRO-3):")
    temps = {}
    for schedule in ("1f1b", "zb-h1", "gpipe"):
        for micro_batches in (4, 8, 16):
            step = _step(model, micro_batches, schedule, num_layers=num_layers)
            b = _batch(model, mb * micro_batches * data_replicas)
            b = {k: jax.numpy.asarray(v) for k, v in b.items()}
            compiled = step.compile(jax.eval_shape(step.init), b)
            temps[schedule, micro_batches] = compiled.memory_analysis().temp_size_in_bytes
        print(f"  {schedule:<6}" + "".join(f"  M={n}: {temps[schedule, n] / 2**20:8.2f}"
                                           for n in (4, 8, 16)), flush=True)
    growth = {s: temps[s, 16] - temps[s, 4] for s in ("1f1b", "zb-h1", "gpipe")}
    print(f"  growth 4 -> 16: 1f1b {growth['1f1b'] / 2**20:.2f} MiB, zb-h1 "
          f"{growth['zb-h1'] / 2**20:.2f} MiB, gpipe {growth['gpipe'] / 2**20:.2f} MiB; "
          f"1f1b / gpipe at M=8: {temps['1f1b', 8] / temps['gpipe', 8]:.3f}, zb-h1 / 1f1b at "
          f"M=16: {temps['zb-h1', 16] / temps['1f1b', 16]:.3f}")


if __name__ == "__main__":
    main()
