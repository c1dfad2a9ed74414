"""ZeRO-Offload of the optimizer (`ZeroConfig.offload_optimizer="cpu"`) on JAX memory kinds.

DeepSpeed's ZeRO-Offload (Ren et al. 2021, §4) keeps the float32 master weights and the
optimizer moments in host memory, so between steps a device holds its parameter partition only.
Here that is a placement, not a second engine: the state's shardings carry a host memory kind
(`pinned_host` with `offload_pin_memory`, DeepSpeed's `pin_memory`; else `unpinned_host`), so
`init`, the step's donated input and output, and checkpoints all keep them there:

    state.opt_state              every leaf                               host
    state.params[p].master       MasterWithCopy's float32 partition      host
                                 (stages 1-2 under bf16/fp16 compute, and
                                 stage 3's persistent leaves)
    state.params[p]              what the gradient pass reads            device
                                 (under float32 compute, and for stage 3's partitions, this
                                 parameter is itself the float32 master: a host copy would hold
                                 the same bits, so none is kept)

Where the update runs: on the device, with explicit transfers. `resident` brings the offloaded
parts in (`jax.device_put` to the device memory kind, inside the step's `jit`) just before
`engine.apply` runs the optax update, and `offloaded` sends the new optimizer state and master
back to the host right after. Host compute (`jax.experimental.compute_on("device_host")`) was
tried on JAX 0.10's CPU backend: it runs elementwise transformations (SGD, AdamW), but fails to
trace others (`optax.clip_by_global_norm`: "memory_space of all inputs passed to `add` must be
the same", a device-typed constant meets a host-typed array), and a ZeRO step must run every optax
transformation exactly; so the update is not placed on the host. Its state is transferred in
and out each step, as in JAX's own optimizer-offload recipe. When the copy in starts is XLA's
scheduler's choice: an `optimization_barrier` with the gradients' norm would pin it after the
gradient pass, but it changes how XLA:CPU fuses the update (measured: the offloaded fp16 step
then drifts from the non-offloaded one by ulps, which AdamW amplifies), so it is not used; the
step is bit-identical to the non-offloaded one (`tests/zeroxla/engine/test_offload.py`).

Parameter offload (`offload_param`) and offload under the pipeline are refused by name
(`check_offload`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.leaf_plan import MasterWithCopy
from zeroxla.sharding.plan import ShardingPlan

DEVICE_KIND = "device"
# Where `engine.apply` runs the optax update when the optimizer is offloaded (see above).
UPDATE_PLACEMENT = "device (explicit host<->device transfers around the update)"


class OffloadError(ValueError):
    """An offload setting this step cannot run (named, with the reason)."""


def check_offload(config: ZeroConfig, *, pipelined: bool) -> None:
    """Refuses, by field, what is accepted as DeepSpeed spells it but not built here."""
    if config.offload_param != "none":
        raise OffloadError(
            f"ZeroConfig.offload_param={config.offload_param!r} is not built: parameter "
            "partitions stay in device memory (ZeRO-Infinity's parameter offload needs each "
            "layer's partition moved in before its all-gather); use offload_param='none' "
            "(offload_optimizer='cpu' is built)")
    if config.offload_optimizer != "none" and pipelined:
        raise OffloadError(
            f"ZeroConfig.offload_optimizer={config.offload_optimizer!r} with pipeline= is not "
            "built (the pipelined state's offload is untested); use offload_optimizer='none' "
            "with a pipeline, or no pipeline")


def _with_kind(tree: Any, kind: str) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), tree,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def _offloaded_params(params: dict[str, Any], plan: ShardingPlan, kind: str) -> dict[str, Any]:
    """`params`' shardings with every separate float32 master (`MasterWithCopy`) on `kind`."""
    out = dict(params)
    for leaf in plan.trainable_leaves:
        if leaf.has_compute_copy:
            spec = params[leaf.path]
            out[leaf.path] = MasterWithCopy(master=spec.master.with_memory_kind(kind),
                                            compute=spec.compute)
    return out


def host_shardings(config: ZeroConfig, plan: ShardingPlan, params: dict[str, Any],
                   opt_state: Any) -> tuple[dict[str, Any], Any]:
    """The stored state's (params, opt_state) shardings with the offloaded parts in host
    memory; unchanged when `offload_optimizer` is "none"."""
    if config.offload_optimizer == "none":
        return params, opt_state
    kind = config.offload_memory_kind
    return _offloaded_params(params, plan, kind), _with_kind(opt_state, kind)


def resident(layout: Any, state: Any) -> Any:
    """`state` with its offloaded parts moved onto the device (inside `jit`: an explicit
    host-to-device copy); `state` itself without offload."""
    if layout.config.offload_optimizer == "none":
        return state
    shardings = layout.state_shardings
    params = _offloaded_params(shardings.params, layout.plan, DEVICE_KIND)
    moved = {p: jax.device_put(state.params[p], params[p]) for p in _masters(layout.plan)}
    return state.replace(params={**state.params, **moved},
                         opt_state=jax.device_put(state.opt_state,
                                                  _with_kind(shardings.opt_state, DEVICE_KIND)))


def offloaded(layout: Any, state: Any) -> Any:
    """`state` (on the device) with its offloaded parts sent back to host memory."""
    if layout.config.offload_optimizer == "none":
        return state
    shardings = layout.state_shardings
    moved = {p: jax.device_put(state.params[p], shardings.params[p])
             for p in _masters(layout.plan)}
    return state.replace(params={**state.params, **moved},
                         opt_state=jax.device_put(state.opt_state, shardings.opt_state))


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


def describe(config: ZeroConfig) -> str:
    """One line: what is offloaded, to which memory kind, and where the update runs."""
    if config.offload_optimizer == "none":
        return "offload: none (parameters, master weights and optimizer state in device memory)"
    return (f"offload: optimizer state and float32 master partitions in "
            f"{config.offload_memory_kind} memory; update runs on {UPDATE_PLACEMENT}")
