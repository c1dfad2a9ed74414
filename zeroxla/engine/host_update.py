"""The optimizer update in host memory: ZeRO-Offload's CPU optimizer step on JAX memory kinds.

With the optimizer or the parameters offloaded (`engine.offload`), the optax update runs where
its operands are stored, as one host computation inside the step's `jit`
(`jax.experimental.compute_on("device_host")`, spelled per JAX version by
`zeroxla.compat.memory.host_computation`: `host_update`'s `update`), on host-resident operands
only:

    into the host computation                       from
      the reduced gradients                         device, after their reduction (DeepSpeed
                                                    copies its gradient partitions to the CPU)
      master / parameter partitions                 host, where they are stored
      the optimizer state                           host; under offload_param alone, the device
      device-stored leaves' optimizer inputs        device (this device's part: persistent
                                                    leaves, optimizer offload's float32 params)
    computed there: the optax update, the padding back, fp16's overflow skip (on host values)
    out of it                                       to
      new master / parameter partitions             stay on the host
      the optimizer state                           stays on the host; under offload_param
                                                    alone, back to the device (skip there)
      stage 3's 16-bit partition (`MasterWithCopy`) the device, in 16 bits (skip there), or
                                                    the host under offload_param
      device-stored leaves' new values              the device, then stored and all-gathered
                                                    there as without offload (`stored_update`)

So the device never receives an offloaded master or partition whole: with parameter offload,
the parameters it holds are the gradient pass's gathered working set only. (JAX 0.10 types an
`unpinned_host` array as device memory, `core.mem_kind_to_space`, so state kept there is put in
pinned host memory for the computation and back; 0.12 does the same.)

JAX (0.10 and 0.12 alike) cannot trace every optax transformation under host compute: it types
what is made there (constants, zeros, a result of scalars alone) for device memory, beside the
host-typed operands, and refuses the mix. Some transformations meet it in one primitive
(`optax.clip_by_global_norm`, `scale_by_trust_ratio` of `lamb`/`lars`, `adafactor`, `adagrad`,
`zero_nans`: a `ValueError`, "memory_space of all inputs passed to `add` must be the same");
wrappers whose `lax.cond` returns an operand from one branch and a value made there from the
other meet it in the cond's type check (`optax.MultiSteps`, its accumulate-or-apply;
`optax.apply_if_finite`, its skip: a `TypeError`, "cond branches must have equal output types",
naming a `float32<host>[...]` against a `float32[...]`). A ZeRO step must run every
transformation exactly, so `update_placement` traces the host update once, when the step is
built; a transformation that fails so takes the device update with explicit transfers
(`offload.resident` / `offload.offloaded`, `engine.apply`), named in `step.describe()` and in
a warning. Any other error is re-raised.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.compat.memory import host_computation
from zeroxla.engine import offload
from zeroxla.engine.logical import abstract_storage_state
from zeroxla.engine.optimizer import optax_transformation
from zeroxla.engine.update import (all_gather_update, constrain, optimizer_input, stored_update,
                                   with_rounding)
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.stored_forms import MasterWithCopy

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
# The start of the ValueError JAX raises when one primitive meets host- and device-typed arrays.
MEMORY_SPACE_ERROR = "memory_space of all inputs passed to"
HOST_TYPE = "<host>["          # how JAX prints a host-typed array's type: float32<host>[2,60]
_OPTIMIZER_FILE = "zeroxla/engine/optimizer.py"   # `ShardedOptimizer.update`: optax runs below
_LIBRARY_DIRS = ("/optax/", "/jax/", "/zeroxla/", "/flax/", "/numpy/")


@dataclasses.dataclass(frozen=True)
class UpdatePlacement:
    """Where `engine.apply` runs the optax update: `on_host`, or on the device with explicit
    transfers because `refused_by` (the optax transformation, and JAX's error) cannot be traced
    under host compute."""

    on_host: bool
    refused_by: str = ""

    def describe(self) -> str:
        if self.on_host:
            return ("the host (compute_on('device_host'): gradients copied to host memory after "
                    "their reduction; master, parameter partitions and optimizer state updated "
                    "where they are stored)")
        reason = f": {self.refused_by}" if self.refused_by else ""
        return f"device (explicit host<->device transfers around the update{reason})"


def update_placement(layout: Any) -> UpdatePlacement:
    """The host update when something is offloaded and it traces (`jax.eval_shape` over the
    abstract stored state); else the device update, with the failing transformation named
    (and a warning, so the fallback is never silent). `ShardedOptimizer.check` has traced
    the same update on device-typed values when the layout was built, so an error of host-
    and device-typed values met here is host compute's alone."""
    if not layout.config.offloads:
        return UpdatePlacement(on_host=False)
    state = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                  sharding=sharding),
                         abstract_storage_state(layout), layout.state_shardings)
    grads = {leaf.path: jax.ShapeDtypeStruct(leaf.shape, leaf.master_dtype)
             for leaf in layout.plan.trainable_leaves}
    overflow = (jax.ShapeDtypeStruct((), jnp.bool_) if layout.config.skips_overflow
                else None)
    try:
        jax.eval_shape(lambda s, g, o: host_update(layout, s, g, o), state, grads, overflow)
    except (ValueError, TypeError) as err:
        transformation = _failing_transformation(err)
        if not _host_typing_error(err) or transformation is None:
            raise
        refused_by = (f"{transformation} does not trace under compute_on('device_host') on "
                      f"JAX {jax.__version__}: {_first_mismatch(err)}")
        # stacklevel 4: make_step's caller (ZeroStep.__init__ and make_step in between).
        warnings.warn(f"ZeRO-Offload: the optimizer update runs on the device with explicit "
                      f"transfers, not on the host: {refused_by}. The device then holds the "
                      "offloaded optimizer state and partitions during the update",
                      stacklevel=4)
        return UpdatePlacement(on_host=False, refused_by=refused_by)
    return UpdatePlacement(on_host=True)


def _host_typing_error(err: BaseException) -> bool:
    """Whether `err` is JAX refusing host- and device-typed values together: a primitive's
    `ValueError` ("memory_space of all inputs passed to ..."), or the `TypeError` of a type
    check between two values' types, one printed `<host>` (`lax.cond`/`switch` branch outputs,
    `while_loop`/`scan` carries)."""
    message = str(err)
    if isinstance(err, ValueError):
        return MEMORY_SPACE_ERROR in message
    return isinstance(err, TypeError) and HOST_TYPE in message


def _first_mismatch(err: BaseException) -> str:
    """JAX's message for `err` in one line: its first line, and for a type check (which lists
    every mismatching leaf, one per line) the first mismatch that names a host-typed value."""
    lines = [line.strip(" *;.") for line in str(err).splitlines() if line.strip()]
    first = next((line for line in lines[1:] if HOST_TYPE in line), None)
    return lines[0] if first is None else f"{lines[0]} ({first}; ...)"


def _failing_transformation(err: BaseException) -> str | None:
    """The transformation inside the optax update that raised `err`: the innermost optax
    transformation's update in the traceback (`optimizer.optax_transformation`: e.g.
    `optax.clip_by_global_norm` inside `chain`, `optax.MultiSteps` itself), or else the
    innermost function of the user's own code under `ShardedOptimizer.update`; None when `err`
    was not raised inside the optimizer's update (then it is not the optimizer's to explain)."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    starts = [i for i, code in enumerate(frames)
              if code.co_name == "update" and code.co_filename.endswith(_OPTIMIZER_FILE)]
    if not starts:
        return None
    inside = frames[starts[-1] + 1:]
    transformation = optax_transformation(inside)
    if transformation is not None:
        return transformation
    own = [c for c in inside if not any(part in c.co_filename for part in _LIBRARY_DIRS)]
    if not own:
        return None
    return f"{getattr(own[-1], 'co_qualname', own[-1].co_name)} ({own[-1].co_filename})"


def host_update(layout: Any, state: Any, logical_grads: dict[str, jax.Array],
                overflow: jax.Array | None) -> tuple[dict[str, Any], Any]:
    """`(params, opt_state)` after the optax update run in host memory (see the module
    docstring), each in its stored layout and memory kind; with `overflow` (fp16) the old
    values are kept, selected where they live."""
    config, mesh, axes = layout.config, layout.mesh, layout.axes
    shardings = layout.state_shardings
    trainable = layout.plan.trainable_leaves
    hosted = offload.host_stored_paths(config, layout.plan)
    opt_hosted = config.offload_optimizer != "none"

    def on_host(x: Any) -> Any:
        return jax.tree.map(lambda a: jax.device_put(a, HOST), x)

    # What the host computation reads, all typed for host memory (JAX 0.10 types an
    # `unpinned_host` array as device memory, `core.mem_kind_to_space`: it is put in pinned host
    # memory here; a `pinned_host` one is left where it is).
    masters = on_host({p: _master(state.params[p]) for p in hosted})
    inputs = {leaf.path: on_host(optimizer_input(leaf, state.params[leaf.path], mesh))
              for leaf in trainable if leaf.path not in hosted}
    old_copies = on_host({p: state.params[p].compute for p in hosted
                          if _copy_hosted(shardings, p)})
    opt_state, grads = on_host(state.opt_state), on_host(logical_grads)
    flag = None if overflow is None else on_host(overflow)
    token = on_host(state.step)                     # `with_rounding`'s

    def update(grads, opt_state, masters, inputs, old_copies, old_opt, flag, token):
        params = {leaf.path: leaf.unpad(constrain(masters[leaf.path], mesh, leaf.optimizer_spec))
                  if leaf.path in masters else inputs[leaf.path] for leaf in trainable}
        new_logical, new_opt = layout.sharded_optimizer.update(grads, opt_state, params)
        stored, copies = {}, {}
        for leaf in trainable:
            if leaf.path not in masters:
                continue
            new = constrain(leaf.pad(new_logical[leaf.path]), mesh, leaf.optimizer_spec)
            if leaf.has_compute_copy:
                new, copy = with_rounding(new, leaf.compute_copy_dtype, token)
                copies[leaf.path] = (_kept(flag, old_copies[leaf.path], copy)
                                     if leaf.path in old_copies else copy)
            stored[leaf.path] = _kept(flag, masters[leaf.path], new)
        if old_opt is not None:
            new_opt = _kept(flag, old_opt, new_opt)
        rest = {p: v for p, v in new_logical.items() if p not in masters}
        return stored, copies, rest, new_opt

    # Only the update is the host computation (a `device_put` traced there would lower for the
    # host, without its placement annotation); its results are typed for host memory.
    stored, copies, rest, new_opt = host_computation(update)(
        grads, opt_state, masters, inputs, old_copies, opt_state if opt_hosted else None,
        flag, token)

    new_params = dict(state.params)
    for leaf in trainable:
        p, old = leaf.path, state.params[leaf.path]
        if p in rest:              # stored in device memory: stored as without offload
            new = stored_update(leaf, jax.device_put(rest[p], DEVICE), mesh, axes, state.step)
            new_params[p] = _kept(overflow, old, new)
        elif leaf.has_compute_copy:
            new_params[p] = MasterWithCopy(
                master=jax.device_put(stored[p], shardings.params[p].master),
                compute=_compute_copy(leaf, copies[p], old.compute, overflow, shardings, layout))
        else:
            new_params[p] = jax.device_put(stored[p], shardings.params[p])
    if opt_hosted:
        new_opt = jax.device_put(new_opt, shardings.opt_state)
    else:                          # offload_param alone: the optimizer state is the device's
        new_opt = _kept(overflow, state.opt_state, jax.device_put(new_opt, shardings.opt_state))
    return new_params, new_opt


def _master(stored: Any) -> Any:
    return stored.master if isinstance(stored, MasterWithCopy) else stored


def _copy_hosted(shardings: Any, path: str) -> bool:
    """Whether the leaf at `path` keeps its 16-bit compute copy in host memory (stage 3 with
    `offload_param`), where its overflow skip then runs."""
    sharding = shardings.params[path]
    return (isinstance(sharding, MasterWithCopy)
            and sharding.compute.memory_kind != offload.DEVICE_KIND)


def _compute_copy(leaf: LeafPlan, copy: jax.Array, old: jax.Array, overflow: Any,
                  shardings: Any, layout: Any) -> jax.Array:
    """The new 16-bit compute copy from its host-made rounding `copy`: stored where its
    sharding says (stage 3's partition: to the device unless parameters are offloaded, where
    the skip already ran), or, replicated (stages 1-2, persistent leaves), moved to the device
    in 16 bits and all-gathered there, as without offload."""
    target = shardings.params[leaf.path].compute
    if leaf.params_partitioned:
        if target.memory_kind != offload.DEVICE_KIND:
            return jax.device_put(copy, target)
        return _kept(overflow, old, jax.device_put(copy, target))
    gathered = all_gather_update(jax.device_put(copy, DEVICE), leaf, layout.mesh, layout.axes)
    return _kept(overflow, old, gathered)


def _kept(overflow: Any, old: Any, new: Any) -> Any:
    """`new`, or `old` where the fp16 step overflowed (DeepSpeed's skipped step)."""
    if overflow is None:
        return new
    return jax.tree.map(lambda n, o: jnp.where(overflow, o, n), new, old)
