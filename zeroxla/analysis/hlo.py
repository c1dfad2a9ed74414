"""The collectives of a compiled XLA program, read from its optimized HLO text.

`collectives(compiled)` parses `compiled.as_text()` (a `jax.jit(f).lower(...).compile()`) and
returns one `Collective` per all-gather / reduce-scatter / all-reduce / all-to-all /
collective-permute reachable from ENTRY, with its shapes, byte sizes, device groups, the
`op_name` of its metadata (which carries `jax.named_scope` names) and a `multiplier`: how many
times it runs per program execution (the product of the trip counts of the while loops around it).

The work is split by idea, and this module puts it together:
    hlo_text.py        the text -> HloModule / Computation / Instruction, shapes and their bytes
    replica_groups.py  `replica_groups=` in XLA's three printed forms -> device ids
    trip_counts.py     how many times each computation runs (while-loop trip counts)
Their public names are re-exported here, so `from zeroxla.analysis.hlo import parse_module` (and
the like) keeps working.

What the text looks like in jax 0.10 and 0.12 (each point is checked in
tests/zeroxla/analysis/test_hlo.py), beyond what those modules describe:
- Asynchronous pairs (`all-gather-start` / `all-gather-done`, or `async-start` wrapping a
  collective) are counted once, at the start.
- Device ids are flattened ids `replica * num_partitions + partition`; a jitted SPMD program has
  one replica, so they are positions in `mesh.devices.flat` (not `Device.id`).
- How the SPMD partitioner prints a resharding's groups differs between the versions (see
  `replica_groups`), and so may the order in which it lists them; what each group holds does
  not. jax 0.12's compiled program no longer repeats the parameters' `sharding=` (the program as
  lowered, `lowered.as_text(dialect="hlo")`, still prints it); nothing here reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from zeroxla.analysis.hlo_text import (KINDS, ArrayShape, Computation, HloModule, HloParseError,
                                       Instruction, collective_kind, parse_module, parse_shape)
from zeroxla.analysis.replica_groups import (flattened_groups, flattened_pairs, group_mode,
                                             iota_array, parse_replica_groups)
from zeroxla.analysis.trip_counts import (UnknownTripCountError, branch_collectives,
                                          execution_counts, trip_count)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    `replica_groups` / `source_target_pairs` are the ids as written in the HLO; `device_groups`
    / `device_pairs` the same in flattened device ids, which for a jitted SPMD program are
    positions in `mesh.devices.flat`. `multiplier` is how many times it runs per execution.
    """

    kind: str
    name: str
    computation: str
    operands: tuple[ArrayShape, ...]
    results: tuple[ArrayShape, ...]
    replica_groups: tuple[tuple[int, ...], ...]
    device_groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...]
    device_pairs: tuple[tuple[int, int], ...]
    group_mode: str
    channel_id: int | None
    op_name: str
    multiplier: int
    is_async: bool

    @property
    def operand_bytes(self) -> int:
        return sum(shape.num_bytes for shape in self.operands)

    @property
    def result_bytes(self) -> int:
        return sum(shape.num_bytes for shape in self.results)

    @property
    def group_size(self) -> int:
        """Devices per group (2 for a collective-permute: a source and its target)."""
        if self.kind == "collective-permute":
            return 2
        return len(self.device_groups[0]) if self.device_groups else 1

    @property
    def payload_bytes(self) -> int:
        """Full payload S of one execution: the gathered output of an all-gather, the input
        of a reduce-scatter, the operand of an all-reduce / all-to-all / collective-permute."""
        if self.kind == "all-gather":
            return self.operand_bytes * self.group_size
        return self.operand_bytes


def collectives(hlo: str | object) -> tuple[Collective, ...]:
    """The collectives of a compiled program, in text order.

    `hlo` is the HLO text or an object with `.as_text()` (a `jax.stages.Compiled`). Raises
    `UnknownTripCountError` when a while loop around a collective has no known trip count.
    """
    module = parse_module(hlo if isinstance(hlo, str) else hlo.as_text())
    runs = execution_counts(module)
    async_bodies = _async_computations(module)
    users = _users(module)
    found = []
    for computation in module.computations.values():
        if computation.name not in runs:
            continue  # not reachable from ENTRY
        for instr in computation.instructions:
            kind, is_async = collective_kind(instr.opcode)
            if kind is not None:
                found.append(_collective(module, computation, instr, kind,
                                         is_async or computation.name in async_bodies,
                                         runs[computation.name], users))
    return tuple(found)


def _collective(module: HloModule, computation: Computation, instr: Instruction, kind: str,
                is_async: bool, multiplier: int, users: Mapping[str, list[Instruction]]
                ) -> Collective:
    channel = instr.attrs.get("channel_id")
    channel_id = int(channel) if channel is not None else None
    mode = group_mode(kind, channel_id, instr.attrs.get("use_global_device_ids") == "true")
    operand_texts = instr.operands[:1] if "slice_sizes" in instr.attrs else instr.operands
    operands = tuple(shape for text in operand_texts
                     for shape in _operand_shape(module, text))
    groups, pairs = (), ()
    if kind == "collective-permute":
        pairs = tuple(tuple(p) for p in parse_replica_groups(
            instr.attrs.get("source_target_pairs", "{}")))
    else:
        groups = parse_replica_groups(instr.attrs.get("replica_groups", "{}"))
    replicas, partitions = module.replica_count, module.num_partitions
    return Collective(
        kind=kind, name=instr.name, computation=computation.name, operands=operands,
        results=_results(instr, len(operands), users) if is_async else parse_shape(instr.shape),
        replica_groups=groups,
        device_groups=() if pairs else flattened_groups(groups, mode, replicas, partitions),
        source_target_pairs=pairs,
        device_pairs=flattened_pairs(pairs, mode, replicas, partitions),
        group_mode=mode, channel_id=channel_id, op_name=instr.op_name,
        multiplier=multiplier, is_async=is_async)


def _operand_shape(module: HloModule, text: str) -> tuple[ArrayShape, ...]:
    if "[" in text:  # printed with its shape: `f32[8]{0} %p`
        return parse_shape(text)
    name = text.split()[-1].lstrip("%")
    producer = module.instruction(name)
    if producer is None:
        raise HloParseError(f"operand %{name} is not defined in the module")
    return parse_shape(producer.shape)


def _results(start: Instruction, operand_count: int, users: Mapping[str, list[Instruction]]
             ) -> tuple[ArrayShape, ...]:
    """Result arrays of an async start: the shape of its `-done`, else read off the start."""
    frontier = [start.name]
    while frontier:
        for user in users.get(frontier.pop(), []):
            if user.opcode.endswith("-done"):
                return parse_shape(user.shape)
            if user.opcode.endswith("-update"):
                frontier.append(user.name)
    leaves = parse_shape(start.shape)  # (operands..., results..., context...) or results
    if len(leaves) >= 2 * operand_count:
        return leaves[operand_count:2 * operand_count]
    return leaves[:operand_count]


def _users(module: HloModule) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for computation in module.computations.values():
        for instr in computation.instructions:
            for name in instr.operand_names:
                users.setdefault(name, []).append(instr)
    return users


def _async_computations(module: HloModule) -> set[str]:
    return {name for computation in module.computations.values()
            for instr in computation.instructions if instr.opcode == "async-start"
            for _, name in instr.called_computations()}



__all__ = ["KINDS", "ArrayShape", "Collective", "Computation", "HloModule", "HloParseError",
           "Instruction", "UnknownTripCountError", "branch_collectives", "collectives",
           "execution_counts",
           "iota_array", "parse_module", "parse_replica_groups", "parse_shape", "trip_count"]
