"""A real-size checkpoint loaded into ZeRO-3: Qwen2.5-0.5B's shape, random bf16 weights written
by transformers (no network), through `zeroxla.load_pretrained` on 8 simulated CPU devices.

    python benchmarks/real_size_load.py [--dir DIR] [--keep]

Three phases, each in its own process so that none inherits another's memory:

* `write`: transformers builds `Qwen2ForCausalLM` from Qwen2.5-0.5B's `config.json` values
  (`QWEN25_05B`: hidden 896, 24 layers, 14 heads, 2 kv-heads, q/k/v bias, tied 151936 x 896
  embedding) in bfloat16 and saves it (safetensors, ~1 GB, 0.49 B parameters);
* `load`: `load_pretrained(dir, 2 x 4 mesh, optimizer=optax.sgd, ZeroConfig(stage=3))`,
  timed (first call: compiling the stacking and ZeRO layout programs is included), then the
  gathered model's float32 logits on one [2, 32] batch. SGD keeps no optimizer state, so the
  devices hold the float32 parameters alone (~1.9 GiB); Adam's two moments would add twice
  that, made as zeros on the devices (no host traffic), which this 24 GiB machine shares
  with other work;
* `reference`: transformers' logits of the same batch, from the checkpoint loaded in float32
  (the same bf16 values, float32 compute) and in bfloat16 (bf16 compute).

Host peak, two measures of the `load` phase:

* `host peak`: tracemalloc's peak of Python/numpy allocations during `load_pretrained` (the
  HF tensors read, their float32 conversions, the pieces cut for the devices); bounded by
  2 x the largest converted tensor (the float32 151936 x 896 embedding) plus 64 MiB;
* `RSS growth`: the process's peak resident set (VmHWM, reset before the load) minus its RSS
  before. On XLA:CPU the devices' buffers are process memory, so this includes the loaded
  ZeRO-3 state (`device bytes`: the live arrays after the load), the spread parameters
  `ZeroStep.init_from` builds it from (alive together while it runs), the per-layer slices a
  stacked parameter is built from and the compiled programs. (VmHWM is read from Linux's
  /proc.)

The logits are compared with transformers' float32 ones (`max |diff|`, bound `ATOL`: the
same bf16 weights in float32 compute, differing only by summation order over 24 layers) and
with transformers' bf16-compute ones (bound `BF16_ATOL`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

# Qwen/Qwen2.5-0.5B's config.json (the values that shape the model).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, max_window_layers=24, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                  sliding_window=32768, hidden_act="silu", bos_token_id=151643,
                  eos_token_id=151643)
ATOL = 1e-4                    # float32 compute on both sides (logits of std ~0.6)
BF16_ATOL = 0.1                # against transformers' bf16 compute: bf16's 8-bit mantissa
                               # (relative 2^-8) through 24 layers, on logits up to ~3
OVERHEAD = 64 * 2**20          # Python objects, safetensors handles, tqdm, small tensors
BATCH = (2, 32)


def write(directory: Path) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    start = time.perf_counter()
    config = transformers.Qwen2Config(**QWEN25_05B)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    return {"params": params, "write s": time.perf_counter() - start}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _device_bytes(arrays) -> int:
    """Bytes the arrays' shards occupy on their devices (a replicated array counts once per
    device)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               * len(a.sharding.device_set) for a in arrays)


def load(directory: Path) -> dict:
    import gc
    import tracemalloc

    import jax
    import optax

    import zeroxla

    mesh = zeroxla.make_mesh(nodes=2, local=4)
    Path("/proc/self/clear_refs").write_text("5")         # VmHWM := VmRSS
    rss_before = _status_kib("VmRSS")
    tracemalloc.start()
    start = time.perf_counter()
    _, state = zeroxla.load_pretrained(directory, mesh, optimizer=optax.sgd(1e-5),
                                       progress=False, config=zeroxla.ZeroConfig(stage=3))
    jax.block_until_ready(state.params)
    seconds = time.perf_counter() - start
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hwm = _status_kib("VmHWM")
    gc.collect()
    state_bytes = _device_bytes(jax.tree.leaves(state))
    device = _device_bytes(jax.live_arrays())
    x = np.random.default_rng(0).integers(0, QWEN25_05B["vocab_size"], BATCH).astype(np.int32)
    logits = np.asarray(zeroxla.gathered_model(state)(x), np.float32)
    np.save(directory / "ours.npy", logits)
    return {"load s": seconds, "host peak": traced, "rss growth": (hwm - rss_before) * 1024,
            "device bytes": device, "state bytes": state_bytes}


def reference(directory: Path) -> dict:
    import torch
    import transformers

    x = np.random.default_rng(0).integers(0, QWEN25_05B["vocab_size"], BATCH)
    for dtype, name in ((torch.float32, "theirs_f32"), (torch.bfloat16, "theirs_bf16")):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        with torch.no_grad():
            out = model(torch.tensor(x, dtype=torch.long)).logits.float().numpy()
        np.save(directory / f"{name}.npy", out)
        del model
    return {}


PHASES = {"write": write, "load": load, "reference": reference}


def run_phase(phase: str, directory: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", phase, "--dir", str(directory)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="checkpoint directory, kept (default: a temporary one, "
                                      "removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoint")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(PHASES[args.phase](Path(args.dir))))
        return
    directory = Path(args.dir or tempfile.mkdtemp(prefix="qwen25_05b_"))
    directory.mkdir(parents=True, exist_ok=True)
    figures = {}
    for phase in ("write", "load", "reference"):
        figures.update(run_phase(phase, directory))
    ours = np.load(directory / "ours.npy")
    f32, bf16 = np.load(directory / "theirs_f32.npy"), np.load(directory / "theirs_bf16.npy")
    largest = QWEN25_05B["vocab_size"] * QWEN25_05B["hidden_size"] * 4      # float32 embedding
    bound = 2 * largest + OVERHEAD
    diff, diff_bf16 = float(np.abs(ours - f32).max()), float(np.abs(ours - bf16).max())
    mib = 2**20
    print(f"Qwen2.5-0.5B shape, {figures['params'] / 1e9:.3f} B parameters, bf16 on disk; "
          f"ZeRO-3 on 2 x 4 CPU devices")
    print(f"write (transformers)   {figures['write s']:8.1f} s")
    print(f"load_pretrained        {figures['load s']:8.1f} s")
    print(f"host peak (traced)     {figures['host peak'] / mib:8.1f} MiB   bound 2 x "
          f"{largest / mib:.1f} + {OVERHEAD // mib} = {bound / mib:.1f} MiB")
    print(f"RSS growth             {figures['rss growth'] / mib:8.1f} MiB   device bytes "
          f"after {figures['device bytes'] / mib:.1f} MiB (ZeRO-3 state "
          f"{figures['state bytes'] / mib:.1f} MiB)")
    print(f"logits std {f32.std():.3f}; max |ours - transformers f32| {diff:.2e} "
          f"(bound {ATOL:g}); max |ours - transformers bf16| {diff_bf16:.2e} "
          f"(bound {BF16_ATOL:g})")
    if not args.keep and not args.dir:
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    if figures["host peak"] >= bound or diff > ATOL or diff_bf16 > BF16_ATOL:
        sys.exit("FAILED: host peak or logits outside their bounds")


if __name__ == "__main__":
    main()
