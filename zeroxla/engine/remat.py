"""How a gathered unit (a layer, a module call) is differentiated, and what it keeps for backward.

ZeRO-3 releases a unit's gathered parameters after its forward and re-gathers them in backward.
What else the unit keeps from forward to backward is the *activation policy*
(`ZeroConfig.remat`):

* `"none"` (DeepSpeed's default): forward runs the unit under `jax.vjp` and keeps the vjp's
  residuals - the activations autodiff needs - except those that *are* the gathered parameters.
  Those slots are left empty and filled, in backward, with the re-gathered parameters, so no
  gathered weight is kept from forward to backward and nothing is recomputed.
* `"full"`: forward keeps only the unit's inputs; backward re-runs the unit under `jax.vjp`
  (full rematerialisation, about one more forward's FLOPs, the least activation memory).
* a `jax.checkpoint_policies` name (`"dots_saveable"`, ...): forward runs the unit under
  `jax.checkpoint(policy=...)` inside `jax.vjp`, keeping what the policy saves (and the unit's
  inputs); backward recomputes the rest. The gathered parameters are, again, never kept.
* `"offload"` (DeepSpeed ALST's checkpoint offload): what "full" keeps - the unit's float inputs,
  a layer's input carry - kept in host memory (the `pinned_host` memory kind) instead of device
  memory, and everything else recomputed, as "full" does. The inputs are named
  (`checkpoint_name(x, OFFLOADED_INPUT)`) and the unit runs under `jax.checkpoint` with
  `save_and_offload_only_these_names`, so JAX itself moves them out after forward and back in
  for backward. Same FLOPs and the same values as "full"; device memory no longer grows with
  the number of layers times the sequence. Refused, by name, on a platform whose devices have no
  `pinned_host` memory (`check_offload_platform`).

A residual *derived* from a parameter (a transposed or converted weight) is an ordinary
residual and is kept: the models here use their parameters as they come (gathered in the
compute dtype), and the ZeRO-3 memory test bounds the bytes kept per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zeroxla.collectives.wire import is_16bit_float
from zeroxla.engine.cotangent_layout import pull_permuted
from zeroxla.sharding.leaf_plan import LeafPlan

FULL, NONE, OFFLOAD = "full", "none", "offload"   # the others: `config.REMAT_POLICIES`
HOST_KIND = "pinned_host"              # where "offload" keeps a unit's inputs
OFFLOADED_INPUT = "zeroxla_offloaded_input"   # the checkpoint name of those inputs


def host_memory_kinds(device: Any) -> tuple[str, ...]:
    """The memory kinds `device` addresses ("device", "pinned_host", ...); () if it says none."""
    try:
        return tuple(m.kind for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, RuntimeError):
        return ()


def check_offload_platform(devices: Any = None) -> None:
    """Refuses remat "offload" where a device has no `pinned_host` memory kind, by name."""
    for device in (jax.devices() if devices is None else devices):
        kinds = host_memory_kinds(device)
        if HOST_KIND not in kinds:
            raise ValueError(
                f"ZeroConfig.remat={OFFLOAD!r} needs the {HOST_KIND!r} memory kind, which "
                f"{device.platform} device {device.id} does not have (its memory kinds: "
                f"{', '.join(kinds) or 'none reported'}); accepted here: 'full' (the same "
                "recompute, inputs kept in device memory), 'none' or a checkpoint policy")


def _offload_policy() -> Any:
    """The `jax.checkpoint` policy of remat "offload": save nothing on the device, offload the
    named unit inputs to host memory (jax 0.10 and 0.12 spell it alike)."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[OFFLOADED_INPUT],
        offload_src="device", offload_dst=HOST_KIND)


def _checkpointed(fn: Callable, policy: str) -> Callable:
    """`fn(params, float_inputs)` under `jax.checkpoint` with remat `policy`'s saving rule."""
    if policy != OFFLOAD:
        return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy))
    check_offload_platform()

    def named_inputs(params, float_inputs):
        # Every use of an input goes through its named copy: the copy is what JAX offloads,
        # and backward's recompute reads it, not the device-resident original.
        return fn(params, [checkpoint_name(x, OFFLOADED_INPUT)
                           for x in float_inputs])
    return jax.checkpoint(named_inputs, policy=_offload_policy())


# ----------------------------------------------------------------------------------------------
# Differentiating with respect to the float leaves of a pytree only.
def is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def split_floats(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any], list[bool]]:
    """(float leaves, rebuild(float leaves) -> tree, mask) of a pytree."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [is_float(leaf) for leaf in leaves]

    def rebuild(floats):
        it = iter(floats)
        return jax.tree.unflatten(treedef, [next(it) if m else leaf
                                            for leaf, m in zip(leaves, mask)])
    return [leaf for leaf, m in zip(leaves, mask) if m], rebuild, mask


def _cotangents_for(treedef: Any, mask: tuple[bool, ...], float_cotangents: list[Any]) -> Any:
    """A cotangent for a tree of structure `treedef`: the given ones at its float leaves
    (`mask`), None elsewhere."""
    it = iter(float_cotangents)
    return jax.tree.unflatten(treedef, [next(it) if m else None for m in mask])


def cotangent_tree(tree: Any, float_cotangents: list[Any]) -> Any:
    """A cotangent for `tree`: the given ones at its float leaves, None elsewhere."""
    leaves, treedef = jax.tree.flatten(tree)
    return _cotangents_for(treedef, tuple(is_float(leaf) for leaf in leaves), float_cotangents)


def _linearized(fn: Callable, leaves: tuple[LeafPlan, ...], full: list[Any], inputs: Any,
                policy: str | None) -> tuple[Any, Callable, list[int]]:
    """`(out, vjp, trainable)` of `out = fn(full, inputs)` with respect to the trainable entries
    of `full` (indices `trainable`; frozen ones stay constants) and the float leaves of
    `inputs`; under `jax.checkpoint(policy=...)` when `policy` names one."""
    trainable = [i for i, leaf in enumerate(leaves) if leaf.trainable]
    floats, rebuild, _ = split_floats(inputs)

    def of_differentiable(params, float_inputs):
        merged = list(full)
        for i, p in zip(trainable, params):
            merged[i] = p
        return fn(merged, rebuild(float_inputs))

    if policy is not None:
        of_differentiable = _checkpointed(of_differentiable, policy)
    out, vjp = jax.vjp(of_differentiable, [full[i] for i in trainable], floats)
    return out, vjp, trainable


def _assemble(trainable: list[int], n: int, g_trainable: list[Any]) -> list[Any]:
    g_full: list[Any] = [None] * n
    for i, gi in zip(trainable, g_trainable):
        g_full[i] = gi
    return g_full


def _pull(pullback: Callable, cotangent: Any, permuted: bool) -> tuple[Any, Any]:
    """`pullback(cotangent)`; with `permuted`, weight cotangents that a transposed dot makes
    come back in the dot's dim order, for the reduce-scatter (`cotangent_layout`)."""
    return pull_permuted(pullback, cotangent) if permuted else pullback(cotangent)


def vjp(fn: Callable, leaves: tuple[LeafPlan, ...], full: list[Any], inputs: Any,
        cotangent: Any, permuted: bool = False) -> tuple[list[Any], Any]:
    """Cotangents of `out = fn(full, inputs)` for the trainable entries of `full` (None for
    frozen ones, which stay constants of the vjp) and for the float leaves of `inputs` (None for
    the rest): the forward recomputed (remat "full"). `permuted`: see `_pull`."""
    _, pullback, trainable = _linearized(fn, leaves, full, inputs, None)
    g_trainable, g_floats = _pull(pullback, cotangent, permuted)
    return _assemble(trainable, len(full), g_trainable), cotangent_tree(inputs, g_floats)


# ----------------------------------------------------------------------------------------------
# remat "none" and checkpoint policies: the vjp's residuals, less the gathered parameters.
def _from_bits(kept: list[Any], dtypes: tuple[Any, ...]) -> list[Any]:
    """The kept residuals as their own dtypes: `linearize_keeping` keeps each 16-bit float one as
    its uint16 bits. The layer loop stacks them and reads them back layer by layer through
    their bits (`layer_loop._Stacked`: XLA:CPU has no 16-bit float dynamic-slice); kept as bits
    from the start, the stack is never bitcast whole, which XLA:CPU does as a copy: at the turn
    from forward to backward the stack of every layer's residuals (remat "offload": the host
    stack) was held twice, and that moment was the step's peak (Llama-3.1-8B, T=64K)."""
    return [lax.bitcast_convert_type(r, dtype) if r.dtype != dtype else r
            for r, dtype in zip(kept, dtypes)] if dtypes else kept


@dataclasses.dataclass(frozen=True)
class VjpLayout:
    """The static part of a kept vjp: its pytree structure, which residual slots are gathered
    parameters (`slots[k]` = index into `full`, None for a kept residual), the trainable
    indices, and the structure of the unit's inputs (for their cotangent)."""

    treedef: Any
    slots: tuple[int | None, ...]
    trainable: tuple[int, ...]
    inputs_treedef: Any
    inputs_floats: tuple[bool, ...]
    kept_dtypes: tuple[Any, ...] = ()     # the kept residuals' own dtypes (`_as_bits`)

    def cotangents(self, kept: list[Any], full: list[Any], cotangent: Any,
                   permuted: bool = False) -> tuple[list[Any], Any]:
        """`vjp`'s result from the kept residuals and the re-gathered parameters `full`."""
        it = iter(_from_bits(kept, self.kept_dtypes))
        residuals = [full[slot] if slot is not None else next(it) for slot in self.slots]
        pullback = jax.tree.unflatten(self.treedef, residuals)
        g_trainable, g_floats = _pull(pullback, cotangent, permuted)
        return (_assemble(list(self.trainable), len(full), g_trainable),
                _cotangents_for(self.inputs_treedef, self.inputs_floats, g_floats))


def linearize_keeping(fn: Callable, leaves: tuple[LeafPlan, ...], full: list[Any], inputs: Any,
                      policy: str) -> tuple[Any, list[Any], VjpLayout]:
    """Forward of a unit under remat `policy` ("none", "offload" or a checkpoint policy): `(out,
    kept, layout)`, `kept` the residual arrays to carry to backward (never a gathered parameter;
    under "offload", the unit's float inputs in host memory)."""
    out, pullback, trainable = _linearized(fn, leaves, full, inputs,
                                           None if policy == NONE else policy)
    residuals, treedef = jax.tree.flatten(pullback)
    # Identity, not value: a residual that *is* a gathered parameter is the same traced array.
    slots = tuple(next((i for i, f in enumerate(full) if r is f), None) for r in residuals)
    kept = [r for r, slot in zip(residuals, slots) if slot is None]
    input_leaves, inputs_treedef = jax.tree.flatten(inputs)
    layout = VjpLayout(treedef, slots, tuple(trainable), inputs_treedef,
                       tuple(is_float(leaf) for leaf in input_leaves),
                       tuple(jnp.dtype(r.dtype) for r in kept))
    kept = [lax.bitcast_convert_type(r, jnp.uint16) if is_16bit_float(r.dtype) else r
            for r in kept]
    return out, kept, layout


@dataclasses.dataclass(frozen=True)
class KeptVjp:
    """What a unit keeps for backward under remat "none" or a checkpoint policy: the residual
    `arrays` (a pytree's data) and their static `layout`."""

    arrays: list[Any]
    layout: VjpLayout


jax.tree_util.register_dataclass(KeptVjp, ["arrays"], ["layout"])
