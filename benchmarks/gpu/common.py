"""What every GPU check script shares: where figures go, how they are timed, what the device is.

Every figure is printed and appended as one JSON line to `$OUT/results.jsonl` (`record`); `OUT`
unset: `out/gpu` under the repository (git-ignored). Times are medians of repeated runs after
warm-up, each run ended by `jax.block_until_ready` (`median_seconds`). A part that fails prints
its traceback and records `{"error": ...}`, and the script goes on with the next part
(`guarded`): one device run must give every figure it can.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

REPO = Path(__file__).resolve().parents[2]
# H100 SXM5 dense bf16 / fp16 tensor-core peak (NVIDIA's datasheet, without sparsity): the MFU
# denominator. Another device: pass the peak with --peak-flops.
H100_PEAK_FLOPS = 989e12
TINY_HELP = "tiny shapes, for a CPU check of the script itself (its figures mean nothing)"


def out_dir() -> Path:
    """`$OUT` when set (the device machine returns what is written there), else `out/gpu`."""
    path = Path(os.environ.get("OUT") or REPO / "out" / "gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def record(section: str, **fields: Any) -> dict[str, Any]:
    """Prints `fields` under `section` and appends them as one JSON line to results.jsonl."""
    row = {"section": section, **fields}
    line = json.dumps(row, default=_plain)
    print(f"RESULT {line}", flush=True)
    with open(out_dir() / "results.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")
    return row


def _plain(value: Any) -> Any:
    """JSON for numpy / jax scalars and anything else (its repr)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def packed_rows(rng, batch: int, seq: int) -> dict:
    """segment_ids, positions, loss_mask [B, T]: sequences of 64..T/4 tokens, then 64 padding
    tokens (segment 0, out of the loss)."""
    import numpy as np

    pad = min(64, seq // 4)
    segments, positions = np.zeros((batch, seq), np.int32), np.zeros((batch, seq), np.int32)
    for row in range(batch):
        start, next_id = 0, 1
        while start < seq - pad:
            length = min(int(rng.integers(pad, max(pad + 1, seq // 4))), seq - pad - start)
            segments[row, start:start + length] = next_id
            positions[row, start:start + length] = np.arange(length)
            start, next_id = start + length, next_id + 1
    return {"segment_ids": segments, "positions": positions,
            "loss_mask": (segments > 0).astype(np.float32)}


def guarded(section: str, part: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, or None after printing its traceback and recording the error under `part`."""
    try:
        return fn()
    except Exception as error:                     # noqa: BLE001  (reported, the run goes on)
        traceback.print_exc()
        record(section, part=part, error=f"{type(error).__name__}: {str(error)[:600]}")
        return None


def median_seconds(run: Callable[[], Any], *, warmup: int = 2, repeats: int = 10) -> float:
    """Median wall seconds of `run()` (its result blocked on) after `warmup` untimed runs."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def peak_bytes() -> int | None:
    """The device's peak bytes in use so far in this process (None where the backend keeps no
    statistics, e.g. XLA:CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def compiled_bytes(compiled: Any) -> dict[str, int | None]:
    """XLA's own accounting of a compiled program: temporaries, arguments, outputs (bytes)."""
    try:
        m = compiled.memory_analysis()
        return {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
                "output_bytes": m.output_size_in_bytes}
    except Exception:                              # noqa: BLE001  (not every backend has it)
        return {"temp_bytes": None, "argument_bytes": None, "output_bytes": None}


def device_facts() -> dict[str, Any]:
    """The device, its kind, the versions that matter, cuDNN's version where there is one."""
    import flax
    import jaxlib
    import optax

    device = jax.devices()[0]
    facts = {"backend": jax.default_backend(), "device": str(device),
             "device_kind": getattr(device, "device_kind", None),
             "device_count": jax.device_count(), "jax": jax.__version__,
             "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
             "python": sys.version.split()[0],
             "compute_capability": getattr(device, "compute_capability", None)}
    try:
        from jax._src.lib import cuda_versions         # jaxlib's record of its CUDA libraries
        facts["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception as error:                     # noqa: BLE001
        facts["cudnn"] = f"unknown ({type(error).__name__})"
    return facts
