"""The collectives of a compiled XLA program, read from its optimized HLO text.

`collectives(compiled)` parses `compiled.as_text()` (a `jax.jit(f).lower(...).compile()`) and
returns one `Collective` per all-gather / reduce-scatter / all-reduce / all-to-all /
collective-permute reachable from ENTRY, with its shapes, byte sizes, device groups, the
`op_name` of its metadata (which carries `jax.named_scope` names) and a `multiplier`: how many
times it runs per program execution (the product of the trip counts of the while loops around it).

What the text looks like in jax 0.10.2 (each point is checked in tests/zeroxla/test_hlo.py):
- `shard_map` collectives print explicit groups, `replica_groups={{0,1,2,3},{4,5,6,7}}`.
- Collectives that the SPMD partitioner inserts print the mesh-axes form,
  `replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_1':(2)2}`.
- The iota form `replica_groups=[2,4]<=[4,2]T(1,0)` is what XLA's parser and older printers use.
- Ids are flattened ids `replica * num_partitions + partition`; a jitted SPMD program has one
  replica, so they are partition ids, i.e. positions in `mesh.devices.flat` (not `Device.id`).
- Asynchronous pairs (`all-gather-start` / `all-gather-done`, or `async-start` wrapping a
  collective) are counted once, at the start.
- `while` loops from `lax.scan` / `fori_loop` carry `"known_trip_count":{"n":"5"}` in their
  backend_config; without it the trip count is inferred from the loop condition, else
  `UnknownTripCountError`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# Attributes whose value names the computations an instruction calls.
_CALL_ATTRS = ("calls", "to_apply", "body", "condition", "branch_computations",
               "true_computation", "false_computation", "scatter", "select")
# Single-operand ops that do not change a value, for tracing loop counters.
_PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")

_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16,
    "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0,
}


class HloParseError(ValueError):
    """The HLO text does not have the structure this parser expects."""


class UnknownTripCountError(HloParseError):
    """A while loop that contains collectives has no known trip count."""


# ---------------------------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    """One array of an HLO shape: `f32[8,16]` is `ArrayShape("f32", (8, 16))`."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def num_bytes(self) -> int:
        return (self.num_elements * _dtype_bits(self.dtype) + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    float_bits = re.match(r"f(\d+)e", dtype)  # f8e4m3fn, f4e2m1fn, f6e3m2fn, ...
    if float_bits:
        return int(float_bits.group(1))
    raise HloParseError(f"unknown HLO element type {dtype!r}")


def parse_shape(text: str) -> tuple[ArrayShape, ...]:
    """The arrays of an HLO shape string, in order; tuples are flattened, layouts dropped.

    `f32[8,16]{1,0}` -> (f32[8,16],); `((f32[4]), f32[1])` -> (f32[4], f32[1]);
    a dynamic dim `f32[<=16]` counts at its bound.
    """
    leaves = []
    for match in re.finditer(r"([a-z][a-z0-9]*)\[([^\]]*)\]", _strip_braces(text)):
        dims = []
        for dim in filter(None, match.group(2).split(",")):
            dim = dim.strip().removeprefix("<=")
            if not dim.isdigit():
                raise HloParseError(f"cannot size the dimension {dim!r} in shape {text!r}")
            dims.append(int(dim))
        leaves.append(ArrayShape(match.group(1), tuple(dims)))
    return tuple(leaves)


def _strip_braces(text: str) -> str:
    """`text` without its `{...}` groups (layouts), nested ones included."""
    out, depth = [], 0
    for char in text:
        depth += char == "{"
        if depth == 0:
            out.append(char)
        depth -= char == "}" and depth > 0
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Text structure: module -> computations -> instructions


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `%name = shape opcode(operands), attrs`."""

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]  # raw operand texts; `operand_names` strips shapes and `%`
    attrs: Mapping[str, str]
    is_root: bool

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(text.split()[-1].lstrip("%") for text in self.operands if text.split())

    @property
    def op_name(self) -> str:
        match = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attrs.get("metadata", ""))
        return match.group(1) if match else ""

    def called_computations(self) -> tuple[tuple[str, str], ...]:
        """(attribute, computation name) for every computation this instruction calls."""
        called = []
        for attr in _CALL_ATTRS:
            for name in re.findall(r"%?([^\s{},%]+)", self.attrs.get(attr, "")):
                called.append((attr, name))
        return tuple(called)


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]

    @property
    def root(self) -> Instruction:
        roots = [instr for instr in self.instructions if instr.is_root]
        return roots[0] if roots else self.instructions[-1]

    def get(self, name: str) -> Instruction | None:
        return self._by_name.get(name)

    @functools.cached_property
    def _by_name(self) -> dict[str, Instruction]:
        return {instr.name: instr for instr in self.instructions}


@dataclasses.dataclass(frozen=True)
class HloModule:
    name: str
    computations: Mapping[str, Computation]
    entry: str
    num_partitions: int
    replica_count: int

    def instruction(self, name: str) -> Instruction | None:
        """The instruction called `name` anywhere in the module (HLO names are module-unique)."""
        return self._by_name.get(name)

    @functools.cached_property
    def _by_name(self) -> dict[str, Instruction]:
        return {instr.name: instr for computation in self.computations.values()
                for instr in computation.instructions}


_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(){}=,]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*")


def parse_module(text: str) -> HloModule:
    """Parses the text of an HLO module (`compiled.as_text()`) into computations."""
    header = re.search(r"^HloModule\s+([^\s,]+)(.*)$", text, re.MULTILINE)
    if header is None:
        raise HloParseError("no 'HloModule' line: pass the text of compiled.as_text()")
    computations, entry = {}, None
    current, body = None, []
    for statement in _statements(text):
        if current is None:
            match = _COMPUTATION_HEADER.match(statement)
            if match:
                current, body = (match.group(2), bool(match.group(1))), []
            continue
        if statement.lstrip().startswith("}"):
            name, is_entry = current
            computations[name] = Computation(name, is_entry, tuple(body))
            entry = name if is_entry else entry
            current = None
            continue
        body.append(_parse_instruction(statement))
    if entry is None:
        raise HloParseError("the HLO module has no ENTRY computation")
    options = header.group(2)
    partitions = re.search(r"\bnum_partitions=(\d+)", options)
    replicas = re.search(r"\breplica_count=(\d+)", options)
    return HloModule(header.group(1), computations, entry,
                     int(partitions.group(1)) if partitions else 1,
                     int(replicas.group(1)) if replicas else 1)


def _statements(text: str) -> Iterator[str]:
    """Lines of `text`, with an instruction that spans several lines joined into one."""
    pending = ""
    for line in text.splitlines():
        pending = f"{pending} {line.strip()}" if pending else line
        if _depth(pending) <= 0 or _COMPUTATION_HEADER.match(pending):
            if pending.strip():
                yield pending
            pending = ""
    if pending.strip():
        yield pending


def _outside_quotes(text: str) -> Iterator[tuple[int, str]]:
    """(index, char) for every character of `text` outside '...' and "..." strings."""
    quote, escaped = None, False
    for i, char in enumerate(text):
        if quote is None:
            if char in "\"'":
                quote = char
            else:
                yield i, char
        elif escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == quote:
            quote = None


def _depth(text: str) -> int:
    """Open brackets minus closed ones outside quotes ('{' of a header line counts too)."""
    return sum((char in "([{") - (char in ")]}") for _, char in _outside_quotes(text))


def _parse_instruction(statement: str) -> Instruction:
    # XLA marks every fifth element of long operand lists and tuple shapes with `/*index=5*/`.
    statement = re.sub(r"/\*index=\d+\*/", "", statement)
    head = _INSTRUCTION_HEAD.match(statement)
    if head is None:
        raise HloParseError(f"cannot parse HLO instruction: {statement.strip()[:200]}")
    rest = statement[head.end():]
    shape, rest = _take_shape(rest)
    opcode = re.match(r"\s*([a-z][a-z0-9\-_]*)\(", rest)
    if opcode is None:
        raise HloParseError(f"no opcode in HLO instruction: {statement.strip()[:200]}")
    operands, rest = _take_group(rest, opcode.end() - 1)
    return Instruction(name=head.group(2), opcode=opcode.group(1), shape=shape,
                       operands=tuple(filter(None, map(str.strip, _split_top(operands)))),
                       attrs=_parse_attrs(rest), is_root=bool(head.group(1)))


def _take_shape(text: str) -> tuple[str, str]:
    """Splits `shape rest` at the first space outside brackets."""
    text = text.lstrip()
    depth = 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == " " and depth == 0:
            return text[:i], text[i:]
    return text, ""


def _take_group(text: str, start: int) -> tuple[str, str]:
    """The inside of the bracket group opening at `text[start]`, and the text after it."""
    depth = 0
    for i, char in _outside_quotes(text[start:]):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0:
            return text[start + 1:start + i], text[start + i + 1:]
    raise HloParseError(f"unbalanced brackets in {text[:200]!r}")


def _split_top(text: str, separator: str = ",") -> list[str]:
    """Splits at `separator` outside brackets and quotes."""
    parts, depth, start = [], 0, 0
    for i, char in _outside_quotes(text):
        depth += (char in "([{") - (char in ")]}")
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    previous = None
    for part in _split_top(text):
        key, sep, value = part.strip().partition("=")
        if not sep:
            continue
        if key == "device_ids" and previous == "replica_groups":
            # The mesh form `mesh[...], device_ids=(...) {axes}` has a comma of its own.
            attrs["replica_groups"] += f", device_ids={value}"
            continue
        attrs[key], previous = value.strip(), key
    return attrs


# ---------------------------------------------------------------------------------------------
# Replica groups


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Expands a `replica_groups=` value, in any of XLA's three printed forms, to id lists.

    - explicit: `{{0,1},{2,3}}` (`{}` means one group of everyone and returns `()`);
    - iota: `[2,4]<=[4,2]T(1,0)` = `arange(8).reshape(4,2).transpose(1,0).reshape(2,4)`;
    - mesh axes: `mesh['x'=2,'y'=4] {'y'}`, optionally with `device_ids=(...)` and sub-axes
      `'y':(2)2` (Shardy's notation: the 2 devices of `y` after a major part of size 2).
    """
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_axes_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("{"):
        inner = text[1:-1].strip()
        return tuple(tuple(int(i) for i in re.findall(r"-?\d+", group))
                     for group in re.findall(r"\{([^{}]*)\}", inner))
    raise HloParseError(f"unrecognised replica_groups {text!r}")


def iota_array(dims: Sequence[int], reshape_dims: Sequence[int],
               transpose_perm: Sequence[int] | None = None) -> np.ndarray:
    """XLA's iota tile assignment `[dims]<=[reshape_dims]T(perm)` as an integer array."""
    count = math.prod(reshape_dims)
    if math.prod(dims) != count:
        raise HloParseError(f"iota [{dims}]<=[{reshape_dims}]: sizes differ")
    perm = tuple(range(len(reshape_dims))) if transpose_perm is None else tuple(transpose_perm)
    return np.arange(count).reshape(reshape_dims).transpose(perm).reshape(dims)


_IOTA = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")


def _ints(text: str | None) -> list[int] | None:
    return None if text is None else [int(i) for i in text.split(",") if i.strip()]


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
    match = _IOTA.match(text.replace(" ", ""))
    if match is None:
        raise HloParseError(f"unrecognised iota replica_groups {text!r}")
    dims, reshape, perm = (_ints(group) for group in match.groups())
    if len(dims) != 2:
        raise HloParseError(f"iota replica_groups {text!r} must be [groups,group_size]<=...")
    return tuple(tuple(int(i) for i in row) for row in iota_array(dims, reshape, perm))


def _mesh_axes_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Port of XLA's `MeshAxesReplicaGroupList::flattened_replica_groups`."""
    axes_text, rest = _take_group(text, text.index("["))
    names, sizes = [], []
    for axis in filter(None, map(str.strip, axes_text.split(","))):
        name, _, size = axis.rpartition("=")
        names.append(name.strip("'\""))
        sizes.append(int(size))
    rest = rest.strip()
    devices = np.arange(math.prod(sizes)).reshape(sizes)
    if rest.startswith(","):
        ids_at = rest.index("(")
        ids_text, rest = _take_group(rest, ids_at)
        devices = _mesh_device_ids(ids_text, sizes)
    refs_text, _ = _take_group(rest.strip(), 0)
    refs = []
    for ref in filter(None, map(str.strip, _split_top(refs_text))):
        match = re.match(r"^['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?$", ref)
        if match is None or match.group(1) not in names:
            raise HloParseError(f"unrecognised mesh axis {ref!r} in replica_groups {text!r}")
        pre, size = match.group(2), match.group(3)
        refs.append((names.index(match.group(1)), None if pre is None else int(pre),
                     None if size is None else int(size)))
    return _group_mesh(devices, refs)


def _mesh_device_ids(text: str, sizes: Sequence[int]) -> np.ndarray:
    """`device_ids=(...)` of a mesh: an iota `[2,2,2]T(1,0,2)` or an explicit id list."""
    text = text.replace(" ", "")
    if text.startswith("["):
        match = re.match(r"^(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?$", text)
        if match is None:
            raise HloParseError(f"unrecognised mesh device_ids ({text})")
        return iota_array(sizes, _ints(match.group(1)), _ints(match.group(2)))
    return np.asarray(_ints(text)).reshape(sizes)


def _group_mesh(devices: np.ndarray, refs: list[tuple[int, int | None, int | None]]
                ) -> tuple[tuple[int, ...], ...]:
    """Groups of `devices` that vary along the mesh (sub-)axes `refs`, in `refs` order.

    Each mesh axis with sub-axes is split into [pre, size, rest] pieces (major to minor); the
    array is transposed so the grouped pieces come last and cut into rows.
    """
    sizes = devices.shape
    split: dict[int, list[int]] = {}
    grouped_piece: dict[int, int] = {}
    for axis in sorted({axis for axis, _, _ in refs}):
        on_axis = [i for i, ref in enumerate(refs) if ref[0] == axis]
        if len(on_axis) == 1 and refs[on_axis[0]][1] is None:
            split[axis], grouped_piece[on_axis[0]] = [sizes[axis]], 0
            continue
        if any(refs[i][1] is None for i in on_axis):
            raise HloParseError(f"mesh axis {axis} is used both whole and as sub-axes")
        pieces, covered = [], 1
        for i in sorted(on_axis, key=lambda i: refs[i][1]):
            pre, size = refs[i][1], refs[i][2]
            if pre != covered:
                pieces.append(pre // covered)
                covered = pre
            grouped_piece[i] = len(pieces)
            pieces.append(size)
            covered *= size
        if covered != sizes[axis]:
            pieces.append(sizes[axis] // covered)
        split[axis] = pieces
    reshaped, offsets = [], []
    for axis, size in enumerate(sizes):
        offsets.append(len(reshaped))
        reshaped.extend(split.get(axis, [size]))
    grouped = [offsets[refs[i][0]] + grouped_piece[i] for i in range(len(refs))]
    perm = [d for d in range(len(reshaped)) if d not in grouped] + grouped
    group_size = math.prod(reshaped[d] for d in grouped)
    rows = devices.reshape(reshaped).transpose(perm).reshape(-1, group_size)
    return tuple(tuple(int(i) for i in row) for row in rows)


def _group_mode(kind: str, channel_id: int | None, use_global_device_ids: bool) -> str:
    """XLA's `CollectiveOpGroupMode`: what the ids in replica_groups are."""
    if kind in ("all-to-all", "collective-permute"):
        return "cross_partition" if channel_id is not None else "cross_replica"
    if channel_id is None:
        return "cross_replica"
    return "flattened_id" if use_global_device_ids else "cross_replica_and_partition"


def _device_groups(groups: tuple[tuple[int, ...], ...], mode: str, replicas: int,
                   partitions: int) -> tuple[tuple[int, ...], ...]:
    """`groups` in flattened ids `replica * partitions + partition`, per XLA's group modes."""
    every = {"flattened_id": replicas * partitions, "cross_partition": partitions}
    base = groups or (tuple(range(every.get(mode, replicas))),)
    if mode == "flattened_id":
        return base
    if mode == "cross_partition":
        return tuple(tuple(r * partitions + p for p in group)
                     for r in range(replicas) for group in base)
    if mode == "cross_replica":
        return tuple(tuple(r * partitions + p for r in group)
                     for p in range(partitions) for group in base)
    return tuple(tuple(r * partitions + p for r in group for p in range(partitions))
                 for group in base)


def _device_pairs(pairs: tuple[tuple[int, int], ...], mode: str, replicas: int,
                  partitions: int) -> tuple[tuple[int, int], ...]:
    if mode == "cross_partition":
        return tuple((r * partitions + s, r * partitions + t)
                     for r in range(replicas) for s, t in pairs)
    return tuple((s * partitions + p, t * partitions + p)
                 for p in range(partitions) for s, t in pairs)


# ---------------------------------------------------------------------------------------------
# Collectives


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
            kind, is_async = _kind(instr.opcode)
            if kind is not None:
                found.append(_collective(module, computation, instr, kind,
                                         is_async or computation.name in async_bodies,
                                         runs[computation.name], users))
    return tuple(found)


def _kind(opcode: str) -> tuple[str | None, bool]:
    if opcode in KINDS:
        return opcode, False
    if opcode.endswith("-start") and opcode[:-len("-start")] in KINDS:
        return opcode[:-len("-start")], True
    return None, False


def _collective(module: HloModule, computation: Computation, instr: Instruction, kind: str,
                is_async: bool, multiplier: int, users: Mapping[str, list[Instruction]]
                ) -> Collective:
    channel = instr.attrs.get("channel_id")
    channel_id = int(channel) if channel is not None else None
    mode = _group_mode(kind, channel_id, instr.attrs.get("use_global_device_ids") == "true")
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
        device_groups=() if pairs else _device_groups(groups, mode, replicas, partitions),
        source_target_pairs=pairs,
        device_pairs=_device_pairs(pairs, mode, replicas, partitions),
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


# ---------------------------------------------------------------------------------------------
# How many times each computation runs


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


def _contains_collective(module: HloModule) -> dict[str, bool]:
    """Whether each computation, or anything it calls, holds a collective."""
    memo: dict[str, bool] = {}

    def visit(name: str) -> bool:
        if name not in module.computations:
            raise HloParseError(f"called computation %{name} is not in the module")
        if name not in memo:
            memo[name] = False
            instrs = module.computations[name].instructions
            memo[name] = any(_kind(instr.opcode)[0] is not None for instr in instrs) or any(
                visit(callee) for instr in instrs for _, callee in _calls(instr))
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
