"""ZeRO-Offload of the optimizer (`ZeroConfig.offload_optimizer="cpu"`) and ZeRO-Infinity's
parameter offload (`offload_param="cpu"`) on JAX memory kinds.

DeepSpeed's ZeRO-Offload (Ren et al. 2021, §4) keeps the float32 master weights and the
optimizer moments in host memory, so between steps a device holds its parameter partition only.
Here that is a placement, not a second engine: the state's shardings carry a host memory kind
(`pinned_host` with `offload_pin_memory`, DeepSpeed's `pin_memory`; else `unpinned_host`), so
`init`, the step's donated input and output, and checkpoints all keep them there:

    state.opt_state              every leaf                               host
    state.params[p].master       MasterWithCopy's float32 partition      host
                                 (under bf16/fp16 compute: stages 1-2, and
                                 every trainable leaf at stage 3)
    state.params[p].compute      its 16-bit copy, what the pass reads     device
                                 (replicated at stages 1-2 and for stage 3's persistent
                                 leaves; stage 3's partitioned leaves keep a 16-bit partition,
                                 as DeepSpeed's stage 3 does: `sharding.plan._compute_copy_dtype`)
    state.params[p]              under float32 compute                   device
                                 (the parameter is itself the float32 master: a host copy
                                 would hold the same bits, so none is kept)

Where the update runs, chosen once when the step is built (`host_update.update_placement`, said
in `step.describe()`):

* on the host, where it can be traced there (SGD, Adam/AdamW, Lion, RMSProp, ... on JAX 0.10 and
  0.12): `engine.host_update` runs the optax update under `compute_on("device_host")` inside the
  step's `jit` (`zeroxla.compat.memory`), on host-resident operands only. The reduced gradients go
  to the host after their reduction (as DeepSpeed copies them to the CPU), the masters, parameter
  partitions and optimizer state are updated where they are stored, and only what the device stores
  comes back (stage 3's 16-bit partition, in 16 bits; persistent leaves' new values). The device
  never holds an offloaded master or partition whole, nor the offloaded optimizer state.
* on the device with explicit transfers, where host compute cannot be traced: JAX (0.10 and 0.12)
  refuses some optax transformations under `compute_on` (`optax.clip_by_global_norm`,
  `lamb`/`lars`'s `scale_by_trust_ratio`, `adafactor`, `adagrad`: "memory_space of all inputs passed
  to `add` must be the same", a device-typed constant or temporary meets a host-typed array; the
  `lax.cond` of `optax.MultiSteps` and `optax.apply_if_finite`: "cond branches must have equal
  output types", for the same reason), and a ZeRO step must run every transformation exactly.
  `resident` then brings the offloaded parts in (`jax.device_put` to the device memory kind, inside
  the step's `jit`) just before `engine.apply` runs the update, and `offloaded` sends the new
  optimizer state and master back right after, as in JAX's own optimizer-offload recipe; the device
  holds every offloaded partition for the update. `make_step` warns, naming the transformation.

Either way the step is bit-identical to the non-offloaded one (`tests/zeroxla/engine/
test_offload.py`, `test_param_offload.py`: losses and states), but where offload changes the
stored layout (stage 3 under fp16 with the optimizer offloaded keeps master and 16-bit copy
apart: a few master entries differ in their last bit, as that test measures). When the
copies start is XLA's scheduler's choice: an `optimization_barrier` with the gradients' norm
would pin them after the gradient pass, but it changes how XLA:CPU fuses the update (measured:
the offloaded fp16 step then drifts from the non-offloaded one by ulps, which AdamW amplifies),
so it is not used.

Parameter offload (ZeRO-Infinity's `offload_param="cpu"`, stage 3) keeps every partitioned
parameter's partition (stage 3's float32 master, and frozen leaves' partitions or codes) in host
memory too. Inside the gradient pass a partition is fetched, one unit at a time, just before its
all-gather (`fetch`: a `jax.device_put` to the device, in the layer loop's iteration, so the
copy of layer i+1 is issued beside layer i's compute like its gather) and dropped with the
gathered unit; nothing of it is held on the device between units. The pass differentiates
device zeros beside each stored partition (`PartitionSink.sink`, ZeRO-2's gradient-sink
pattern), so the reduce-scattered gradient stays on the device until the update reads it. The
update then runs on the host, where the partitions are (the
gradient sent there, the optimizer state too when it is not offloaded itself, and back after),
or, for a transformation JAX cannot trace there, on the device with the partitions brought in
(`resident`) and sent back (`offloaded`).

Under the pipeline, optimizer offload runs as in the plain step (the update is shared); what
would change the executor's gradient pass is refused by name (`check_offload`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding

from zeroxla.collectives.zero import sink_zeros
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.stored_forms import MasterWithCopy
from zeroxla.sharding.plan import ShardingPlan

DEVICE_KIND = "device"


class OffloadError(ValueError):
    """An offload setting this step cannot run (named, with the reason)."""


def check_offload(config: ZeroConfig, plan: ShardingPlan, *, pipelined: bool) -> None:
    """Refuses, by field, what is accepted as DeepSpeed spells it but not built here: under the
    pipeline, what changes its gradient pass (parameter partitions in host memory, or stage 3's
    16-bit partitions beside offloaded masters: the executor differentiates its stage's values
    itself, without `PartitionSink`s). Optimizer offload changes only the update, which the
    pipelined step shares, so it is accepted otherwise."""
    if not pipelined:
        return
    if config.offload_param != "none":
        raise OffloadError(
            f"ZeroConfig.offload_param={config.offload_param!r} with pipeline= is not built (the "
            "pipeline executor reads its stage's partitions from device memory); use "
            "offload_param='none' with a pipeline, or no pipeline")
    copies = [leaf.path for leaf in plan.leaves if leaf.params_partitioned
              and leaf.has_compute_copy]
    if copies:
        raise OffloadError(
            f"ZeroConfig.offload_optimizer={config.offload_optimizer!r} at stage 3 under "
            f"{config.compute_dtype} with pipeline= is not built: its partitions ({copies[0]}, "
            "...) would be 16-bit copies beside host masters, which the pipeline executor does "
            "not differentiate; use compute_dtype='float32', ZeRO stage 1-2, or no pipeline")


def _with_kind(tree: Any, kind: str) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), tree,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def _offloaded_params(params: dict[str, Any], config: ZeroConfig,
                      plan: ShardingPlan) -> dict[str, Any]:
    """`params`' shardings with what offload keeps in host memory: every separate float32
    master (`MasterWithCopy`) under `offload_optimizer`, every partitioned leaf's partition
    under `offload_param` (always pinned: `ZeroConfig.param_offload_memory_kind`)."""
    out = dict(params)
    if config.offload_param != "none":
        for path in _partitions(plan):
            out[path] = _with_kind(params[path], config.param_offload_memory_kind)
    if config.offload_optimizer != "none":
        for path in _masters(plan):
            out[path] = MasterWithCopy(
                master=params[path].master.with_memory_kind(config.offload_memory_kind),
                compute=out[path].compute)
    return out


def host_shardings(config: ZeroConfig, plan: ShardingPlan, params: dict[str, Any],
                   opt_state: Any) -> tuple[dict[str, Any], Any]:
    """The stored state's (params, opt_state) shardings with the offloaded parts in host
    memory; unchanged without offload."""
    if config.offload_optimizer != "none":
        opt_state = _with_kind(opt_state, config.offload_memory_kind)
    return _offloaded_params(params, config, plan), opt_state


def _moved_params(layout: Any, state: Any, params: dict[str, Any]) -> dict[str, Any]:
    """`state.params` with each offloaded one put on its sharding in `params`."""
    paths = _offloaded_param_paths(layout.config, layout.plan)
    return {**state.params, **{p: jax.device_put(state.params[p], params[p]) for p in paths}}


def resident(layout: Any, state: Any) -> Any:
    """`state` with its offloaded parts moved onto the device (inside `jit`: an explicit
    host-to-device copy); `state` itself without offload."""
    config = layout.config
    if not config.offloads:
        return state
    shardings = layout.state_shardings
    params = _moved_params(layout, state, _with_kind(shardings.params, DEVICE_KIND))
    opt_state = state.opt_state if config.offload_optimizer == "none" else jax.device_put(
        state.opt_state, _with_kind(shardings.opt_state, DEVICE_KIND))
    return state.replace(params=params, opt_state=opt_state)


def offloaded(layout: Any, state: Any) -> Any:
    """`state` (on the device) with its offloaded parts sent back to host memory."""
    config = layout.config
    if not config.offloads:
        return state
    shardings = layout.state_shardings
    opt_state = state.opt_state if config.offload_optimizer == "none" else jax.device_put(
        state.opt_state, shardings.opt_state)
    return state.replace(params=_moved_params(layout, state, shardings.params),
                         opt_state=opt_state)


def on_device(tree: Any) -> Any:
    """`tree` with every array held in host memory (an offloaded state's optimizer state and
    masters) copied to device memory, outside `jit`; other leaves as they are. For what reads a
    state on the device after the step: gathering, the Hybrid Engine's reshard."""
    def move(x: Any) -> Any:
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        return x if kind in (None, DEVICE_KIND) else jax.device_put(
            x, x.sharding.with_memory_kind(DEVICE_KIND))
    return jax.tree.map(move, tree)


def _masters(plan: ShardingPlan) -> list[str]:
    return [leaf.path for leaf in plan.trainable_leaves if leaf.has_compute_copy]


def _offloaded_param_paths(config: ZeroConfig, plan: ShardingPlan) -> list[str]:
    """The parameters held (in part) in host memory, in plan order, each once: the float32
    master partitions (`MasterWithCopy`) under `offload_optimizer`, every partitioned leaf's
    partition (frozen ones too) under `offload_param`."""
    return list(dict.fromkeys((_masters(plan) if config.offload_optimizer != "none" else []) + (
        _partitions(plan) if config.offload_param != "none" else [])))


def host_stored_paths(config: ZeroConfig, plan: ShardingPlan) -> frozenset[str]:
    """The trainable leaves whose updated value is stored in host memory (`engine.host_update`
    updates them there): `_offloaded_param_paths` less the frozen leaves."""
    trainable = {leaf.path for leaf in plan.trainable_leaves}
    return frozenset(p for p in _offloaded_param_paths(config, plan) if p in trainable)


def _partitions(plan: ShardingPlan) -> list[str]:
    """The leaves whose parameters stage 3 partitions (what `offload_param` moves)."""
    return [leaf.path for leaf in plan.leaves if leaf.params_partitioned]


# ----------------------------------------------------------------------------------------------
# Offloaded partitions inside the gradient pass.
@dataclasses.dataclass(frozen=True)
class PartitionSink:
    """A trainable partition that the gradient pass reads but does not differentiate: in host
    memory (`offload_param`), or a 16-bit copy whose float32 master is in host memory (stage 3
    with `offload_optimizer` under bf16/fp16: `LeafPlan.has_compute_copy`), either way not the
    float32 device array its gradient must be. `stored` is this device's partition
    (`[L?, *shard_shape]`, read by the gather after `fetch`) and `sink` master-dtype device zeros
    of the same shape, which the pass differentiates: a unit's reduce-scattered float32 gradient
    is its cotangent (`cotangent`), never rounded to 16 bits, and stays on the device."""

    stored: Any
    sink: Any


jax.tree_util.register_dataclass(PartitionSink, ["stored", "sink"], [])


def sinked_paths(config: ZeroConfig, plan: ShardingPlan) -> frozenset[str]:
    """The trainable partitions the gradient pass reaches through a `PartitionSink`: every
    one under `offload_param`, the 16-bit ones (a float32 master in host memory) otherwise."""
    return frozenset(leaf.path for leaf in plan.trainable_leaves if leaf.params_partitioned and (
        config.offload_param != "none" or leaf.has_compute_copy))


def partition_sinks(paths: frozenset[str], plan: ShardingPlan, trainable: dict[str, Any],
                    compute_dtype: Any) -> tuple[dict[str, Any], Any]:
    """`(wrt, as_values)` of the gradient pass: the device zeros it differentiates in place of
    each partition in `paths`, and `as_values(wrt)`, the model's values (`PartitionSink(stored,
    sink)` for those, the rest as they are)."""
    wrt = {p: sink_zeros(plan[p], compute_dtype) if p in paths else v
           for p, v in trainable.items()}
    return wrt, lambda values: {p: PartitionSink(trainable[p], v) if p in paths else v
                                for p, v in values.items()}


def fetch(shard: Any) -> Any:
    """The partition a gather reads, in device memory: a `PartitionSink`'s stored value,
    or a frozen partition held in host memory, copied to the device (ZeRO-Infinity's fetch);
    anything else as it is."""
    if isinstance(shard, PartitionSink):
        shard = shard.stored
    return jax.tree.map(_to_device, shard)


def _to_device(x: Any) -> Any:
    if x is None or jax.typeof(x).memory_space != jax.memory.Space.Host:
        return x
    return jax.device_put(x, jax.memory.Space.Device)


def cotangent(shard: Any, grad: Any) -> Any:
    """`grad`, a unit's reduced gradient partition, as the cotangent of `shard` (the sink of a
    `PartitionSink`); `grad` itself for any other shard."""
    if isinstance(shard, PartitionSink):
        return PartitionSink(stored=None, sink=grad)
    return grad


def describe(config: ZeroConfig, update_placement: str) -> str:
    """One line: what is offloaded, to which memory kind, and where the update runs
    (`update_placement`: `host_update.UpdatePlacement.describe()`)."""
    if not config.offloads:
        return "offload: none (parameters, master weights and optimizer state in device memory)"
    parts = []
    if config.offload_optimizer != "none":
        parts.append(f"optimizer state and float32 master partitions in "
                     f"{config.offload_memory_kind} memory")
    if config.offload_param != "none":
        parts.append(f"stage 3's parameter partitions in {config.param_offload_memory_kind} "
                     "memory (each unit's fetched to the device just before its all-gather)")
    return f"offload: {'; '.join(parts)}; update runs on {update_placement}"
