"""How many bytes each device sends per training step, read from the compiled program.

`comm_report(step, state, batch)` compiles the step, lists its collectives (`zeroxla.hlo`) and
charges each one to the devices that send, split into intra-node and cross-node bytes by the
`node` coordinate of the mesh, and grouped by collective kind and by ZeRO phase.

Convention (the one ZeRO / ZeRO++ papers use for communication volume):
- A collective over a group of g devices with full payload S exchanges S/g with each of its
  g-1 peers, so each device sends S/g x (g-1). S is the gathered OUTPUT of an all-gather, the
  INPUT of a reduce-scatter, the operand of an all-to-all, the operand of an all-reduce.
- An all-reduce counts twice (reduce-scatter then all-gather): 2 x S/g x (g-1) per device.
- A collective-permute sends its whole operand S from each source to its one target (a device
  that is its own target sends nothing).
- A peer whose mesh coordinate along "node" differs is cross-node; the rest are intra-node.
- A collective inside loops counts once per iteration (`Collective.multiplier`).
- A collective inside a branch that only some steps of a loop take counts as often as the
  branch runs, when the step says how often (`branch_executions()`, the pipeline executor's:
  every stage runs M forwards and M backwards per step, and each pattern of sends as often as
  the schedule has it, inside the loops over the schedule's steps). Other branches of
  `lax.cond` / `lax.switch` count as if taken (an upper bound).
- Bytes are per device: averaged over the mesh's devices, and for the busiest device (max).
- The phase is the innermost of the engine's `jax.named_scope` names ("zero_fwd_gather",
  "zero_bwd_gather", "zero_grad_reduce", "zero_param_update") found in the collective's
  `op_name`, else "other". Innermost, not outermost: JAX writes the backward of code that ran
  under a scope as `transpose(jvp(zero_fwd_gather))/zero_grad_reduce/reduce_scatter`, so the
  first name in the string is the forward's, the last one is the scope the op was emitted in.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from zeroxla.analysis.hlo import KINDS, Collective, collectives
from zeroxla.engine.step import ZeroStep
from zeroxla.sharding.mesh import NODE_AXIS

PHASES = ("zero_fwd_gather", "zero_bwd_gather", "zero_grad_reduce", "zero_param_update")
OTHER = "other"

_PHASE = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(PHASES) + r")(?![A-Za-z0-9_])")


def phase_of(op_name: str) -> str:
    """The innermost ZeRO phase scope named in `op_name`, or "other"."""
    found = _PHASE.findall(op_name)
    return found[-1] if found else OTHER


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes sent per device: averages over the devices, and the busiest device's."""

    intra_node: float
    cross_node: float
    max_intra_node: float
    max_cross_node: float
    max_total: float

    @property
    def total(self) -> float:
        return self.intra_node + self.cross_node

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True, eq=False)
class CollectiveTraffic:
    """One collective, its phase, and the bytes each device sends for it per step."""

    collective: Collective
    phase: str
    intra_node: np.ndarray  # [devices], all executions
    cross_node: np.ndarray  # [devices]
    executions: Fraction = Fraction(1)    # per step: the multiplier, x a branch's share


@dataclasses.dataclass(frozen=True, eq=False)
class CommReport:
    """Per-device communication of one program run; see the module docstring for the rules."""

    entries: tuple[CollectiveTraffic, ...]
    mesh_shape: dict[str, int]
    # Per partitioned parameter (when built from a training step): (path, forward gather,
    # backward gather, gradient reduction), e.g. which gradients qgZ quantizes and which fall
    # back to a plain reduce-scatter.
    parameters: tuple[tuple[str, str, str, str], ...] = ()

    @property
    def num_devices(self) -> int:
        return int(np.prod(list(self.mesh_shape.values())))

    @property
    def collectives(self) -> tuple[Collective, ...]:
        return tuple(entry.collective for entry in self.entries)

    # -- bytes sent per device --------------------------------------------------------------

    def traffic(self, kind: str | None = None, phase: str | None = None) -> Traffic:
        """Per-device bytes of the collectives of `kind` in `phase` (None: all)."""
        chosen = self._select(kind, phase)
        intra = sum((entry.intra_node for entry in chosen), np.zeros(self.num_devices))
        cross = sum((entry.cross_node for entry in chosen), np.zeros(self.num_devices))
        return Traffic(float(intra.mean()), float(cross.mean()), float(intra.max(initial=0)),
                       float(cross.max(initial=0)), float((intra + cross).max(initial=0)))

    @property
    def intra_node_bytes(self) -> float:
        """Bytes each device sends to devices of its own node, averaged over devices."""
        return self.traffic().intra_node

    @property
    def cross_node_bytes(self) -> float:
        """Bytes each device sends to other nodes, averaged over devices."""
        return self.traffic().cross_node

    @property
    def total_bytes(self) -> float:
        return self.traffic().total

    @property
    def bytes_by_kind(self) -> dict[str, Traffic]:
        return {kind: self.traffic(kind=kind) for kind in self._kinds()}

    @property
    def bytes_by_phase(self) -> dict[str, Traffic]:
        return {phase: self.traffic(phase=phase) for phase in self._phases()}

    # -- payload ("traffic" as full payload S x executions) ----------------------------------

    def payload_bytes(self, kind: str, phase: str | None = None) -> int | float:
        """Sum of S x executions over the collectives of `kind` (in `phase`, if given)."""
        return _number(sum((entry.collective.payload_bytes * entry.executions
                            for entry in self._select(kind, phase)), Fraction(0)))

    def all_gather_bytes(self, phase: str | None = None) -> int:
        """Gathered-output bytes of all all-gathers, x multiplier."""
        return self.payload_bytes("all-gather", phase)

    def reduce_scatter_bytes(self, phase: str | None = None) -> int:
        """Input bytes of all reduce-scatters, x multiplier."""
        return self.payload_bytes("reduce-scatter", phase)

    def all_reduce_bytes(self, phase: str | None = None) -> int:
        """Operand bytes of all all-reduces, x multiplier."""
        return self.payload_bytes("all-reduce", phase)

    def all_to_all_bytes(self, phase: str | None = None) -> int:
        """Operand bytes of all all-to-alls, x multiplier."""
        return self.payload_bytes("all-to-all", phase)

    def collective_permute_bytes(self, phase: str | None = None) -> int:
        """Operand bytes of all collective-permutes, x multiplier."""
        return self.payload_bytes("collective-permute", phase)

    def count(self, kind: str | None = None, phase: str | None = None) -> int | float:
        """Executions per run (sum of `executions`) of the collectives of `kind` in `phase`."""
        return _number(sum((entry.executions for entry in self._select(kind, phase)),
                           Fraction(0)))

    # -- output ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable summary: totals, by kind, by phase, and every collective."""
        return {
            "mesh": dict(self.mesh_shape),
            "devices": self.num_devices,
            "total": self.traffic().to_dict(),
            "by_kind": {kind: t.to_dict() for kind, t in self.bytes_by_kind.items()},
            "by_phase": {phase: t.to_dict() for phase, t in self.bytes_by_phase.items()},
            "payload_bytes": {kind: self.payload_bytes(kind) for kind in self._kinds()},
            "collectives": [_entry_dict(entry) for entry in self.entries],
            "parameters": [dict(zip(("path", "forward_gather", "backward_gather",
                                     "gradient_reduction"), row)) for row in self.parameters],
        }

    def table(self) -> str:
        """A fixed-width table: one row per (phase, kind), then the total."""
        header = (f"{'phase':<18} {'kind':<19} {'runs':>5} {'payload S':>11} "
                  f"{'intra/dev':>11} {'cross/dev':>11} {'max/dev':>11}")
        lines = [f"communication per step, per device, mesh {self.mesh_shape}", header,
                 "-" * len(header)]
        for phase in self._phases():
            for kind in self._kinds(phase):
                lines.append(self._row(phase, kind, phase, kind))
        lines.append("-" * len(header))
        lines.append(self._row("total", "", None, None))
        if self.parameters:
            widths = [max(len(row[i]) for row in self.parameters) for i in range(4)]
            lines += ["", "per parameter (forward gather / backward gather / gradient reduction):"]
            lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                      for row in self.parameters]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _row(self, phase_label: str, kind_label: str, phase: str | None, kind: str | None
             ) -> str:
        traffic = self.traffic(kind, phase)
        payload = sum(self.payload_bytes(k, phase) for k in ([kind] if kind else KINDS))
        return (f"{phase_label:<18} {kind_label:<19} {self.count(kind, phase):>5} "
                f"{_human(payload):>11} {_human(traffic.intra_node):>11} "
                f"{_human(traffic.cross_node):>11} {_human(traffic.max_total):>11}")

    def _select(self, kind: str | None, phase: str | None) -> list[CollectiveTraffic]:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; use one of {KINDS}")
        if phase is not None and phase not in (*PHASES, OTHER):
            raise ValueError(f"unknown phase {phase!r}; use one of {(*PHASES, OTHER)}")
        return [entry for entry in self.entries
                if kind in (None, entry.collective.kind) and phase in (None, entry.phase)]

    def _kinds(self, phase: str | None = None) -> list[str]:
        present = {entry.collective.kind for entry in self._select(None, phase)}
        return [kind for kind in KINDS if kind in present]

    def _phases(self) -> list[str]:
        present = {entry.phase for entry in self.entries}
        return [phase for phase in (*PHASES, OTHER) if phase in present]


def _entry_dict(entry: CollectiveTraffic) -> dict[str, Any]:
    c = entry.collective
    return {"kind": c.kind, "name": c.name, "computation": c.computation, "phase": entry.phase,
            "op_name": c.op_name, "multiplier": c.multiplier,
            "executions": _number(entry.executions), "group_size": c.group_size,
            "payload_bytes": c.payload_bytes, "is_async": c.is_async,
            "intra_node_bytes": float(entry.intra_node.mean()),
            "cross_node_bytes": float(entry.cross_node.mean())}


def _number(value: Fraction) -> int | float:
    """An exact sum of executions as an int when whole (it is, summed over a whole branch)."""
    return int(value) if value.denominator == 1 else float(value)


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# Building a report


def comm_report(step_or_compiled: Any, *args: Any, mesh: Mesh | None = None) -> CommReport:
    """The per-device communication of one run of a compiled program.

    `step_or_compiled` is one of: a `ZeroStep` (compiled for `args`; its `layout.mesh` is used
    when `mesh` is None, and its parameters' collectives are listed), an object with
    `.lower(*args)` (a jitted function), a `jax.stages.Lowered`, a `jax.stages.Compiled`, or HLO
    text. `mesh` is the mesh the program was compiled for; the ids in its collectives are
    positions in `mesh.devices.flat`.
    """
    step = step_or_compiled if isinstance(step_or_compiled, ZeroStep) else None
    compiled = _compiled(step_or_compiled, args)
    if mesh is None and step is not None:
        mesh = step.layout.mesh
    if mesh is None:
        mesh = _mesh_from_shardings(compiled)
    if mesh is None:
        raise ValueError("comm_report needs the mesh the program was compiled for: pass mesh=, "
                         "or a ZeroStep")
    _check_device_order(compiled, mesh)
    pipeline = step.pipeline if step is not None else None
    branches = pipeline.branch_executions() if hasattr(pipeline, "branch_executions") else {}
    report = report_from_collectives(collectives(compiled), mesh, branches)
    if step is None:
        return report
    return dataclasses.replace(report, parameters=tuple(step.describe_collectives()))


def report_from_collectives(found: Iterable[Collective], mesh: Mesh,
                            branches: Mapping[str, tuple[int, int]] | None = None
                            ) -> CommReport:
    """A `CommReport` of already parsed collectives, for the devices of `mesh`.

    `branches` maps a `jax.named_scope` name to (how many times the compiled loops run the code
    under it, how many times a device really runs it per step): a collective whose `op_name`
    names the scope counts the second over the first of its multiplier (see the module
    docstring)."""
    node_of = _node_of_device(mesh)
    entries = []
    for collective in found:
        share = Fraction(1)
        for scope, (compiled, runs) in (branches or {}).items():
            if re.search(rf"(?<![A-Za-z0-9_]){re.escape(scope)}(?![A-Za-z0-9_])",
                         collective.op_name):
                share = Fraction(runs, compiled)
                break
        intra, cross = _sent_bytes(collective, node_of)
        entries.append(CollectiveTraffic(collective, phase_of(collective.op_name),
                                         intra * float(share), cross * float(share),
                                         collective.multiplier * share))
    return CommReport(tuple(entries), dict(mesh.shape))


def _compiled(obj: Any, args: tuple[Any, ...]) -> Any:
    if hasattr(obj, "lower") and callable(getattr(obj, "compile", None)):
        return obj.compile(*args)                    # a training step: its cached executable
    if hasattr(obj, "lower") and not isinstance(obj, str):
        return obj.lower(*args).compile()
    if args:
        raise TypeError("comm_report: positional args are for an object with .lower(*args); "
                        f"got a {type(obj).__name__}")
    if isinstance(obj, str):
        return obj
    if hasattr(obj, "compile"):  # jax.stages.Lowered
        return obj.compile()
    if hasattr(obj, "as_text"):
        return obj
    raise TypeError(f"comm_report: cannot get a compiled program from a {type(obj).__name__}; "
                    "pass a jitted function with its arguments, a Lowered or a Compiled")


def _mesh_from_shardings(compiled: Any) -> Mesh | None:
    shardings = getattr(compiled, "input_shardings", None)
    for sharding in jax.tree.leaves(shardings):
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def _check_device_order(compiled: Any, mesh: Mesh) -> None:
    """Raises when the program's device assignment is not `mesh.devices.flat` in order."""
    try:
        devices = list(compiled.runtime_executable().local_devices())
    except Exception:  # text, or a runtime without this query: nothing to check against
        return
    if len(devices) == mesh.devices.size and devices != list(mesh.devices.flat):
        raise ValueError(f"the program was compiled for devices {devices}, but the mesh lists "
                         f"{list(mesh.devices.flat)}; pass the mesh it was compiled with")


def _node_of_device(mesh: Mesh) -> np.ndarray:
    """Node index of each position of `mesh.devices.flat` (all 0 without a "node" axis)."""
    if NODE_AXIS not in mesh.axis_names:
        return np.zeros(mesh.devices.size, dtype=int)
    axis = list(mesh.axis_names).index(NODE_AXIS)
    return np.indices(mesh.devices.shape)[axis].reshape(-1)


def _sent_bytes(collective: Collective, node_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each device sends for `collective` over all its executions: (intra, cross)."""
    intra, cross = np.zeros(len(node_of)), np.zeros(len(node_of))
    ids = [i for group in collective.device_groups for i in group]
    ids += [i for pair in collective.device_pairs for i in pair]
    if ids and max(ids) >= len(node_of):
        raise ValueError(f"{collective.kind} %{collective.name} names device {max(ids)}, but the "
                         f"mesh has {len(node_of)} devices; pass the mesh it was compiled for")
    payload = collective.payload_bytes
    if collective.kind == "collective-permute":
        for source, target in collective.device_pairs:
            if source != target:
                sent = cross if node_of[source] != node_of[target] else intra
                sent[source] += payload
    else:
        per_peer = payload / collective.group_size * (2 if collective.kind == "all-reduce" else 1)
        for group in collective.device_groups:
            nodes = node_of[list(group)]
            for device, node in zip(group, nodes):
                cross_peers = int(np.sum(nodes != node))
                intra[device] += per_peer * (len(group) - 1 - cross_peers)
                cross[device] += per_peer * cross_peers
    return intra * collective.multiplier, cross * collective.multiplier
