"""`zeroxla plan`: what fits a device, by compile only (`zeroxla.analysis.planner`).

    zeroxla plan --model Llama-3.1-8B --mesh 1x8 --device-memory 80GiB --seq-len 32768
    zeroxla plan --model Qwen2.5-0.5B --max-seq-len

Compiles the ZeRO step for the model's shape on abstract arrays (nothing allocated) and prints
the per-device peak by part; with `--max-seq-len`, the largest sequence length that fits for
each activation setting (a few compiles per setting: `planner.largest_under`; the settings
searched at once, one per core: `search_workers`, sharing the programs two settings build
alike: `_SharedCompiles`; one line to stderr per length tried). Not a training job: no run
directory.
On a CPU host the mesh's devices are simulated (XLA_FLAGS' host device count, set before JAX
starts, as `zeroxla train` does); elsewhere the mesh must match the devices present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zeroxla.app.cli_args import host_device_count, mesh_shape, positive_int, set_host_device_count
from zeroxla.app.run.options import Option, OptionTable
from zeroxla.models.sequence_parallel import SequenceParallel
from zeroxla.sharding.config import SEQUENCE_PARALLEL_STRATEGIES, ZeroConfig

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PLAN_STAGES = (2, 3)          # remat policies apply to stages 2-3 (`ZeroConfig.remat`)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$")
SIZE_ACCEPTED = "a number with a unit, e.g. 80GiB, 80GB, 81920MiB (B, KB, MB, GB, TB, KiB, " \
                "MiB, GiB, TiB)"


def memory_size(text: str) -> int:
    """'80GiB' -> 85899345920 bytes; '80GB' -> 80e9. A bare number is refused: '80' meant as
    GiB would be read as 80 bytes, and every step would "not fit"."""
    match = _SIZE.match(text.lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: {SIZE_ACCEPTED}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def choice_list(text: str, accepted: tuple[str, ...]) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), each one of `accepted`; an argparse error naming them otherwise."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    bad = [name for name in names if name not in accepted]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; accepted: one or more of "
                                         f"{', '.join(accepted)}, comma-separated")
    return names


def remat_list(text: str) -> tuple[str, ...]:
    """'none,full,offload' -> the policies, each one `ZeroConfig.remat` accepts."""
    from zeroxla.sharding.config import REMAT_POLICIES

    return choice_list(text, REMAT_POLICIES)


def attention_list(text: str) -> tuple[str, ...]:
    """'naive,blockwise' -> the attention implementations, each one models accept."""
    from zeroxla.models.attention import IMPLEMENTATIONS

    return choice_list(text, IMPLEMENTATIONS)


DEVICE_MEMORY = "80GiB"       # --device-memory's default, as written
MODEL_ACCEPTED = ("a preset of real shapes (models.presets: Llama-3.2-1B, Llama-3.1-8B, "
                  "Qwen2.5-0.5B, ...) or a Hugging Face directory with config.json (no weights "
                  "are read)")


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What `zeroxla plan` compiles and searches: `model`'s step on a `mesh` of devices of
    `device_memory` bytes; one `seq_len`, or with `max_seq_len` the largest T per setting.
    `remat`: the `ZeroConfig.remat` policies (None: full with seq_len, `planner.REMAT_SWEEP`
    with max_seq_len); `attention`: attention paths the max_seq_len sweep tries beside the
    model's own."""

    model: str
    mesh: tuple[int, int] = (1, 8)
    device_memory: int = memory_size(DEVICE_MEMORY)
    seq_len: int = 4096
    max_seq_len: bool = False
    stage: int = 3
    dtype: str = "bf16"
    remat: tuple[str, ...] | None = None
    attention: tuple[str, ...] = ()
    sequences_per_device: int = 1
    granularity: int = 1024
    search_limit: int = 1 << 20
    sequence_parallel_size: int = 1
    sequence_parallel_strategy: str = "ulysses"
    max_live_parameters: int = ZeroConfig.max_live_parameters

    zero = property(lambda self: {"sequence_parallel_strategy": self.sequence_parallel_strategy,
                                  "max_live_parameters": self.max_live_parameters})

    @property
    def mesh_label(self) -> str:
        sp = self.sequence_parallel_size
        return (f"mesh {self.mesh[0]}x{self.mesh[1]}" + (
            f" (sequence parallel {sp}, {self.sequence_parallel_strategy})" if sp > 1 else ""))


OPTIONS = OptionTable("plan", PlanSettings, (
    Option("--model", "model", None, "model", "model",
           f"{MODEL_ACCEPTED}; required", metavar="HF_DIR_OR_PRESET"),
    Option("--mesh", "mesh", None, "mesh", "model",
           "data-parallel devices as nodes x devices per node; default {default}",
           type=mesh_shape, metavar="NODESxLOCAL"),
    Option("--device-memory", "device_memory", None, "device_memory", "model",
           f"memory of one device: {SIZE_ACCEPTED}; default {DEVICE_MEMORY}",
           type=memory_size, metavar="SIZE"),
    Option("--seq-len", "seq_len", None, "seq_len", "length",
           "tokens per sequence; default {default}", type=positive_int, metavar="T",
           exclusive="length"),
    Option("--max-seq-len", "max_seq_len", None, "max_seq_len", "length",
           "search the largest T that fits, for each --remat policy (and each model setting "
           "the config has: mlp_chunk off and on; --attention)", action="store_true",
           exclusive="length"),
    Option("--stage", "stage", None, "stage", "step", "ZeRO stage; default {default}",
           type=int, choices=PLAN_STAGES),
    Option("--dtype", "dtype", None, "dtype", "step", "compute dtype; default {default}",
           choices=tuple(DTYPES)),
    Option("--remat", "remat", None, "remat", "step",
           "activation policies (ZeroConfig.remat); default: full with --seq-len, "
           "full,offload with --max-seq-len (none never fits a longer T than full)",
           type=remat_list, metavar="POLICY[,POLICY...]"),
    Option("--attention", "attention", None, "attention", "search",
           "--max-seq-len: attention paths to sweep beside the model's own (e.g. naive); "
           "default: the model's own only", type=attention_list, metavar="PATH[,PATH...]"),
    Option("--sequences-per-device", "sequences_per_device", None, "sequences_per_device",
           "step", "sequences each data replica holds in one micro-batch; default {default}",
           type=positive_int, metavar="N"),
    Option("--sequence-parallel-size", "sequence_parallel_size", None,
           "sequence_parallel_size", "step", "each sequence split over P devices of a node "
           "(--mesh's LOCAL is LOCAL/P data replicas x P sequence devices); default {default}",
           type=positive_int, metavar="P"),
    Option("--sequence-parallel-strategy", "sequence_parallel_strategy", None,
           "sequence_parallel_strategy", "step", "attention under sequence parallelism: "
           "ulysses (heads split; they must divide by P), allgather or ring (context "
           "parallelism, any head count), usp (Ulysses x ring); default {default}",
           choices=SEQUENCE_PARALLEL_STRATEGIES),
    Option("--max-live-parameters", "max_live_parameters", None, "max_live_parameters",
           "step", "ZeroConfig.max_live_parameters (DeepSpeed's stage3_max_live_parameters): "
           "ZeRO-3 gathers a block of the stack whole, so it must hold one (a Qwen3.5 period "
           "of 4 layers); default {default}", type=positive_int, metavar="N"),
    Option("--granularity", "granularity", None, "granularity", "search",
           "--max-seq-len: the search's step (answers are multiples of it); default {default}",
           type=positive_int, metavar="T"),
    Option("--search-limit", "search_limit", None, "search_limit", "search",
           "--max-seq-len: the longest T tried; default {default}", type=positive_int,
           metavar="T")),
    {"model": "the model and the devices", "length": "the sequence length",
     "step": "the step compiled", "search": "the --max-seq-len search"})


HELP = "what fits a device: per-device memory of the ZeRO step, by compile only"
DESCRIPTION = ("Compile the ZeRO training step for a model's shape on abstract arrays (nothing "
               "allocated) and print the per-device peak by part (state, activations and "
               "temporaries, arguments) against --device-memory; with --max-seq-len, the "
               "largest sequence length that fits per activation setting. Host memory "
               "(ZeRO-Offload state, remat offload's activations) is printed apart, never "
               "counted in the device figure.")


def add_plan(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla plan` from its rows (`OPTIONS`) and sets its handler to `run_plan`."""
    parser = subparsers.add_parser("plan", help=HELP, description=DESCRIPTION)
    OPTIONS.add_to(parser)
    parser.set_defaults(handler=run_plan)


def plan_settings(given: Mapping[str, Any]) -> PlanSettings:
    """The given options (`OptionTable.given`) over the defaults; --model is required."""
    if given.get("model") is None:
        raise ValueError(f"--model is required; accepted: {MODEL_ACCEPTED}")
    return OPTIONS.build(given, model=given["model"])


def check_lengths(plan: PlanSettings) -> None:
    """ValueError naming --seq-len (or --granularity with --max-seq-len) unless the lengths
    planned are multiples of the chunks sequence parallelism cuts a sequence into: P, 2P for
    the zigzag strategies (`models.sequence_parallel`); checked before any compile, after
    the degree itself (`check_sequence_parallel`)."""
    from zeroxla.app.distributed import check_sequence_parallel

    check_sequence_parallel(plan.mesh, plan.sequence_parallel_size)
    size, strategy = plan.sequence_parallel_size, plan.sequence_parallel_strategy
    chunks = SequenceParallel("sequence", size, strategy).chunks
    option, length = (("--granularity", plan.granularity) if plan.max_seq_len
                      else ("--seq-len", plan.seq_len))
    if size <= 1 or length % chunks == 0:
        return
    lower, upper = length // chunks * chunks, -(-length // chunks) * chunks
    use = " or ".join(str(n) for n in (lower, upper) if n > 0)
    raise ValueError(f"{option} {length} is not a multiple of {chunks}: "
                     f"--sequence-parallel-size {size} with --sequence-parallel-strategy "
                     f"{strategy} cuts each sequence into {chunks} chunks over the {size} "
                     f"sequence devices; use {use} (accepted: a multiple of {chunks})")


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


def _mesh(nodes: int, local: int, simulated: bool, sequence: int = 1) -> Any:
    import jax

    from zeroxla.app.distributed import check_sequence_parallel
    from zeroxla.sharding.mesh import make_mesh

    check_sequence_parallel((nodes, local), sequence)
    count = len(jax.devices())
    if nodes * local != count:
        how = ("XLA_FLAGS sets the host device count to " if simulated else "this host has ")
        raise ValueError(f"--mesh {nodes}x{local} needs {nodes * local} devices; {how}{count}"
                         "; accepted: a --mesh of that many devices (on a CPU host, unset "
                         "--xla_force_host_platform_device_count to simulate any mesh)")
    return make_mesh(nodes, local // sequence, sequence=sequence)


def run_plan(args: argparse.Namespace) -> int:
    """Runs `zeroxla plan`; prints the figures."""
    plan = plan_settings(OPTIONS.given(args))
    check_lengths(plan)
    nodes, local = plan.mesh
    user_count = host_device_count()
    set_host_device_count(nodes * local)       # before JAX starts (cli module docstring)
    config = model_config(plan.model)
    mesh = _mesh(nodes, local, simulated=user_count is not None,
                 sequence=plan.sequence_parallel_size)
    dtype = DTYPES[plan.dtype]
    if plan.max_seq_len:
        print(max_seq_len_report(config, mesh, plan, dtype, say=_say), flush=True)
        return 0
    from zeroxla.analysis.planner import plan_memory

    for remat in plan.remat or ("full",):
        figures = plan_memory(config, mesh, seq_len=plan.seq_len,
                              device_memory=plan.device_memory, stage=plan.stage, dtype=dtype,
                              remat=remat, sequences_per_device=plan.sequences_per_device,
                              zero=plan.zero)
        print(f"{plan.model}, ZeRO-{plan.stage}, {plan.dtype}, {plan.mesh_label}: "
              f"{figures.table()}", flush=True)
    return 0


def search_workers(settings: int) -> int:
    """How many settings `max_seq_len_report` searches at once: one per CPU this process may
    run on, at most one per setting. XLA compiles a program on about one core and releases
    the GIL meanwhile, so on 2 cores two searches take about the time of one (tracing, in
    Python, is the part they take in turn)."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)                      # macOS: no affinity mask
    return max(1, min(settings, cores))


def _say(line: str) -> None:
    """A progress line to stderr in one write: the searching threads' lines never mix."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def max_seq_len_report(config: Any, mesh: Any, plan: PlanSettings, dtype: str,
                       say: Callable[[str], None] = lambda line: None,
                       workers: int | None = None) -> str:
    """The largest T per setting (`planner.sweep_settings`), one line each, by compile only
    (`planner.largest_under`: a few compiles per setting), `workers` settings searched at once
    (`search_workers` by default; each setting's search, and so its answer, is the same at
    any count). `say` gets a line per compile and one at the end (the command prints them to
    stderr as they come: each compile takes seconds), from the searching threads."""
    from zeroxla.analysis.planner import REMAT_SWEEP, sweep_settings

    settings, missing = sweep_settings(config, plan.remat or REMAT_SWEEP, plan.attention)
    workers = max(1, min(len(settings), workers or search_workers(len(settings))))
    start, stop, shared = time.perf_counter(), threading.Event(), _SharedCompiles()
    pool = ThreadPoolExecutor(workers)
    try:
        found = list(pool.map(
            lambda numbered: _search_setting(config, mesh, plan, dtype, say, stop, shared,
                                             *numbered, len(settings)),
            enumerate(settings, 1)))
    finally:                 # Ctrl-C or a failed compile: the other searches end at their next
        stop.set()           # compile, not after the rest of their settings
        pool.shutdown(cancel_futures=True)
    tried = sum(len(peaks) for _, peaks in found)
    say(f"  {shared.compiles} compiles, {workers} setting(s) at a time, "
        f"in {time.perf_counter() - start:.0f} s"
        + (f" ({tried - shared.compiles} of the {tried} lengths tried built a program another "
           "setting compiled: not compiled again)" if tried > shared.compiles else ""))
    lines = [f"{plan.model}, ZeRO-{plan.stage}, {plan.dtype}, {plan.mesh_label}, "
             f"{plan.device_memory / 2**30:.1f} GiB per device, "
             f"{plan.sequences_per_device} sequence(s) per data replica: largest T that fits"]
    for setting, (best, peaks) in zip(settings, found):
        note = ""
        if best:
            f = peaks[best]
            note = (f" (peak {f.peak / 2**30:.2f} GiB"
                    + (f", {f.host_residuals / 2**30:.2f} GiB activations in host memory"
                       if f.host_residuals else "")
                    + (", derived" if f.derived else "") + ")")
        lines.append(f"  {setting.label:<40} T = {best}{note}"
                     + (f" (limit {plan.search_limit})" if best == plan.search_limit else ""))
    for field in missing:
        lines.append(f"  not swept: {type(config).__name__} has no field {field!r} (not built)")
    return "\n".join(lines)


class _SharedCompiles:
    """The figures of each program the report's searches compile, shared by their threads:
    settings that build the same program at a length (`planner.Setting.program_at`: e.g.
    `mlp_chunk` None and 4096 at T <= 4096, both untiled) compile it once, and a search that
    needs a program another is compiling waits for it. Each search still tries the lengths it
    would alone, so its answer is unchanged."""

    def __init__(self):
        self._lock = threading.Lock()
        self._figures: dict[tuple[Any, int], Future] = {}
        self.compiles = 0

    def get(self, key: tuple[Any, int], compile_figures: Callable[[], Any]) -> tuple[Any, bool]:
        """(the figures of `key`, (program setting, T), whether this call compiled them)."""
        with self._lock:
            future = self._figures.get(key)
            compiling = future is None
            if compiling:
                future = self._figures[key] = Future()
                self.compiles += 1
        if compiling:
            try:
                future.set_result(compile_figures())
            except BaseException as error:       # the waiting searches raise it too
                future.set_exception(error)
                raise
        return future.result(), compiling


def _search_setting(config: Any, mesh: Any, plan: PlanSettings, dtype: str,
                    say: Callable[[str], None], stop: threading.Event, shared: _SharedCompiles,
                    number: int, setting: Any, count: int) -> tuple[int, dict[int, Any]]:
    """(the largest T that fits under `setting`, the figures of every T tried for it); stops
    before its next compile once `stop` is set."""
    from zeroxla.analysis.planner import largest_under, plan_memory

    peaks: dict[int, Any] = {}

    def peak(t: int) -> int:
        if stop.is_set():
            raise RuntimeError(f"{setting.label}: search stopped before T={t}")
        start = time.perf_counter()
        figures, compiled = shared.get((setting.program_at(t), t), lambda: plan_memory(
            config, mesh, seq_len=t, device_memory=plan.device_memory, stage=plan.stage,
            dtype=dtype, remat=setting.remat, fields=dict(setting.fields),
            sequences_per_device=plan.sequences_per_device, zero=plan.zero))
        how = (f"compiled in {time.perf_counter() - start:.0f} s" if compiled else
               f"the program of {figures.setting} at this length: not compiled again")
        figures = dataclasses.replace(figures, setting=setting.label)
        peaks[t] = figures
        say(f"  [{number}/{count}] {setting.label}: T={t} peak "
            f"{figures.peak / 2**30:.2f} GiB, {'fits' if figures.fits else 'does not fit'} "
            f"({how})")
        return figures.peak
    best = largest_under(peak, plan.device_memory, granularity=plan.granularity,
                         limit=plan.search_limit)
    return best, peaks


__all__ = ["OPTIONS", "PlanSettings", "add_plan", "max_seq_len_report", "memory_size",
           "model_config", "plan_settings", "remat_list", "run_plan", "search_workers"]
