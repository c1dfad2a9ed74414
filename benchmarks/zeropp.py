"""ZeRO++ feature combinations against ZeRO-3, on 8 simulated CPU devices (2 nodes x 4 local).

    python benchmarks/zeropp.py [--model gpt-small] [--steps 5]

Prints, for the small GPT with bf16 compute: per-device cross-node and intra-node bytes per step
(from the compiled program, `zeroxla.comm_report`), their ratio to ZeRO-3, and the step-time
ratio measured in the same run; then the quantization error table of the kernels
(`benchmarks/quantization_error.py`). On CPU the collectives are memcpys, so step time here shows
the cost of quantizing, not the network time saved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from zeroxla import models  # noqa: E402
import zeroxla  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import quantization_error  # noqa: E402

COMBINATIONS = {
    "zero-3": {},
    "qwZ": dict(quantized_weights=True),
    "qwZ int4": dict(quantized_weights=True, weight_quantization_bits=4),
    "hpZ": dict(hpz_partition_size=4),
    "qgZ": dict(quantized_gradients=True),
    "qwZ+hpZ": dict(quantized_weights=True, hpz_partition_size=4),
    "zero++": dict(quantized_weights=True, hpz_partition_size=4, quantized_gradients=True),
    "zero++ int4": dict(quantized_weights=True, weight_quantization_bits=4, hpz_partition_size=4,
                        quantized_gradients=True),
}


def measure(model_name: str, features: dict, batch: dict, steps: int) -> dict:
    config = zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16", persistence_threshold=1000,
                                **features)
    step = zeroxla.make_step(lambda: models.build(model_name), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3), config=config)
    state = step.init()
    report = zeroxla.comm_report(step, state, batch)
    state, _ = step(state, batch)                       # compile
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return {"cross": report.cross_node_bytes, "intra": report.intra_node_bytes,
            "seconds": statistics.median(times)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-quantization-table", action="store_true")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 65, (32, 129)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    print(f"{args.model}, bf16 compute, mesh 2 nodes x 4 local, batch 32x128, "
          f"median of {args.steps} steps")
    header = (f"{'features':<13}{'cross MiB':>10}{'ZeRO-3 /':>10}{'intra MiB':>11}"
              f"{'step ms':>9}{'x ZeRO-3':>10}")
    print(header)
    print("-" * len(header))
    base = None
    for name, features in COMBINATIONS.items():
        r = measure(args.model, features, batch, args.steps)
        base = base or r
        print(f"{name:<13}{r['cross'] / 2**20:>10.3f}{base['cross'] / r['cross']:>9.2f}x"
              f"{r['intra'] / 2**20:>11.3f}{1e3 * r['seconds']:>9.1f}"
              f"{r['seconds'] / base['seconds']:>10.2f}")
    if not args.no_quantization_table:
        print()
        quantization_error.main([])


if __name__ == "__main__":
    main()
