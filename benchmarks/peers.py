"""Where zeroxla stands against its peers, every comparison in one run.

    python benchmarks/peers.py [--quick]

Runs, one after another, each in its own process (each sets its own device count and holds
its own compiled programs), and prints their tables under one heading each:

* `zero.py`: ZeRO stages 0-3 against plain data parallelism and GSPMD FSDP the way MaxText runs
  it (step time, per-device state, compiled peak, bytes sent), gpt-small on 2 x 4;
* `hybrid.py`: the Hybrid Engine's training -> generation reshard bytes against the floor
  2Psi/T (1 - T/N), and its tokens/s against a plain single-device KV-cached decode;
* `pipeline.py`: 1F1B, ZB-H1 and GPipe with ZeRO-3 inside the stages: bubble from the schedule
  table, step time against the unpipelined ZeRO-3 step and 1F1B, permute and gather bytes,
  temporaries against the number of micro-batches;
* `offload.py`: ZeRO-Offload's device peak and step time with and without it.

`--quick` passes each the fewest timed steps it takes (a smoke run of the whole comparison);
the tables in docs/benchmarks.md come from the defaults. A benchmark that fails stops the run
with its exit status, after its output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (script, its arguments for --quick)
BENCHMARKS = (("zero.py", ["--steps", "1"]),
              ("hybrid.py", ["--tp", "1", "8"]),
              ("pipeline.py", ["--steps", "1", "--no-memory"]),
              ("offload.py", ["--steps", "1"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the fewest timed steps each benchmark takes (a smoke run)")
    args = parser.parse_args(argv)
    for script, quick in BENCHMARKS:
        print(f"\n=== benchmarks/{script} " + "=" * (60 - len(script)), flush=True)
        start = time.perf_counter()
        result = subprocess.run([sys.executable, str(HERE / script), *(quick if args.quick
                                                                        else [])])
        print(f"--- {script}: {time.perf_counter() - start:.0f} s", flush=True)
        if result.returncode != 0:
            print(f"benchmarks/{script} failed (exit {result.returncode})", file=sys.stderr)
            return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
