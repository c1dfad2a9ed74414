"""What the pipeline executor needs of a schedule table and of the step it pipelines, checked
when the step is built; each refusal names the option and the accepted values."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.table import BACKWARD, FORWARD, IDLE, WEIGHT, ScheduleTable

if TYPE_CHECKING:                 # annotations only: this module imports no JAX
    from zeroxla.engine.layout import ZeroLayout


def check_table(table: ScheduleTable) -> None:
    """The executor moves results one hop per tick: what a stage computes at tick t reaches its
    neighbour at tick t + 1. ValueError for a table whose forwards (backwards) do not follow the
    previous (next) stage's forward (backward) of the same micro-batch by exactly one tick, or
    whose weight-gradient pass does not follow the same stage's backward of its micro-batch."""
    S = table.stages
    for t, row in enumerate(table.op):
        for s, op in enumerate(row):
            if op == WEIGHT:
                _check_weight(table, t, s)
                continue
            neighbour = s - 1 if op == FORWARD else s + 1
            if op == IDLE or not 0 <= neighbour < S:
                continue
            ok = (t > 0 and table.op[t - 1][neighbour] == op
                  and table.micro_batch[t - 1][neighbour] == table.micro_batch[t][s])
            if not ok:
                raise ValueError(f"{table.schedule} step {t} stage {s}: its input was not "
                                 f"computed by stage {neighbour} at step {t - 1}; the pipeline "
                                 "executor needs one-hop-per-step tables (1F1B, GPipe, ZB-H1)")


def _check_weight(table: ScheduleTable, t: int, s: int) -> None:
    """W of micro-batch m on stage s at tick t: B of m ran there before, in the same buffer."""
    m, buffer = table.micro_batch[t][s], table.buffer[t][s]
    if not any(table.op[u][s] == BACKWARD and table.micro_batch[u][s] == m
               and table.buffer[u][s] == buffer for u in range(t)):
        raise ValueError(f"{table.schedule} step {t} stage {s}: the weight-gradient pass of "
                         f"micro-batch {m} runs before its backward on that stage")


def check_step(layout: ZeroLayout, config: PipelineConfig) -> None:
    """What the pipelined gradient pass does not support, refused by name."""
    if not isinstance(config, PipelineConfig):
        raise TypeError(f"make_step: pipeline must be a PipelineConfig, got "
                        f"{type(config).__name__}")
    zero = layout.config
    if layout.model_def.state_paths or layout.uses_rng:
        raise ValueError("make_step: pipeline= needs a model without model state or RNG streams "
                         f"(found {list(layout.model_def.state_paths[:3])} "
                         f"{[p for p, _, _ in layout.model_def.rng_leaves[:3]]}); accepted: "
                         "parameters only (no BatchNorm statistics, no Dropout)")
    if zero.uses_zeropp:
        raise ValueError("make_step: ZeRO++ (hpz_partition_size, quantized_weights, "
                         "quantized_gradients, quantized_nontrainable_weights) is not supported "
                         "with pipeline=; accepted: the plain ZeRO stages 0-3")
    k = zero.gradient_accumulation_steps
    if k not in (1, config.micro_batches):
        raise ValueError(f"ZeroConfig.gradient_accumulation_steps={k} with "
                         f"PipelineConfig.micro_batches={config.micro_batches}: under "
                         "pipelining the micro-batches are the accumulation steps; accepted: 1 "
                         f"or {config.micro_batches}")
