"""Which arrays the gradient pass differentiates, and where each gradient is reduced, per stage.

* stage 0-1: the trainable parameters; every gradient is all-reduced (`psum`) once at the end.
* stage 2 (DeepSpeed's): a leaf with partitioned optimizer state is differentiated through its
  gradient sink (`zeroxla.collectives.zero.GradientSink`), zeros shaped like this device's
  gradient partition; its gradient is reduce-scattered per unit as backward produces it
  (`Zero2Collectives`), so only the partition persists and micro-batches accumulate partitions.
  A weight used by more than one call (GPT's tied embedding: `embed` and the head's `attend`)
  is reduce-scattered once instead, after autodiff has summed its uses (`reduced_once`).
* stage 3: the trainable parameters' shards; partitioned leaves are reduce-scattered per unit
  in backward (`zeroxla.engine.gather`). A partition in host memory (`offload_param`), or a
  16-bit one whose float32 master is there (`offload_optimizer` under bf16/fp16), is read, not
  differentiated: the pass differentiates float32 device zeros beside it instead
  (`engine.offload.partition_sinks`), so its reduced gradient stays on the device, unrounded.
At stages 2-3 the leaves left replicated (persistent ones, scalars) are all-reduced at the end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

from zeroxla.collectives import zero as collectives
from zeroxla.collectives.zero import GradientSink, Zero2Collectives, ZeroCollectives
from zeroxla.engine.offload import partition_sinks
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.plan import ShardingPlan


def differentiated(comm: ZeroCollectives, plan: ShardingPlan, trainable: dict[str, jax.Array],
                   *, sinked: frozenset[str] = frozenset()
                   ) -> tuple[dict[str, jax.Array], Callable[[dict[str, Any]], dict[str, Any]]]:
    """`(wrt, as_values)`: what the gradient pass differentiates, and `as_values(wrt)`, the
    model's values of those leaves (stage 2: `GradientSink(parameter, sink)`; stage 3's
    partitions in `sinked`, `engine.offload.sinked_paths`: `PartitionSink(partition, sink)`)."""
    if sinked:
        return partition_sinks(sinked, plan, trainable, comm.compute_dtype)
    if not isinstance(comm, Zero2Collectives):
        return trainable, lambda p: p
    sinked = {leaf.path for leaf in plan.trainable_leaves if leaf.optimizer_partitioned}
    wrt = {p: comm.sink(plan[p]) if p in sinked else v for p, v in trainable.items()}
    return wrt, lambda p: {path: GradientSink(trainable[path], v) if path in sinked else v
                           for path, v in p.items()}


def reduced_once(comm: ZeroCollectives, plan: ShardingPlan,
                 forward: Callable[[Counter], Any]) -> frozenset[str]:
    """Stage 2: the leaves whose gradient is reduce-scattered once per micro-batch, after
    autodiff has summed the gradients of all their uses, rather than once per use.

    A unit's gradient is reduce-scattered as backward produces it, so a weight used by two
    module calls would be reduced twice, each time in full (the tied embedding's traffic
    doubled; under float32 XLA happens to merge the two `psum_scatter`s, but not the 16-bit
    wire format's all-to-alls). DeepSpeed reduces a tied weight once, when both uses have
    accumulated into its `.grad`. Which weights are used more than once depends on how the
    loss function calls the model (GPT's embedding module is called twice, as `embed` and as
    the head's `attend`), so it is counted, not read from the module tree: `forward(uses)`
    runs the forward with the step's stand-ins counting into `uses` the calls that gather each
    leaf; it runs under `jax.eval_shape` while the step is traced (no compute, nothing kept in
    the program). Those leaves then skip the per-call units (`wrap.zero3_module`): their uses'
    gradients are summed by autodiff in the compute dtype (as into DeepSpeed's 16-bit `.grad`)
    and reduce-scattered once, with the per-unit scatter's wire functions; each is held in full
    from its last use in backward to its first, the price DeepSpeed pays too.
    Stacked leaves are never chosen: a `LayerStack` called twice keeps scattering per layer in
    the scan, which is what bounds stage 2's gradient memory to a partition. Stages 0, 1 and 3
    choose none (stage 3 gathers per use; its reduce-scatters are per gather).
    """
    if not isinstance(comm, Zero2Collectives):
        return frozenset()
    uses: Counter = Counter()
    jax.eval_shape(lambda: forward(uses))
    return frozenset(path for path, n in uses.items() if n > 1 and not plan[path].stacked)


def reduce_gradients(grads: dict[str, jax.Array], plan: ShardingPlan, stage: int,
                     axes: MeshAxes, compute_dtype: Any) -> dict[str, jax.Array]:
    """Sums the trainable leaves' gradients over the data devices (those reduce-scattered in
    backward already are), each over its own `data_axes` (an expert leaf's expert-data group:
    the devices holding the same experts). Under bf16 and fp16 compute the all-reduces travel
    in the compute dtype (DeepSpeed's communication in the training dtype), each device sending
    its gradient divided by the device count, so that fp16's range holds the loss-scaled sum
    (`collectives.zero.all_reduce`); under float32 / float64 they are that dtype's `psum`."""
    wire_dtype = compute_dtype        # 16 bits under bf16/fp16; else a plain psum
    out: dict[str, jax.Array] = {}
    groups: dict[tuple[str, ...], dict[str, jax.Array]] = {}   # by the leaves' data axes
    for leaf in plan.trainable_leaves:
        g = grads[leaf.path]
        if stage >= 2 and (leaf.params_partitioned
                           or (stage == 2 and leaf.optimizer_partitioned)):
            out[leaf.path] = g                       # reduce-scattered in backward
        else:        # an expert leaf sums over its expert-data group only
            groups.setdefault(leaf.data_axes or axes.data, {})[leaf.path] = g
    for names, replicated in groups.items():
        out.update(collectives.all_reduce(replicated, names, wire_dtype))
    return out
