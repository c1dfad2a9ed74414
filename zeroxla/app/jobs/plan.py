"""`zeroxla plan`: what fits a device, by compile only (`zeroxla.analysis.planner`).

    zeroxla plan --model Llama-3.1-8B --mesh 1x8 --device-memory 80GiB --seq-len 32768
    zeroxla plan --model Qwen2.5-0.5B --max-seq-len

Compiles the ZeRO step for the model's shape on abstract arrays (nothing allocated) and prints
the per-device peak by part; with `--max-seq-len`, the largest sequence length that fits for
each activation setting (binary search by compile only). Not a training job: no run directory.
On a CPU host the mesh's devices are simulated (XLA_FLAGS' host device count, set before JAX
starts, as `zeroxla train` does); elsewhere the mesh must match the devices present.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from zeroxla.app.cli_args import host_device_count, mesh_shape, positive_int, set_host_device_count

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PLAN_STAGES = (2, 3)          # remat policies apply to stages 2-3 (`ZeroConfig.remat`)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$")
SIZE_ACCEPTED = "a number with a unit, e.g. 80GiB, 80GB, 81920MiB (B, KB, MB, GB, TB, KiB, " \
                "MiB, GiB, TiB)"


def memory_size(text: str) -> int:
    """'80GiB' -> 85899345920 bytes; '80GB' -> 80e9."""
    match = _SIZE.match(text.lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: {SIZE_ACCEPTED}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def remat_list(text: str) -> tuple[str, ...]:
    """'none,full,offload' -> the policies, each one `ZeroConfig.remat` accepts."""
    from zeroxla.sharding.config import REMAT_POLICIES

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    bad = [name for name in names if name not in REMAT_POLICIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: one or more of "
                                         f"{', '.join(REMAT_POLICIES)}, comma-separated")
    return names


def add_plan(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla plan` and sets its handler to `run_plan`."""
    p = subparsers.add_parser(
        "plan", help="what fits a device: per-device memory of the ZeRO step, by compile only",
        description="Compile the ZeRO training step for a model's shape on abstract arrays "
                    "(nothing allocated) and print the per-device peak by part (state, "
                    "activations and temporaries, arguments) against --device-memory; with "
                    "--max-seq-len, the largest sequence length that fits per activation "
                    "setting. Host memory (ZeRO-Offload state, remat offload's activations) "
                    "is printed apart, never counted in the device figure.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, metavar="HF_DIR_OR_PRESET",
                   help="a preset of real shapes (models.presets: Llama-3.2-1B, "
                        "Llama-3.1-8B, Qwen2.5-0.5B, ...) or a Hugging Face directory with "
                        "config.json (no weights are read)")
    p.add_argument("--mesh", type=mesh_shape, default=(1, 8), metavar="NODESxLOCAL",
                   help="data-parallel devices as nodes x devices per node")
    p.add_argument("--device-memory", type=memory_size, default=memory_size("80GiB"),
                   metavar="SIZE", help=f"memory of one device: {SIZE_ACCEPTED}")
    lengths = p.add_mutually_exclusive_group()
    lengths.add_argument("--seq-len", type=positive_int, default=4096, metavar="T",
                         help="tokens per sequence")
    lengths.add_argument("--max-seq-len", action="store_true",
                         help="search the largest T that fits, for each --remat policy (and "
                              "each model setting the config has: attention, mlp_chunk)")
    p.add_argument("--stage", type=int, choices=PLAN_STAGES, default=3, help="ZeRO stage")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="compute dtype")
    p.add_argument("--remat", type=remat_list, default=None, metavar="POLICY[,POLICY...]",
                   help="activation policies (ZeroConfig.remat); default: full with --seq-len, "
                        "none,full,offload with --max-seq-len")
    p.add_argument("--sequences-per-device", type=positive_int, default=1, metavar="N",
                   help="sequences each data-parallel device holds in one micro-batch")
    p.add_argument("--granularity", type=positive_int, default=1024, metavar="T",
                   help="--max-seq-len: the search's step (answers are multiples of it)")
    p.add_argument("--search-limit", type=positive_int, default=1 << 20, metavar="T",
                   help="--max-seq-len: the longest T tried")
    p.set_defaults(handler=run_plan)


def model_config(model: str) -> Any:
    """The config of `--model`: a preset name or a Hugging Face directory (its config.json)."""
    from zeroxla.models import presets
    from zeroxla.models.hf_config import from_hf_config

    if model in presets.HF_CONFIGS:
        return presets.config(model)
    path = Path(model)
    if (path / "config.json").is_file():
        return from_hf_config(json.loads((path / "config.json").read_text()))
    raise ValueError(f"--model {model!r} is neither a preset nor a directory with config.json; "
                     f"accepted presets: {', '.join(presets.NAMES)}")


def _mesh(nodes: int, local: int, simulated: bool) -> Any:
    import jax

    from zeroxla.sharding.mesh import make_mesh

    count = len(jax.devices())
    if nodes * local != count:
        how = ("XLA_FLAGS sets the host device count to " if simulated else "this host has ")
        raise ValueError(f"--mesh {nodes}x{local} needs {nodes * local} devices; {how}{count}"
                         "; accepted: a --mesh of that many devices (on a CPU host, unset "
                         "--xla_force_host_platform_device_count to simulate any mesh)")
    return make_mesh(nodes, local)


def run_plan(args: argparse.Namespace) -> int:
    """Runs `zeroxla plan`; prints the figures."""
    nodes, local = args.mesh
    user_count = host_device_count()
    set_host_device_count(nodes * local)       # before JAX starts (cli module docstring)
    config = model_config(args.model)
    mesh = _mesh(nodes, local, simulated=user_count is not None)
    dtype = DTYPES[args.dtype]
    if args.max_seq_len:
        print(max_seq_len_report(config, mesh, args, dtype), flush=True)
        return 0
    from zeroxla.analysis.planner import plan_memory

    for remat in args.remat or ("full",):
        figures = plan_memory(config, mesh, seq_len=args.seq_len,
                              device_memory=args.device_memory, stage=args.stage, dtype=dtype,
                              remat=remat, sequences_per_device=args.sequences_per_device)
        print(f"{args.model}, ZeRO-{args.stage}, {args.dtype}, mesh {nodes}x{local}: "
              f"{figures.table()}", flush=True)
    return 0


def max_seq_len_report(config: Any, mesh: Any, args: argparse.Namespace, dtype: str) -> str:
    """The largest T per setting (`planner.sweep_settings`), one line each, by compile only."""
    from zeroxla.analysis.planner import largest_fitting, plan_memory, sweep_settings

    settings, missing = sweep_settings(config, args.remat or ("none", "full", "offload"))
    lines = [f"{args.model}, ZeRO-{args.stage}, {args.dtype}, mesh {args.mesh[0]}x"
             f"{args.mesh[1]}, {args.device_memory / 2**30:.1f} GiB per device, "
             f"{args.sequences_per_device} sequence(s) per device: largest T that fits"]
    for setting in settings:
        peaks: dict[int, Any] = {}

        def fits(t: int, setting=setting, peaks=peaks) -> bool:
            figures = plan_memory(config, mesh, seq_len=t, device_memory=args.device_memory,
                                  stage=args.stage, dtype=dtype, remat=setting.remat,
                                  fields=dict(setting.fields),
                                  sequences_per_device=args.sequences_per_device)
            peaks[t] = figures
            return figures.fits
        best = largest_fitting(fits, granularity=args.granularity, limit=args.search_limit)
        note = ""
        if best:
            f = peaks[best]
            note = (f" (peak {f.peak / 2**30:.2f} GiB"
                    + (f", {f.host_residuals / 2**30:.2f} GiB activations in host memory"
                       if f.host_residuals else "")
                    + (", derived" if f.derived else "") + ")")
        lines.append(f"  {setting.label:<40} T = {best}{note}"
                     + (f" (limit {args.search_limit})" if best == args.search_limit else ""))
    for field in missing:
        lines.append(f"  not swept: {type(config).__name__} has no field {field!r} (not built)")
    return "\n".join(lines)


__all__ = ["add_plan", "memory_size", "model_config", "remat_list", "run_plan"]
