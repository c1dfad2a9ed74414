"""How many times each computation of an HLO module runs per program execution.

A collective inside the body of a `while` loop (from `lax.scan` / `fori_loop`) runs once per
iteration, so its bytes count trip-count times. Loops carry `"known_trip_count":{"n":"5"}` in their
backend_config; without it the trip count is inferred from a loop condition `counter < constant`
with a constant start and step, else `UnknownTripCountError` is raised, but only for loops around
collectives: the counts of the rest are never needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from zeroxla.analysis.hlo_text import (Computation, HloModule, HloParseError, Instruction,
                                       collective_kind)

# Single-operand ops that do not change a value, for tracing loop counters.
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


class UnknownTripCountError(HloParseError):
    """A while loop that contains collectives has no known trip count."""


def execution_counts(module: HloModule) -> dict[str, int]:
    """Runs per program execution of the computations reachable from ENTRY.

    A while body runs trip-count times per run of its caller (its condition once more); other
    called computations once per call, summed over call sites. Both branches of a conditional
    are counted as taken (an upper bound). The `-done` / `-update` halves of an async pair are
    not calls. Counts are exact for computations that hold collectives (directly or through
    calls); the rest get their first caller's count, so trip counts are only needed, and only
    required, for loops around collectives.
    """
    has_collective = _contains_collective(module)
    counts = {module.entry: 1}
    for name in _callers_first(module):
        computation = module.computations[name]
        for instr in computation.instructions:
            for attr, callee in _calls(instr):
                if not has_collective.get(callee, False):
                    counts.setdefault(callee, counts[name])
                    continue
                factor = 1
                if instr.opcode == "while" and attr in ("body", "condition"):
                    trips = trip_count(module, computation, instr)
                    factor = trips if attr == "body" else trips + 1
                counts[callee] = counts.get(callee, 0) + counts[name] * factor
    return counts


def _calls(instr: Instruction) -> tuple[tuple[str, str], ...]:
    if instr.opcode.endswith("-done") or instr.opcode.endswith("-update"):
        return ()
    return instr.called_computations()


def _callers_first(module: HloModule) -> list[str]:
    """Computations reachable from ENTRY, every caller before its callees."""
    order, seen = [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        if name not in module.computations:
            raise HloParseError(f"called computation %{name} is not in the module")
        seen.add(name)
        for instr in module.computations[name].instructions:
            for _, callee in _calls(instr):
                visit(callee)
        order.append(name)

    visit(module.entry)
    return order[::-1]


def branch_collectives(module: HloModule) -> tuple[str, ...]:
    """The `conditional`s reachable from ENTRY whose branches hold a collective (directly or
    through calls), by instruction name. A collective there runs on the devices whose data
    take that branch only: with data-dependent predicates (an MoE layer's skipped tiles) the
    devices could disagree on it and hang. Empty: every device runs the program's collectives
    whatever its data."""
    holds = _contains_collective(module)
    found = []
    for name in _callers_first(module):
        for instr in module.computations[name].instructions:
            if instr.opcode == "conditional" and any(holds.get(callee, False)
                                                     for _, callee in _calls(instr)):
                found.append(instr.name)
    return tuple(found)


def _contains_collective(module: HloModule) -> dict[str, bool]:
    """Whether each computation, or anything it calls, holds a collective."""
    memo: dict[str, bool] = {}

    def visit(name: str) -> bool:
        if name not in module.computations:
            raise HloParseError(f"called computation %{name} is not in the module")
        if name not in memo:
            memo[name] = False
            instrs = module.computations[name].instructions
            holds = any(collective_kind(instr.opcode)[0] is not None for instr in instrs)
            memo[name] = holds or any(visit(callee) for instr in instrs
                                      for _, callee in _calls(instr))
        return memo[name]

    for name in module.computations:
        visit(name)
    return memo


_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def trip_count(module: HloModule, computation: Computation, loop: Instruction) -> int:
    """Trip count of a `while`: `known_trip_count` from its backend_config, else inferred from
    a condition `counter < constant` with a constant start and step; else raises."""
    known = _TRIP_COUNT.search(loop.attrs.get("backend_config", ""))
    if known:
        return int(known.group(1))
    inferred = _infer_trip_count(module, computation, loop)
    if inferred is None:
        raise UnknownTripCountError(
            f"while loop %{loop.name} in %{computation.name} (op_name={loop.op_name!r}) contains "
            f"collectives but has no known_trip_count in its backend_config, and its condition "
            f"{loop.attrs.get('condition')} is not `counter < constant` with constant start and "
            f"step; its communication cannot be counted. Give the loop static bounds "
            f"(lax.scan, or lax.fori_loop with Python int bounds).")
    return inferred


_FLIPPED = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def _infer_trip_count(module: HloModule, computation: Computation, loop: Instruction
                      ) -> int | None:
    condition = module.computations[loop.attrs["condition"].lstrip("%")]
    body = module.computations[loop.attrs["body"].lstrip("%")]
    compare = _through_fusion(module, condition, condition.root)
    if compare is None or compare[0] != "compare" or len(compare[1]) != 2:
        return None
    direction = compare[2].get("direction", "")
    (lhs, rhs) = compare[1]
    if _counter_index(condition, lhs) is not None and _constant(condition, rhs) is not None:
        index, limit = _counter_index(condition, lhs), _constant(condition, rhs)
    elif _counter_index(condition, rhs) is not None and _constant(condition, lhs) is not None:
        index, limit = _counter_index(condition, rhs), _constant(condition, lhs)
        direction = _FLIPPED.get(direction, "")
    else:
        return None
    start_tuple = _resolve(computation, loop.operand_names[0])
    if start_tuple is None or start_tuple.opcode != "tuple":
        return None
    start = _constant(computation, start_tuple.operand_names[index])
    step = _counter_step(module, body, index)
    if start is None or not step:
        return None
    return _count_trips(start, limit, step, direction)


def _count_trips(start: int, limit: int, step: int, direction: str) -> int | None:
    span = limit - start
    if direction in ("LT", "LE") and step > 0:
        return max(0, -(-span // step) if direction == "LT" else span // step + 1)
    if direction in ("GT", "GE") and step < 0:
        return max(0, -(span // step) if direction == "GT" else span // step + 1)
    if direction == "NE" and span % step == 0 and span // step >= 0:
        return span // step
    return None


def _counter_step(module: HloModule, body: Computation, index: int) -> int | None:
    root = body.root
    if root.opcode != "tuple":
        return None
    update = _resolve(body, root.operand_names[index])
    op = _through_fusion(module, body, update) if update is not None else None
    if op is None or op[0] not in ("add", "subtract") or len(op[1]) != 2:
        return None
    a, b = op[1]
    if _counter_index(body, a) == index and _constant(body, b) is not None:
        return _constant(body, b) * (1 if op[0] == "add" else -1)
    if op[0] == "add" and _counter_index(body, b) == index and _constant(body, a) is not None:
        return _constant(body, a)
    return None


def _through_fusion(module: HloModule, computation: Computation, instr: Instruction
                    ) -> tuple[str, tuple[str, ...], Mapping[str, str]] | None:
    """(opcode, operand names, attrs) of `instr`, looking inside a fusion whose root reads only
    fusion parameters (XLA wraps single ops as `wrapped_compare` / `wrapped_add` fusions)."""
    if instr.opcode != "fusion":
        return instr.opcode, instr.operand_names, instr.attrs
    fused = module.computations[instr.attrs["calls"].lstrip("%")]
    names = []
    for name in fused.root.operand_names:
        param = fused.get(name)
        if param is None or param.opcode != "parameter":
            return None
        names.append(instr.operand_names[int(param.operands[0])])
    return fused.root.opcode, tuple(names), fused.root.attrs


def _resolve(computation: Computation, name: str) -> Instruction | None:
    instr = computation.get(name)
    while instr is not None and instr.opcode in _PASS_THROUGH:
        instr = computation.get(instr.operand_names[0])
    return instr


def _counter_index(computation: Computation, name: str) -> int | None:
    """`k` when `name` is `get-tuple-element(parameter(0)), index=k`."""
    instr = _resolve(computation, name)
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    source = _resolve(computation, instr.operand_names[0])
    if source is None or source.opcode != "parameter":
        return None
    return int(instr.attrs["index"])


def _constant(computation: Computation, name: str) -> int | None:
    instr = _resolve(computation, name)
    if instr is None or instr.opcode != "constant":
        return None
    try:
        return int(instr.operands[0])
    except (IndexError, ValueError):
        return None
