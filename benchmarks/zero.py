"""ZeRO stages 0-3 against the two baselines a JAX user would run, on 8 simulated CPU devices.

    python benchmarks/zero.py [--models gpt-small] [--steps 21] [--batch-size 32]

Runs, all on one 2-node x 4-local mesh, the same model, batch and AdamW, measured in one process:

* `dp`: plain data parallelism. `jax.jit` with every parameter and optimizer leaf replicated and
  the batch split over the data axes; XLA inserts the gradient all-reduce.
* `fsdp`: GSPMD FSDP the way MaxText runs it. Logical-axis rules put `embed` (and the batch) on
  the data axes and leave every other logical axis whole, parameters and optimizer state get
  those NamedShardings, the activations are constrained to the batch sharding at every layer
  boundary (MaxText's `activation_batch` constraints), and XLA inserts the collectives. A leaf
  with no `embed` dim (biases, norms) or one the data size does not divide stays replicated.
  Both are built by `fsdp_baseline.py` (beside this file), which the test pinning ZeRO-3's peak
  against FSDP's shares (`tests/zeroxla/analysis/test_peak_vs_fsdp.py`).
* `zero-0` ... `zero-3`: zeroxla's step (`make_step`), persistence threshold 1000.
* `zero-3j`: ZeRO-3 gathering each layer just in time (`prefetch=False`, DeepSpeed's
  `stage3_prefetch_bucket_size: 0`). A prefetched gather overlaps compute where collectives run
  asynchronously (GPU, TPU); XLA:CPU's are synchronous copies, so here prefetching only costs
  the loop a copy of the carried layer (docs/benchmarks.md compares the two), and GSPMD FSDP,
  the baseline, does not prefetch on CPU either.

For each: the median step time (the runs' steps interleaved, one of each per round, the order
rotated every round) and its ratio to a baseline's as the median of the rounds' paired ratios, the
per-device training state, XLA's peak for the compiled step
(`compiled.memory_analysis()`: arguments + temporaries + outputs - donated), and the bytes each
device sends per step, read from the compiled program (`compiled.as_text()` parsed by
`zeroxla.analysis`; `comm_report`'s convention: a collective over g devices with payload S sends
S (g-1)/g per device, an all-reduce twice that). Ratios are against `dp` and `fsdp` of the same
run. `AG/RS/AR/A2A` is the payload of all-gathers / reduce-scatters / all-reduces / all-to-alls
per float32 parameter byte. CPU step times say little about a GPU cluster (collectives are
memory copies and the two cores are shared); memory and bytes are properties of the programs.
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
from flax import nnx  # noqa: E402

import zeroxla  # noqa: E402
from fsdp_baseline import jit_train_step, peak_bytes  # noqa: E402  (beside this file)
from zeroxla import models  # noqa: E402
from zeroxla.analysis.comm_report import comm_report  # noqa: E402

SEQ = {"gpt-tiny": 64, "gpt-small": 128, "llama-tiny": 64, "llama-small": 128}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def _batch(model_name: str, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 65, (batch_size, SEQ[model_name] + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _time_interleaved(runs: dict, rounds: int) -> dict[str, list[float]]:
    """{label: seconds of each of its timed steps, one per round}: each run's first step
    (compile) untimed, then `rounds` rounds, each timing one step of every run, the order
    rotated from round to round, so that a change in the load on the shared cores falls on
    all runs alike, and no run always follows the same other run."""
    for run in runs.values():
        jax.block_until_ready(run())
    labels = list(runs)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for k in range(rounds):
        for label in labels[k % len(labels):] + labels[:k % len(labels)]:
            start = time.perf_counter()
            jax.block_until_ready(runs[label]())
            times[label].append(time.perf_counter() - start)
    return times


def time_ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of a run's step time over the baseline's in the same round:
    paired, so that the load of one round (both steps ran in it) cancels, where a ratio of two
    medians carries each run's own slow rounds (the figure then moved by as much as 5% between
    two runs of this script minutes apart)."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def _state_bytes(tree) -> int:
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def _measure(compiled, mesh, run, state_of) -> dict:
    """Peak and traffic read from `compiled`, the state's bytes, and `run` (one step), timed
    later with the others (`_time_interleaved`)."""
    report = comm_report(compiled, mesh=mesh)
    return {"run": run, "state": _state_bytes(state_of()), "peak": peak_bytes(compiled),
            "sent": report.total_bytes,
            "payload": {kind: report.payload_bytes(kind) for kind in KINDS}}


# ------------------------------------------------------------------------------------------------
# zeroxla

def bench_zero(model_name: str, stage: int, mesh, batch, prefetch: bool = True) -> dict:
    step = zeroxla.make_step(lambda: models.build(model_name), mesh,
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=stage, persistence_threshold=1000,
                                                       prefetch=prefetch))
    holder = {"state": step.init()}
    compiled = step.compile(holder["state"], batch)

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]
    return _measure(compiled, mesh, run, lambda: holder["state"])


# ------------------------------------------------------------------------------------------------
# The baselines (`fsdp_baseline`): one jitted train step, shardings given, XLA inserting the
# collectives.

def bench_jit(model_name: str, mode: str, mesh, batch) -> dict:
    """`mode` "dp": parameters replicated; "fsdp": MaxText's rules (`fsdp_baseline`)."""
    base = jit_train_step(models.build(model_name), mode, mesh, batch)
    return _measure(base.compiled, mesh, base.run, lambda: (base.params, base.opt_state))


# ------------------------------------------------------------------------------------------------
# The table.

def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "-"


def _time_ratios(r: dict, base: dict) -> str:
    return f"{time_ratio(r['times'], base['times']):.2f}"


def _traffic(row: dict, param_bytes: int) -> str:
    return "/".join(f"{row['payload'][k] / param_bytes:.2f}" for k in KINDS)


def table(model_name: str, rows: list[tuple[str, dict]], param_bytes: int) -> list[str]:
    dp, fsdp = dict(rows)["dp"], dict(rows)["fsdp"]
    lines = []
    for label, r in rows:
        lines.append(
            f"{model_name:<10}{label:<8}{1e3 * statistics.median(r['times']):>9.1f}"
            f"{_time_ratios(r, dp):>6}{_time_ratios(r, fsdp):>7}"
            f"{r['state'] / 2**20:>10.2f}{r['peak'] / 2**20:>10.2f}"
            f"{_ratio(r['peak'], dp['peak']):>6}{_ratio(r['peak'], fsdp['peak']):>7}"
            f"{r['sent'] / 2**20:>10.2f}{_ratio(r['sent'], dp['sent']):>6}"
            f"{_ratio(r['sent'], fsdp['sent']):>7}  {_traffic(r, param_bytes)}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt-small"], choices=sorted(SEQ))
    parser.add_argument("--steps", type=int, default=21,
                        help="timed rounds, one step of every run each (medians)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    mesh = zeroxla.make_mesh(2, 4)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, batch {args.batch_size}, AdamW float32, {args.steps} interleaved rounds: "
          "step ms their median, time ratios the median of the rounds' paired ratios")
    header = (f"{'model':<10}{'run':<8}{'step ms':>9}{'xDP':>6}{'xFSDP':>7}{'state MiB':>10}"
              f"{'peak MiB':>10}{'xDP':>6}{'xFSDP':>7}{'sent MiB':>10}{'xDP':>6}{'xFSDP':>7}"
              f"  AG/RS/AR/A2A x params")
    print(header)
    print("-" * len(header))
    for name in args.models:
        batch = _batch(name, args.batch_size)
        param_bytes = 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(
            nnx.state(models.build(name), nnx.Param)))
        rows = [("dp", bench_jit(name, "dp", mesh, batch)),
                ("fsdp", bench_jit(name, "fsdp", mesh, batch))]
        rows += [(f"zero-{s}", bench_zero(name, s, mesh, batch)) for s in range(4)]
        rows.append(("zero-3j", bench_zero(name, 3, mesh, batch, prefetch=False)))
        times = _time_interleaved({label: r["run"] for label, r in rows}, args.steps)
        for label, r in rows:
            r["times"] = times[label]
        print("\n".join(table(name, rows, param_bytes)), flush=True)


if __name__ == "__main__":
    main()
