"""`zeroxla plan`'s figures for docs/benchmarks.md: per-device peaks of real shapes, by compile
only (nothing allocated, nothing runs), ZeRO-3, bf16, 8 simulated CPU devices of 80 GiB.

    python benchmarks/planner.py table                  # Qwen2.5-0.5B, Llama-3.2-1B at 8K, 32K
    python benchmarks/planner.py search --model Llama-3.1-8B --remat full \\
        --field attention=auto --field mlp_chunk=4096   # the largest T for one setting
    python benchmarks/planner.py search ... --sequence-parallel-size 8 \\
        [--sequence-parallel-strategy allgather|ring] # one sequence over the 8 devices
    python benchmarks/planner.py search --model Qwen3-30B-A3B --expert-parallel-size 8
                                                      # the MoE's experts split 8 ways
    python benchmarks/planner.py search --model Qwen3.5-27B \\
        --zero max_live_parameters=2000000000         # ZeroConfig fields (a block gathered
                                                      # whole holds more than DeepSpeed's 1e9)

Each compile prints its seconds: the search compiles about 2 log2(T / 1024) times. Figures are
XLA:CPU's (`zeroxla.analysis.planner`: remat "offload"'s device figure is derived there).
"""

from __future__ import annotations

import argparse
import os
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import zeroxla  # noqa: E402
from zeroxla.analysis.planner import largest_fitting, plan_memory  # noqa: E402
from zeroxla.models import presets  # noqa: E402
from zeroxla.models.sequence_parallel import STRATEGIES  # noqa: E402

GiB = 2**30
DEVICE = 80 * GiB


def _value(text: str):
    return None if text == "None" else int(text) if text.isdigit() else text


def _figures(name, seq_len, remat, fields, sequence=1, strategy="ulysses", expert=1, zero=None):
    start = time.perf_counter()
    mesh = zeroxla.make_mesh(1, 8 // (sequence * expert), expert=expert, sequence=sequence)
    f = plan_memory(presets.config(name), mesh,
                    seq_len=seq_len, device_memory=DEVICE, remat=remat, fields=fields,
                    zero={"sequence_parallel_strategy": strategy, **(zero or {})})
    print(f"  {name} T={seq_len} {f.setting}: peak {f.peak / GiB:.2f} GiB (state "
          f"{f.device_state / GiB:.2f}, temporaries {f.temporaries / GiB:.2f}, host "
          f"{f.host_residuals / GiB:.2f}{', derived' if f.derived else ''}), fits "
          f"{'yes' if f.fits else 'no'}, compile {time.perf_counter() - start:.0f} s",
          flush=True)
    return f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("table", "search"))
    parser.add_argument("--model", default="Llama-3.1-8B", choices=presets.NAMES)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--field", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--zero", action="append", default=[], metavar="NAME=VALUE",
                        help="a ZeroConfig field, e.g. max_live_parameters=2000000000")
    parser.add_argument("--limit", type=int, default=1 << 20)
    parser.add_argument("--granularity", type=int, default=1024,
                        help="search: answers are multiples of it")
    parser.add_argument("--sequence-parallel-size", type=int, default=1, choices=(1, 2, 4, 8),
                        help="each sequence split over this many of the 8 devices")
    parser.add_argument("--sequence-parallel-strategy", default="ulysses",
                        choices=STRATEGIES)
    parser.add_argument("--expert-parallel-size", type=int, default=1, choices=(1, 2, 4, 8),
                        help="an MoE model's experts split over this many of the 8 devices")
    args = parser.parse_args()
    fields = {k: _value(v) for k, v in (f.split("=", 1) for f in args.field)}
    zero = {k: _value(v) for k, v in (f.split("=", 1) for f in args.zero)}
    if args.what == "table":
        for name in ("Qwen2.5-0.5B", "Llama-3.2-1B"):
            for seq_len in (8192, 32768):
                _figures(name, seq_len, args.remat, fields, zero=zero)
        return
    sp, how, ep = (args.sequence_parallel_size, args.sequence_parallel_strategy,
                   args.expert_parallel_size)
    best = largest_fitting(
        lambda t: _figures(args.model, t, args.remat, fields, sp, how, ep, zero).fits,
        granularity=args.granularity, limit=args.limit)
    print(f"{args.model} remat={args.remat} {fields} {zero} sequence parallel {sp} ({how}), "
          f"expert parallel {ep}: largest T = {best}", flush=True)


if __name__ == "__main__":
    main()
