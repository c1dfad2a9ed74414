"""XLA's HLO text, parsed: module -> computations -> instructions, and the shapes in it.

`parse_module(compiled.as_text())` returns an `HloModule` whose computations hold `Instruction`s
with their opcode, shape text, operand texts and attributes as strings; `parse_shape` turns a
shape string into `ArrayShape`s with byte sizes. Nothing here knows what a collective does with its
operands: `zeroxla.analysis.hlo` reads collectives off this structure, `replica_groups` decodes
their device groups and `trip_counts` how often each computation runs.

The printer quirks handled here (jax 0.10 and 0.12; each is exercised in tests/zeroxla/analysis/
test_hlo.py): instructions split over several lines, `/*index=5*/` markers in long operand lists,
quoted strings holding brackets, and layouts `{1,0}` after shapes. The module's `FileNames` /
`StackFrames` tables between the header and the first computation are skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Mapping

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# Attributes whose value names the computations an instruction calls.
_CALL_ATTRS = ("calls", "to_apply", "body", "condition", "branch_computations",
               "true_computation", "false_computation", "scatter", "select")

_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16,
    "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0,
}


class HloParseError(ValueError):
    """The HLO text does not have the structure this parser expects."""


def collective_kind(opcode: str) -> tuple[str | None, bool]:
    """(the collective in `KINDS`, is it the start of an async pair) for an opcode;
    (None, False) when the opcode is not a collective."""
    if opcode in KINDS:
        return opcode, False
    if opcode.endswith("-start") and opcode[:-len("-start")] in KINDS:
        return opcode[:-len("-start")], True
    return None, False


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


# A quoted string (to its closing quote, or to the end of an unterminated one), or one bracket.
_QUOTED = r'"(?:[^"\\]|\\.)*"?|\'(?:[^\'\\]|\\.)*\'?'


def _structure(text: str, separator: str = "") -> Iterator[tuple[int, str]]:
    """(index, char) for every bracket (and `separator`) of `text` outside '...' and "..."
    strings (a backslash escapes the next character inside one). A regular expression finds
    them, so plain text between them costs no Python loop (HLO of a real step: ~10^7 chars)."""
    pattern = _QUOTED + r"|[()\[\]{}]" + (f"|{re.escape(separator)}" if separator else "")
    for match in re.finditer(pattern, text, re.DOTALL):
        char = match.group()
        if char[0] not in "\"'":
            yield match.start(), char


def _depth(text: str) -> int:
    """Open brackets minus closed ones outside quotes ('{' of a header line counts too)."""
    if '"' not in text and "'" not in text:
        return sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")
    return sum((char in "([{") - (char in ")]}") for _, char in _structure(text))


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
    operands, rest = take_group(rest, opcode.end() - 1)
    return Instruction(name=head.group(2), opcode=opcode.group(1), shape=shape,
                       operands=tuple(filter(None, map(str.strip, split_top(operands)))),
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


def take_group(text: str, start: int) -> tuple[str, str]:
    """The inside of the bracket group opening at `text[start]`, and the text after it."""
    depth = 0
    for i, char in _structure(text[start:]):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0:
            return text[start + 1:start + i], text[start + i + 1:]
    raise HloParseError(f"unbalanced brackets in {text[:200]!r}")


def split_top(text: str, separator: str = ",") -> list[str]:
    """Splits at `separator` outside brackets and quotes."""
    parts, depth, start = [], 0, 0
    for i, char in _structure(text, separator):
        depth += (char in "([{") - (char in ")]}")
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    previous = None
    for part in split_top(text):
        key, sep, value = part.strip().partition("=")
        if not sep:
            continue
        if key == "device_ids" and previous == "replica_groups":
            # The mesh form `mesh[...], device_ids=(...) {axes}` has a comma of its own.
            attrs["replica_groups"] += f", device_ids={value}"
            continue
        attrs[key], previous = value.strip(), key
    return attrs

