"""Which per-platform branches a compiled step took: the CPU-only programs must not be in a GPU's.

Five places in zeroxla choose a program per platform when the step is lowered
(`lax.platform_dependent`, which emits only the lowering platform's branch) or build one shape
for every backend that only XLA:CPU needs:

* `collectives/wire.py`, `all_gather_dim` / `reduce_scatter_dim`: on CPU 16-bit floats travel
  as raw bits (`as_bits`): an `all_gather` of ui16, an `all_to_all` of ui16 summed in float32.
  GPU: a bf16 / f16 `all_gather` and `reduce_scatter`.
* `collectives/dot_layout.py`, `reduce_scatter_permuted`: on CPU the cotangent is scattered in
  the dot's dim order and transposed after (`dot_order`); elsewhere transposed first.
* `engine/gather.py`, `_after`: the backward re-gather ordered by `optimization_barrier` on GPU;
  on CPU a NaN test of data ties it to the cotangent (`_poisoned_by`).
* `engine/cotangent_layout.py`: re-emits the pullback so the above can choose (no branch of its
  own; its choice shows as dot_layout's).
* `engine/layer_loop.py`, `_Stacked`: every backend slices 16-bit stacks as their uint16 bits;
  XLA:CPU copies the stack to do so, other backends should reinterpret it in place. Measured in
  the compiled program: `bitcast-convert` instructions to or from u16 and their largest result.

Readings of the program the device runs:
1. the lowered StableHLO with its source locations (`as_text(debug_info=True)`): the operations
   whose location points into the body of a CPU-only branch function (`as_bits`, `dot_order`,
   `_poisoned_by`, found by name in the installed modules' source). Operations traced inside a
   custom VJP's backward carry the forward's location, so three structural readings back it:
2. the lowered module's operations (`structure`): collectives by operand element type (ui16
   gathers, any all_to_all: wire's CPU branch; bf16 reduce_scatter and optimization_barrier:
   the GPU ones), NaN tests of a vector against itself (`_poisoned_by`) and transposes of a
   scattered value (`dot_order`);
3. the compiled HLO (`compiled.as_text()`): all-to-all, opt-barrier and u16 bitcast-converts.
On CPU (the `--tiny` check) the CPU branches must show up (the markers work); on a GPU every
CPU-branch count must be 0.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path
from typing import Any

import zeroxla.collectives.dot_layout as dot_layout
import zeroxla.collectives.wire as wire
import zeroxla.engine.gather as gather

# module -> the names of its CPU-only branch functions (nested ones included)
CPU_BRANCHES = {wire: ("as_bits",), dot_layout: ("dot_order",), gather: ("_poisoned_by",)}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce",
               "optimization_barrier")
_LOC_DEF = re.compile(r"^#(loc\d+) = loc\((.*)\)\s*$")
_FILE_LINE = re.compile(r'"([^"]+\.py)":(\d+)')
_LOC_REF = re.compile(r"#(loc\d+)")


def branch_lines() -> dict[str, tuple[str, set[int]]]:
    """"module.function" -> (the module's file, the lines of the function's body)."""
    found = {}
    for module, names in CPU_BRANCHES.items():
        path = Path(module.__file__).resolve()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                key = f"{module.__name__.rsplit('.', 1)[-1]}.{node.name}"
                lines = found.setdefault(key, (str(path), set()))[1]
                lines.update(range(node.lineno, node.end_lineno + 1))
    return found


def _located_in(text: str, path: str, lines: set[int]) -> set[str]:
    """The `#locN` ids of `text` whose location (through callsites and names) reaches a line in
    `lines` of `path`."""
    defs = {}
    for line in text.splitlines():
        m = _LOC_DEF.match(line)
        if m:
            defs[m.group(1)] = m.group(2)
    hit = {name for name, body in defs.items()
           if any(Path(f).resolve() == Path(path) and int(n) in lines
                  for f, n in _FILE_LINE.findall(body))}
    changed = True
    while changed:                          # a location referring to a hit location is a hit
        changed = False
        for name, body in defs.items():
            if name not in hit and any(ref in hit for ref in _LOC_REF.findall(body)):
                hit.add(name)
                changed = True
    return hit


def branch_ops(debug_text: str) -> dict[str, int]:
    """"module.function" -> how many operations of the lowered program come from its body."""
    ops = [line for line in debug_text.splitlines()
           if not line.startswith("#loc") and "loc(#loc" in line]
    counts = {}
    for key, (path, lines) in branch_lines().items():
        hit = _located_in(debug_text, path, lines)
        counts[key] = sum(1 for op in ops
                          if any(ref in hit for ref in re.findall(r"loc\(#(loc\d+)\)", op)))
    return counts


def _walk(operation: Any):
    """Every operation nested in `operation` (an MLIR operation), depth first."""
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from _walk(op.operation)


def _element_type(value: Any) -> str:
    m = re.fullmatch(r"tensor<(?:[\dx]*x)?(\w+)>", str(value.type))
    return m.group(1) if m else "?"


def _producer(value: Any) -> Any | None:
    """The operation that defines `value` (None for a block argument)."""
    owner = value.owner
    return getattr(owner, "operation", None) if hasattr(owner, "name") else None


# Elementwise and layout operations a scattered value passes through before dot_order's
# transpose (reduce_scatter_dim's convert and multiply, the CPU path's bitcasts and sum).
_PASS_THROUGH = ("stablehlo.convert", "stablehlo.multiply", "stablehlo.reshape",
                 "stablehlo.bitcast_convert", "stablehlo.reduce", "stablehlo.case")


def _after_scatter(value: Any, hops: int = 6) -> bool:
    """Whether `value` comes from a reduce_scatter or all_to_all through <= `hops` of
    `_PASS_THROUGH` operations."""
    op = _producer(value)
    while op is not None and hops > 0:
        if op.name in ("stablehlo.reduce_scatter", "stablehlo.all_to_all"):
            return True
        if op.name not in _PASS_THROUGH or not len(op.operands):
            return False
        op, hops = _producer(op.operands[0]), hops - 1
    return False


def structure(lowered: Any) -> dict[str, Any]:
    """From the lowered module: collectives and barriers by operand element type; NaN tests of
    a vector against itself (`gather._poisoned_by`'s; `layer_loop`'s own NaN test, on every
    backend, is of a scalar); transposes of a scattered value (`dot_layout.dot_order`)."""
    collectives: dict[str, collections.Counter] = {}
    nan_tests = transposed_after_scatter = 0
    for op in _walk(lowered.compiler_ir("stablehlo").operation):
        name = op.name.removeprefix("stablehlo.")
        if name in COLLECTIVES:
            collectives.setdefault(name, collections.Counter()).update(
                [_element_type(v) for v in op.operands] or ["-"])
        elif (name == "compare" and "NE" in str(op.attributes["comparison_direction"])
              and op.operands[0] == op.operands[1] and re.match(r"tensor<\d", str(
                  op.operands[0].type))):
            nan_tests += 1
        elif name == "transpose" and _after_scatter(op.operands[0]):
            transposed_after_scatter += 1
    return {"collectives": {k: dict(v) for k, v in collectives.items()},
            "vector_nan_tests": nan_tests, "transpose_after_scatter": transposed_after_scatter}


def compiled_markers(hlo: str) -> dict[str, Any]:
    """Counts in the compiled HLO: all-to-all, reduce-scatter, opt-barrier, and the u16
    bitcast-converts with the bytes of the largest (a stack copied to slice its bits)."""
    u16 = [line for line in hlo.splitlines() if "bitcast-convert(" in line and "u16[" in line]
    sizes = []
    for line in u16:
        m = re.search(r"= (u16|bf16|f16)\[([\d,]*)\]", line)
        if m:
            dims = [int(d) for d in m.group(2).split(",") if d]
            size = 2
            for d in dims:
                size *= d
            sizes.append(size)
    return {"all_to_all": len(re.findall(r"\ball-to-all(?:-start)?\(", hlo)),
            "reduce_scatter": len(re.findall(r"\breduce-scatter(?:-start)?\(", hlo)),
            "opt_barrier": len(re.findall(r"\bopt-barrier\(", hlo)),
            "u16_bitcast_converts": len(u16),
            "largest_u16_bitcast_bytes": max(sizes, default=0)}


def report(lowered: Any, compiled: Any | None) -> dict[str, Any]:
    """Every marker of one step's program (see the module docstring). `cpu_markers_total` sums
    the CPU-branch ones: 0 on a GPU."""
    out: dict[str, Any] = {"cpu_branch_ops": branch_ops(lowered.as_text(debug_info=True))}
    out.update(structure(lowered))
    found = out["collectives"]
    out["cpu_markers_total"] = (sum(out["cpu_branch_ops"].values())
                                + found.get("all_gather", {}).get("ui16", 0)
                                + sum(found.get("all_to_all", {}).values())
                                + out["vector_nan_tests"] + out["transpose_after_scatter"])
    if compiled is not None:
        out["compiled"] = compiled_markers(compiled.as_text())
    return out
