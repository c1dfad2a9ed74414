"""Which arrays the gradient pass differentiates, and where each gradient is reduced, per stage.

* stage 0-1: the trainable parameters; every gradient is all-reduced (`psum`) once at the end.
* stage 2 (DeepSpeed's): a leaf with partitioned optimizer state is differentiated through its
  gradient sink (`zeroxla.collectives.zero.GradientSink`), zeros shaped like this device's
  gradient partition; its gradient is reduce-scattered per unit as backward produces it
  (`Zero2Collectives`), so only the partition persists and micro-batches accumulate partitions.
* stage 3: the trainable parameters' shards; partitioned leaves are reduce-scattered per unit
  in backward (`zeroxla.engine.gather`).
At stages 2-3 the leaves left replicated (persistent ones, scalars) are all-reduced at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from zeroxla.collectives import zero as collectives
from zeroxla.collectives.zero import GradientSink, Zero2Collectives, ZeroCollectives
from zeroxla.engine.mesh import MeshAxes
from zeroxla.engine.plan import ShardingPlan


def differentiated(comm: ZeroCollectives, plan: ShardingPlan, trainable: dict[str, jax.Array]
                   ) -> tuple[dict[str, jax.Array], Callable[[dict[str, Any]], dict[str, Any]]]:
    """`(wrt, as_values)`: what the gradient pass differentiates, and `as_values(wrt)`, the
    model's values of those leaves (stage 2: `GradientSink(parameter, sink)`)."""
    if not isinstance(comm, Zero2Collectives):
        return trainable, lambda p: p
    sinked = {leaf.path for leaf in plan.trainable_leaves if leaf.optimizer_partitioned}
    wrt = {p: comm.sink(plan[p]) if p in sinked else v for p, v in trainable.items()}
    return wrt, lambda p: {path: GradientSink(trainable[path], v) if path in sinked else v
                           for path, v in p.items()}


def reduce_gradients(grads: dict[str, jax.Array], plan: ShardingPlan, stage: int,
                     axes: MeshAxes, compute_dtype: Any) -> dict[str, jax.Array]:
    """Sums the trainable leaves' gradients over the data devices (those reduce-scattered in
    backward already are). Under bf16 and fp16 compute the all-reduces travel in the compute
    dtype (DeepSpeed's communication in the training dtype), each device sending its gradient
    divided by the device count, so that fp16's range holds the loss-scaled sum
    (`collectives.zero.all_reduce`); under float32 / float64 they are that dtype's `psum`."""
    wire_dtype = compute_dtype        # 16 bits under bf16/fp16; else a plain psum
    if stage <= 1:
        return collectives.all_reduce(grads, axes, wire_dtype)
    out, replicated = {}, {}
    for leaf in plan.trainable_leaves:
        g = grads[leaf.path]
        if leaf.params_partitioned or (stage == 2 and leaf.optimizer_partitioned):
            out[leaf.path] = g                       # reduce-scattered in backward
        else:
            replicated[leaf.path] = g
    out.update(collectives.all_reduce(replicated, axes, wire_dtype))
    return out
