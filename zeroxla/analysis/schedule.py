"""What a compiled program's schedule overlaps: its asynchronous collectives and the compute
XLA placed between each start and its done.

A scheduled HLO module (`compiled.as_text()` of a GPU program: `is_scheduled=true`) lists each
computation's instructions in the order they run. An asynchronous collective is a pair: an
`all-gather-start` / `all-reduce-start` / `collective-permute-start` and its `-done`, or an
`async-start` whose called computation holds the collective (XLA:GPU's reduce-scatter and
all-to-all) and its `async-done` (through any `async-update`). Whatever is scheduled between
the two runs while the collective is in flight: a pair with a matrix multiplication between
hides the transfer behind compute; a pair with nothing between, or a collective issued
synchronously, stalls the stream for it.

    pairs = async_pairs(compiled.as_text())
    summary(pairs, sync_collectives(compiled.as_text()))

XLA:CPU runs collectives synchronously (its programs have no pairs); the reading is for the
programs compiled for a GPU (`benchmarks/gpu/mock_topology.py`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from zeroxla.analysis.hlo_text import HloModule, Instruction, collective_kind, parse_module

COMPUTE_OPCODES = ("fusion", "custom-call", "dot", "convolution")
# A matrix multiplication: XLA:GPU's library calls and its Triton GEMM fusions.
MATMUL_MARKERS = ("gemm", "cublas", "cudnn", "matmul")


@dataclasses.dataclass(frozen=True)
class AsyncPair:
    """One asynchronous collective: its kind, where it is, and what runs while it is in flight
    (`done` None: no done follows the start in its computation: XLA pipelined it across a
    loop iteration or returned it)."""

    kind: str
    computation: str
    start: str
    done: str | None
    compute_between: int
    matmuls_between: int


def is_matmul(instr: Instruction) -> bool:
    """A dot, or a fusion / custom call that XLA:GPU lowers to a GEMM (its target or backend
    config names one)."""
    if instr.opcode in ("dot", "convolution"):
        return True
    if instr.opcode not in ("fusion", "custom-call"):
        return False
    text = " ".join(str(v) for v in instr.attrs.values()).lower()
    return any(marker in text for marker in MATMUL_MARKERS)


def _start_kind(module: HloModule, instr: Instruction) -> str | None:
    kind, is_start = collective_kind(instr.opcode)
    if is_start:
        return kind
    if instr.opcode != "async-start":
        return None
    for _, name in instr.called_computations():
        for inner in module.computations[name].instructions:
            inner_kind, _ = collective_kind(inner.opcode)
            if inner_kind:
                return inner_kind
    return None


def async_pairs(hlo: str | HloModule) -> tuple[AsyncPair, ...]:
    """Every asynchronous collective of a scheduled module with the compute between its start
    and its done, in each computation's order."""
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    pairs = []
    for computation in module.computations.values():
        order = computation.instructions
        for n, instr in enumerate(order):
            kind = _start_kind(module, instr)
            if kind is None:
                continue
            current, done = instr.name, None
            for m in range(n + 1, len(order)):
                follower = order[m]
                if current not in follower.operand_names:
                    continue
                if follower.opcode == "async-update":
                    current = follower.name
                elif follower.opcode.endswith("-done"):
                    done = m
                    break
            between = order[n + 1:done] if done is not None else order[n + 1:]
            pairs.append(AsyncPair(
                kind, computation.name, instr.name,
                order[done].name if done is not None else None,
                sum(i.opcode in COMPUTE_OPCODES for i in between),
                sum(is_matmul(i) for i in between)))
    return tuple(pairs)


def sync_collectives(hlo: str | HloModule) -> Counter:
    """Collectives issued synchronously (no start / done), by kind, outside the computations
    that async-starts call."""
    module = parse_module(hlo) if isinstance(hlo, str) else hlo
    wrapped = {name for c in module.computations.values() for i in c.instructions
               if i.opcode == "async-start" for _, name in i.called_computations()}
    found: Counter = Counter()
    for computation in module.computations.values():
        if computation.name in wrapped:
            continue
        for instr in computation.instructions:
            kind, is_start = collective_kind(instr.opcode)
            if kind and not is_start:
                found[kind] += 1
    return found


def summary(pairs: tuple[AsyncPair, ...], sync: Counter) -> dict[str, dict[str, int]]:
    """Per kind: asynchronous pairs, those with a matmul between start and done, those with no
    compute between, those pipelined out of their computation, and synchronous ones."""
    out: dict[str, dict[str, int]] = {}
    for kind in sorted({p.kind for p in pairs} | set(sync)):
        mine = [p for p in pairs if p.kind == kind]
        out[kind] = {"async": len(mine),
                     "overlapping_a_matmul": sum(p.matmuls_between > 0 for p in mine),
                     "nothing_between": sum(p.done is not None and p.compute_between == 0
                                            for p in mine),
                     "done_not_in_computation": sum(p.done is None for p in mine),
                     "sync": sync.get(kind, 0)}
    return out


__all__ = ["AsyncPair", "async_pairs", "is_matmul", "summary", "sync_collectives"]
