"""What fits: a ZeRO step's per-device memory for a model shape, by compile only (`zeroxla plan`).

    figures = plan_memory(models.presets.config("Llama-3.1-8B"), make_mesh(1, 8),
                          seq_len=32768, device_memory=80 * 2**30, remat="full")
    print(figures.table())
    largest_fitting(lambda t: plan_memory(..., seq_len=t).fits)      # binary search over T
    largest_under(lambda t: plan_memory(..., seq_len=t).peak, 80 * 2**30)   # the same T, in
                                                        # about 4 compiles (the line's crossing)

Each figure is the compiled step's (`abstract_step.compile_abstract`: the step `make_step`
builds, traced on abstract arrays, nothing allocated), per device:

    state          from the state's shapes and shardings: float32 masters, 16-bit compute
                   copies, optimizer state (`abstract_step.state_bytes`)
    arguments      XLA's `memory_analysis()`: the state and the batch as the program takes them
    temporaries    XLA's temp buffers: activations, gathered layers, gradients, logits
    outputs        the new state and metrics; `aliased` of them reuse the donated state
    peak           arguments + temporaries + outputs - aliased (`MemoryReport.peak_estimate`)

Host memory is never counted in the device figure; it is printed apart: state ZeRO-Offload keeps
in a host memory kind, and the residuals remat "offload" moves there (`host_residuals`). Where
the platform places values in host memory inside a program (GPU, TPU: XLA reports them as
`host_temp_size_in_bytes`), the compiled figures already leave them out. XLA:CPU has one memory:
it compiles a host placement inside a program as nothing (jax lowers it to no op there), so its
temporaries still hold them; on CPU the device figure is the compiled one less the host
residuals counted from the program, plus one layer's of them (backward brings the layer it
differentiates back to the device, which XLA:CPU does as nothing), and says so (`derived`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from zeroxla import models
from zeroxla.analysis.abstract_step import abstract_state, state_bytes, trace_abstract
from zeroxla.analysis.host_residuals import host_residual_bytes, host_residual_layer_bytes
from zeroxla.make import make_step
from zeroxla.models.tiled_mlp import effective_chunk
from zeroxla.sharding.config import ZeroConfig

GiB = 2**30
# Platforms whose XLA keeps a host placement made inside a program (jax lowers device_put to a
# memory kind only for these; `jax._src.dispatch`).
PLACING_PLATFORMS = ("cuda", "rocm", "gpu", "tpu")
# The activation policies `--max-seq-len` tries by default: "none" keeps every activation that
# "full" keeps and more, so it never fits a longer T (`--remat none,full,offload` adds it).
REMAT_SWEEP = ("full", "offload")
# XLA:CPU compiles the planned program without LLVM's optimizations: the buffers (what
# `memory_analysis` reports) are assigned before code is generated, so the figures are the
# default compile's (tests/zeroxla/analysis/test_planner.py), in about 60% of the time.
CPU_PLAN_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class PlanFigures:
    """Per-device bytes of one compiled step (see the module docstring)."""

    seq_len: int
    sequences_per_device: int
    setting: str                 # e.g. "remat=full"
    state: Mapping[str, int]     # `abstract_step.state_bytes`
    arguments: int
    temporaries: int             # device temporaries (less host residuals where `derived`)
    outputs: int
    aliased: int
    host_residuals: int          # remat "offload": activations kept in host memory
    derived: bool                # the host residuals were subtracted from XLA:CPU's figure
    device_memory: int

    @property
    def device_state(self) -> int:
        return sum(v for k, v in self.state.items() if not k.startswith("host_"))

    @property
    def host_state(self) -> int:
        return sum(v for k, v in self.state.items() if k.startswith("host_"))

    @property
    def peak(self) -> int:
        """Device bytes at the step's peak: live arguments + temporaries + non-aliased outputs."""
        return self.arguments + self.temporaries + self.outputs - self.aliased

    @property
    def fits(self) -> bool:
        return self.peak <= self.device_memory

    def table(self) -> str:
        """The figures as a readable table, GiB per device."""
        s = self.state
        rows = [("float32 master weights", s["master"]),
                ("16-bit compute copies", s["compute_copy"]),
                ("optimizer state", s["optimizer"]),
                ("state (between steps)", self.device_state),
                ("batch and other arguments", self.arguments - self.device_state),
                ("activations and temporaries" + (" (derived)" if self.derived else ""),
                 self.temporaries),
                ("outputs not aliased", self.outputs - self.aliased),
                ("peak", self.peak), ("device memory", self.device_memory)]
        lines = [f"{self.setting}, T={self.seq_len}, {self.sequences_per_device} sequence(s) "
                 "per data replica: per-device GiB"]
        lines += [f"  {name:<38}{value / GiB:>10.3f}" for name, value in rows]
        lines.append(f"  {'fits':<38}{'yes' if self.fits else 'no':>10}")
        if self.host_state or self.host_residuals:
            lines.append("  host memory, not in the device figure:")
            lines.append(f"    {'state (ZeRO-Offload)':<36}{self.host_state / GiB:>10.3f}")
            lines.append(f"    {'activations (remat offload)':<36}"
                         f"{self.host_residuals / GiB:>10.3f}")
        if self.derived:
            lines.append("  (derived: XLA:CPU keeps host placements in its one memory; the "
                         "activations above are its temporaries less the host residuals, but "
                         "one layer's, back on the device for its backward)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Settings: what the sweep varies, as far as the model config has the field.
@dataclasses.dataclass(frozen=True)
class Setting:
    """One activation setting: a remat policy and model-config fields to override."""

    remat: str
    fields: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return ", ".join([f"remat={self.remat}", *(f"{k}={v}" for k, v in self.fields)])

    def program_at(self, seq_len: int) -> Setting:
        """This setting as the model builds it at `seq_len` tokens: `mlp_chunk` at the chunk
        the tiled MLP runs in (`models.tiled_mlp.effective_chunk`: None once the chunk holds
        every token). Two settings equal here compile the same program at that length."""
        return Setting(self.remat, tuple(
            (k, effective_chunk(v, seq_len) if k == "mlp_chunk" else v) for k, v in self.fields))


# Model-config fields the sweep varies when the config has them (models/ adds them): the field,
# and its values besides the config's own. "mlp_chunk": tiled MLP (ALST's TiledMLP) off and on.
# Attention paths besides the config's own are swept only when asked (`sweep_settings`'s
# `attention`): the naive path's scores are O(T^2), never the longest T.
SWEPT_FIELDS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("mlp_chunk", (None, 4096)),
)


def config_fields(model_config: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(model_config)}


def sweep_settings(model_config: Any, remats: tuple[str, ...] = REMAT_SWEEP,
                   attention: tuple[str, ...] = ()) -> tuple[list[Setting], list[str]]:
    """(the settings `--max-seq-len` tries, the swept fields this config does not have):
    every remat policy x each value of `SWEPT_FIELDS` (and the `attention` paths, beside the
    config's own, when given)."""
    have = config_fields(model_config)
    options: list[list[tuple[str, Any]]] = [[]]
    missing = []
    swept = SWEPT_FIELDS + ((("attention", attention),) if attention else ())
    for field, values in swept:
        if field not in have:
            missing.append(field)
            continue
        own = getattr(model_config, field)
        choices = list(dict.fromkeys((own, *values)))
        options = [[*o, (field, v)] for o in options for v in choices]
    return [Setting(r, tuple(o)) for r in remats for o in options], missing


# ----------------------------------------------------------------------------------------------
def model_factory(model_config: Any) -> Callable[[], nnx.Module]:
    """A zero-argument factory of the config's model: `make_step` evaluates it abstractly."""
    cls = models.model_class(model_config)
    return lambda: cls(model_config, rngs=nnx.Rngs(0))


def at_length(model_config: Any, seq_len: int) -> Any:
    """The config with max_seq_len at least `seq_len`: memory does not depend on it, and a
    shape is planned past the positions a checkpoint was trained for all the same."""
    return (model_config if seq_len <= model_config.max_seq_len
            else model_config.replace(max_seq_len=seq_len))


def plan_memory(model_config: Any, mesh: Mesh, *, seq_len: int, device_memory: int,
                stage: int = 3, dtype: str = "bfloat16", remat: str = "full",
                fields: Mapping[str, Any] | None = None, sequences_per_device: int = 1,
                zero: Mapping[str, Any] | None = None) -> PlanFigures:
    """The compiled step's per-device figures for `seq_len` tokens per sequence,
    `sequences_per_device` sequences on each data-parallel device (`fields`: model-config
    overrides; `zero`: further `ZeroConfig` fields)."""
    config = at_length(model_config, seq_len)
    if fields:
        unknown = sorted(set(fields) - config_fields(config))
        if unknown:
            raise ValueError(f"{type(config).__name__} has no field {unknown[0]!r}; accepted: "
                             f"{', '.join(sorted(config_fields(config)))}")
        config = config.replace(**fields)
    zero_config = ZeroConfig(stage=stage, compute_dtype=dtype, remat=remat, **dict(zero or {}))
    step = make_step(model_factory(config), mesh, config=zero_config)
    traced = trace_abstract(step, sequences_per_device * step.layout.data_size, seq_len)
    platform = mesh.devices.flat[0].platform
    compiled = traced.lower().compile(
        compiler_options=CPU_PLAN_OPTIONS if platform == "cpu" else None)
    analysis = compiled.memory_analysis()
    host = host_residual_bytes(traced)
    derived = bool(host) and platform not in PLACING_PLATFORMS
    temporaries = int(analysis.temp_size_in_bytes) - (
        host - host_residual_layer_bytes(traced) if derived else 0)
    setting = Setting(remat, tuple((fields or {}).items())).label
    return PlanFigures(seq_len=seq_len, sequences_per_device=sequences_per_device,
                       setting=setting, state=state_bytes(abstract_state(step)),
                       arguments=int(analysis.argument_size_in_bytes), temporaries=temporaries,
                       outputs=int(analysis.output_size_in_bytes),
                       aliased=int(analysis.alias_size_in_bytes),
                       host_residuals=host if derived else
                       int(getattr(analysis, "host_temp_size_in_bytes", 0) or host),
                       derived=derived, device_memory=device_memory)


def largest_fitting(fits: Callable[[int], bool], *, granularity: int = 1024,
                    limit: int = 1 << 21) -> int:
    """The largest multiple of `granularity` up to `limit` for which `fits` holds, for a `fits`
    that holds up to some length and not beyond (memory grows with T); 0 when even
    `granularity` does not fit. Doubles from `granularity` until a length does not fit, then
    bisects: about 2 log2(answer / granularity) calls."""
    if granularity < 1 or limit < granularity:
        raise ValueError(f"largest_fitting: granularity={granularity}, limit={limit}; accepted: "
                         "1 <= granularity <= limit")
    top = limit // granularity                  # in units of granularity
    if not fits(granularity):
        return 0
    lo = 1                                      # fits
    while lo < top:
        probe = min(2 * lo, top)
        if not fits(probe * granularity):
            hi = probe                          # does not fit
            break
        lo = probe
    else:
        return lo * granularity
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * granularity):
            lo = mid
        else:
            hi = mid
    return lo * granularity


def largest_under(peak: Callable[[int], int], device_memory: int, *, granularity: int = 1024,
                  limit: int = 1 << 21) -> int:
    """`largest_fitting` of `peak(t) <= device_memory`, in fewer calls: the same answer for a
    `peak` that grows with T (the largest multiple of `granularity` up to `limit` that fits;
    0 when even `granularity` does not), each length tried chosen where the line through the
    two tried nearest the boundary crosses `device_memory` (a compile's peak is close to
    affine in T), bisecting when that stalls. It ends, as the bisection does, on a length that
    fits beside one `granularity` longer that does not (or on `limit`)."""
    if granularity < 1 or limit < granularity:
        raise ValueError(f"largest_under: granularity={granularity}, limit={limit}; accepted: "
                         "1 <= granularity <= limit")
    top, seen = limit // granularity, {}                  # in units of granularity

    def fits(unit: int) -> bool:
        seen[unit] = peak(unit * granularity)
        return seen[unit] <= device_memory
    if not fits(1):
        return 0
    lo, hi, probe = 1, top + 1, min(top, 8)               # lo fits; hi does not (top + 1: none)
    run, last = 0, None                                   # run: moves of one end in a row
    while hi - lo > 1:
        probe = min(max(probe, lo + 1), hi - 1)
        side = fits(probe)
        run, last = (run + 1 if side == last else 1), side
        lo, hi = (probe, hi) if side else (lo, probe)
        if run > 4:                    # the line keeps missing on one side: halve, or double
            probe = (lo + hi) // 2 if hi <= top else min(top, 2 * lo)
        else:
            probe = _crossing(seen, lo, hi, top, device_memory, run if side else -run)
    return lo * granularity


def _crossing(seen: Mapping[int, int], lo: int, hi: int, top: int, device_memory: int,
              run: int) -> int:
    """The unit where the line through the two tried lengths nearest the boundary (`lo`,
    which fits, and `hi`, which does not, or the one tried below `lo`) reaches
    `device_memory`, rounded down (past every tried length: one unit past it, so that the
    next length tried, if the line was right, is the last). `run`: the moves of `lo` (> 0) or
    of `hi` (< 0) in a row; from the second, the other end's distance to `device_memory` is
    halved per move (the Illinois rule: a curved peak would otherwise move one end only)."""
    below = max((u for u in seen if u < lo), default=None)
    if hi not in seen:
        if below is None or seen[lo] <= seen[below]:
            return min(top, 2 * lo)
        slope = (seen[lo] - seen[below]) / (lo - below)
        return min(top, lo + int((device_memory - seen[lo]) // slope) + 1)
    under, over = device_memory - seen[lo], seen[hi] - device_memory        # both >= 0
    over, under = (over / 2 ** max(run - 1, 0), under / 2 ** max(-run - 1, 0))
    return lo + int(under * (hi - lo) // (under + over)) if under + over > 0 else lo
__all__ = ["PlanFigures", "REMAT_SWEEP", "SWEPT_FIELDS", "Setting", "largest_fitting",
           "largest_under", "model_factory", "plan_memory", "sweep_settings"]
