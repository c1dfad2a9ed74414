"""The wire format is chosen per platform when the step is lowered: native 16-bit collectives
for GPU, the raw-bits workaround for XLA:CPU only; the bytes per parameter are the same.

The CUDA program is lowered on this CPU machine (`zeroxla.compat.lowering.lower_for_cuda` needs
no GPU) and read as StableHLO: every collective op and its operand types, from the MLIR module.
"""

import math
import re

import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from zeroxla.compat.lowering import lower_for_cuda

ITEMSIZE = {"bf16": 2, "f16": 2, "ui16": 2, "f32": 4, "ui32": 4, "i32": 4}
COLLECTIVES = ("stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
               "stablehlo.all_reduce", "stablehlo.optimization_barrier")


def _ops(lowered):
    """[(op name, [(shape, element type) of each operand])] for the collectives and barriers."""
    found = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    name = op.operation.name
                    if name in COLLECTIVES:
                        operands = []
                        for value in op.operands:
                            m = re.fullmatch(r"tensor<(?:([\dx]*)x)?(\w+)>", str(value.type))
                            if m:
                                dims = tuple(int(d) for d in m.group(1).split("x")) \
                                    if m.group(1) else ()
                                operands.append((dims, m.group(2)))
                        found.append((name.split(".")[1], operands))
                    walk(op.operation)
    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def _bytes(ops, name, types):
    return sum(math.prod(shape) * ITEMSIZE[t] for op, operands in ops if op == name
               for shape, t in operands if t in types)


def _lower(**config):
    """The bf16 AdamW step on gpt-tiny (2 x 4 mesh), lowered for CPU and for CUDA."""
    step = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3),
                             config=zeroxla.ZeroConfig(compute_dtype="bfloat16", **config))
    state = step.init()
    tokens = np.zeros((16, 32), np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    return {"cpu": _ops(step.trace(state, batch).lower(lowering_platforms=("cpu",))),
            "cuda": _ops(lower_for_cuda(step, state, batch))}


@pytest.fixture(scope="module")
def lowered():
    return _lower(stage=3, persistence_threshold=500)


def test_cuda_program_has_native_bf16_collectives(lowered):
    cuda = lowered["cuda"]
    names = [op for op, _ in cuda]
    assert names.count("reduce_scatter") > 0 and "all_to_all" not in names
    types = {t for op, operands in cuda if op in ("all_gather", "reduce_scatter")
             for _, t in operands}
    assert "bf16" in types and "ui16" not in types
    assert "optimization_barrier" in names          # the backward re-gather's ordering


def test_cpu_program_keeps_the_workaround(lowered):
    cpu = lowered["cpu"]
    names = [op for op, _ in cpu]
    assert "reduce_scatter" not in names and names.count("all_to_all") > 0
    assert "bf16" not in {t for op, operands in cpu if op == "all_gather" for _, t in operands}
    assert "optimization_barrier" not in names      # XLA:CPU drops them; the NaN tie instead


def test_bytes_per_parameter_equal_on_both(lowered):
    cpu, cuda = lowered["cpu"], lowered["cuda"]
    assert _bytes(cpu, "all_gather", {"ui16"}) == _bytes(cuda, "all_gather", {"bf16"}) > 0
    assert _bytes(cpu, "all_to_all", {"ui16"}) == _bytes(cuda, "reduce_scatter", {"bf16"}) > 0
    assert _bytes(cpu, "all_gather", {"f32"}) == _bytes(cuda, "all_gather", {"f32"})
    assert _bytes(cpu, "all_reduce", {"f32"}) == _bytes(cuda, "all_reduce", {"f32"})


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 2])
def test_stages_0_to_2_move_bf16_on_cuda(stage):
    """Under bf16 compute, stages 0-2 reduce gradients and (stages 1-2) gather the updated
    parameters in 16 bits: on CUDA as native bf16 reduce-scatters and all-gathers (stage 0-1's
    all-reduce is its two halves), on CPU as the raw-bits workaround, with the same bytes; only
    the float32 loss and token count scalars are all-reduced."""
    ops = _lower(stage=stage)
    cpu, cuda = ops["cpu"], ops["cuda"]
    names = {op for op, _ in cuda}
    assert "all_to_all" not in names and {"reduce_scatter", "all_gather"} <= names
    assert {t for op, operands in cuda if op in ("all_gather", "reduce_scatter")
            for _, t in operands} == {"bf16"}
    assert all(math.prod(shape) == 1 and t == "f32"
               for op, operands in cuda if op == "all_reduce" for shape, t in operands)
    assert _bytes(cpu, "all_gather", {"ui16"}) == _bytes(cuda, "all_gather", {"bf16"}) > 0
    assert _bytes(cpu, "all_to_all", {"ui16"}) == _bytes(cuda, "reduce_scatter", {"bf16"}) > 0
