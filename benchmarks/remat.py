"""ZeRO-3's compiled peak under each activation policy (`ZeroConfig.remat`), on zero.py's model
and batch, 8 simulated CPU devices.

    python benchmarks/remat.py [--model gpt-small] [--batch-size 32]

Compiles (nothing runs) the ZeRO-3 step of `benchmarks/zero.py` (AdamW, persistence threshold
1000, mesh 2 x 4) once per policy and prints XLA's peak for it (`compiled.memory_analysis()`:
arguments + temporaries + outputs - donated, `fsdp_baseline.peak_bytes`) and its temporaries:
properties of the compiled programs, not timings. The recompute each policy pays is measured
on a one-layer model by `tests/zeroxla/engine/test_remat.py` (the compiled program's cost
analysis counts a loop's body once, so this layer loop's FLOPs are not read here).
"""

from __future__ import annotations

import argparse
import os

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import optax  # noqa: E402

import zeroxla  # noqa: E402
from fsdp_baseline import peak_bytes  # noqa: E402  (beside this file)
from zero import SEQ, _batch  # noqa: E402  (beside this file)
from zeroxla import models  # noqa: E402

POLICIES = ("none", "dots_with_no_batch_dims_saveable", "dots_saveable", "full")


def measure(model_name: str, remat: str, mesh, batch) -> dict[str, float]:
    step = zeroxla.make_step(lambda: models.build(model_name), mesh,
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=1000,
                                                       remat=remat))
    compiled = step.compile(step.init(), batch)
    memory = compiled.memory_analysis()
    return {"peak": peak_bytes(compiled), "temps": memory.temp_size_in_bytes}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", choices=sorted(SEQ))
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    mesh = zeroxla.make_mesh(2, 4)
    batch = _batch(args.model, args.batch_size)
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh 2x4, {args.model} {args.batch_size} x {SEQ[args.model]}, ZeRO-3, AdamW "
          "float32, persistence threshold 1000; MiB per device")
    header = f"{'remat':<34}{'peak MiB':>10}{'temps MiB':>11}"
    print(header)
    print("-" * len(header))
    rows = {policy: measure(args.model, policy, mesh, batch) for policy in POLICIES}
    for policy, r in rows.items():
        print(f"{policy:<34}{r['peak'] / 2**20:>10.2f}{r['temps'] / 2**20:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
