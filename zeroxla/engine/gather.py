"""ZeRO-3 execution: gather parameters just before they are used, release them after.

Two units of gathering, both `jax.custom_vjp`s so that the schedule of collectives is explicit:

* `gathered_call`: one module call. Forward all-gathers the module's partitions, runs it, and
  keeps only the partitions and the call's inputs; backward re-gathers, recomputes the call
  under `jax.vjp`, and reduce-scatters the parameter gradients (DeepSpeed's per-module
  pre-forward / pre-backward hooks, done without hooks).
* `gathered_layer_stack`: a `LayerStack` (a scanned stack of identical blocks). Forward gathers
  layer i+1 while layer i computes (prefetch) and saves each layer's input; backward walks the
  layers in reverse, re-gathering layer i-1 while layer i's gradient is computed, and
  reduce-scatters each layer's gradient as soon as it exists. At most two layers' parameters
  are ever live, and the gathered parameters are never saved for backward.

`zero3_module` rebuilds a user's model around its local partitions, replacing each `LayerStack`
and each module that owns partitioned parameters with one of these wrappers. The user's model
object is never touched: the wrappers live in a copy made inside the traced step.

Frozen leaves (`LeafPlan.trainable` False) are gathered like the others, but backward
differentiates only with respect to the trainable ones: a frozen leaf gets no gradient, no
reduce-scatter, and a zero (None) cotangent. A frozen leaf's shard may be a `QuantizedArray`
of stored codes (quantized_nontrainable_weights); it is one "shard" to the code below.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zeroxla.models.layers import LayerStack
from zeroxla.pallas_kernels import QuantizedArray
from zeroxla.collectives.zero import ZeroCollectives
from zeroxla.engine.model_def import path_str
from zeroxla.engine.plan import LeafPlan, ShardingPlan


# ----------------------------------------------------------------------------------------------
# One module call.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def gathered_call(fn: Callable, leaves: tuple[LeafPlan, ...], comm: ZeroCollectives,
                  shards: list[jax.Array], args: Any) -> Any:
    """fn(full_params: list, args) with `full_params` gathered from `shards` around the call."""
    full = [comm.forward_gather(s, leaf)[0] for s, leaf in zip(shards, leaves)]
    return fn(full, args)


def _gathered_call_fwd(fn, leaves, comm, shards, args):
    pairs = [comm.forward_gather(s, leaf) for s, leaf in zip(shards, leaves)]
    saved = [p[1] for p in pairs]                # hpZ's secondary partition; None for plain ZeRO
    return fn([p[0] for p in pairs], args), (shards, saved, args)   # gathered params released


def _after(x: Any, dependency: Any) -> Any:
    """`x`, made data-dependent on `dependency` (a backward cotangent).

    A backward re-gather must neither be merged with the identical forward gather (XLA's CSE
    would then keep the gathered parameters alive from forward to backward, defeating ZeRO-3) nor
    be scheduled before backward reaches the layer. `lax.optimization_barrier` says this, but
    XLA's CPU pipeline drops barriers before CSE, so the dependency is made real: a NaN in the
    cotangent (which already makes this step's gradients NaN) poisons the re-gathered shard.
    """
    probes = [leaf for leaf in jax.tree.leaves(dependency)
              if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size]
    if not probes:
        return x
    first = probes[0].reshape(-1)[0]
    poisoned = first != first                        # NaN test XLA cannot constant-fold

    def tie(leaf):
        if leaf is None:
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating):     # stored int8 codes
            return jnp.where(poisoned, jnp.zeros_like(leaf), leaf)
        return jnp.where(poisoned, jnp.nan, leaf).astype(leaf.dtype)
    return jax.tree.map(tie, x)


def _trainable_vjp(fn: Callable, leaves: tuple[LeafPlan, ...], full: list[jax.Array],
                   args: Any, g: Any) -> tuple[list[jax.Array | None], Any]:
    """Cotangents of `fn(full, args)` for the trainable entries of `full` (None for frozen
    ones, which stay constants of the vjp, so no gradient is computed for them) and `args`."""
    trainable = [i for i, leaf in enumerate(leaves) if leaf.trainable]

    def of_trainable(params, call_args):
        merged = list(full)
        for i, p in zip(trainable, params):
            merged[i] = p
        return fn(merged, call_args)

    _, vjp = jax.vjp(of_trainable, [full[i] for i in trainable], args)
    g_trainable, g_args = vjp(g)
    g_full: list[jax.Array | None] = [None] * len(full)
    for i, gi in zip(trainable, g_trainable):
        g_full[i] = gi
    return g_full, g_args


def _scatter_gradients(comm: ZeroCollectives, leaves: tuple[LeafPlan, ...],
                       g_full: list[jax.Array | None]) -> list[jax.Array | None]:
    """Reduce-scatters each trainable leaf's gradient; frozen leaves have none."""
    return [None if gf is None else comm.reduce_scatter(gf, leaf)
            for gf, leaf in zip(g_full, leaves)]


def _gathered_call_bwd(fn, leaves, comm, residuals, g):
    shards, saved, args = residuals
    shards, saved = _after((shards, saved), g)
    full = [comm.backward_gather(s, sv, leaf) for s, sv, leaf in zip(shards, saved, leaves)]
    g_full, g_args = _trainable_vjp(fn, leaves, full, args, g)
    return _scatter_gradients(comm, leaves, g_full), g_args


gathered_call.defvjp(_gathered_call_fwd, _gathered_call_bwd)


# ----------------------------------------------------------------------------------------------
# A scanned stack of layers.
def _take(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda a: a[i], tree)


def _slice(tree: Any, s: slice) -> Any:
    return jax.tree.map(lambda a: a[s], tree)


def _put_back(scanned: Any, outside: Any, *, at_front: bool) -> Any:
    """Joins the per-layer results of the scan with the one computed outside it, in layer order."""
    def join(rest, one):
        return jnp.concatenate([one[None], rest] if at_front else [rest, one[None]])
    return jax.tree.map(join, scanned, outside)


def layer_loop(step: Callable, gather: Callable, gather_inputs: Any, xs: Any, carry: Any, *,
               num_layers: int, reverse: bool, prefetch: bool) -> tuple[Any, Any]:
    """Runs `carry, y_i = step(carry, full_i, xs_i)` over layers (last to first if `reverse`).

    `full_i, saved_i = gather(gather_inputs_i, carry)` (the carry lets a gather depend on it).
    With `prefetch`, the gather of the next layer is issued in the same scan iteration as the
    current layer's compute, before it and independent of it, so XLA can overlap the two; the
    first gather happens before the loop and the last layer's compute after it, so exactly
    `num_layers` gathers run. Returns `(carry, (ys, saveds))`, both stacked in layer order.
    """
    if not prefetch or num_layers == 1:
        def body(c, inputs):
            gin, x = inputs
            full, saved = gather(gin, c)
            c, y = step(c, full, x)
            return c, (y, saved)
        return lax.scan(body, carry, (gather_inputs, xs), reverse=reverse)

    first, last = (num_layers - 1, 0) if reverse else (0, num_layers - 1)
    current = slice(1, None) if reverse else slice(0, num_layers - 1)
    upcoming = slice(0, num_layers - 1) if reverse else slice(1, None)

    def body(state, inputs):
        c, full, saved = state
        next_gin, x = inputs
        next_full, next_saved = gather(next_gin, c)          # prefetch the next layer
        c, y = step(c, full, x)
        return (c, next_full, next_saved), (y, saved)

    full, saved = gather(_take(gather_inputs, first), carry)
    (carry, full, saved), (ys, saveds) = lax.scan(
        body, (carry, full, saved), (_slice(gather_inputs, upcoming), _slice(xs, current)),
        reverse=reverse)
    carry, y_last = step(carry, full, _take(xs, last))
    # In reverse the layer computed outside the scan is layer 0, else layer L-1.
    return carry, (_put_back(ys, y_last, at_front=reverse),
                   _put_back(saveds, saved, at_front=reverse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def gathered_layer_stack(fn: Callable, leaves: tuple[LeafPlan, ...], comm: ZeroCollectives,
                         prefetch: bool, shards: list[jax.Array], x: jax.Array) -> jax.Array:
    """x -> fn(layer_L-1, ... fn(layer_0, x)), each layer's parameters gathered around its use.

    `shards[j]` is leaf j's local storage with a leading layer dim; `fn(full_list, x) -> x`.
    """
    return _layer_stack_fwd(fn, leaves, comm, prefetch, shards, x)[0]


def _gather_layer(comm, leaves, backward):
    def gather(gin, carry):
        shards, saveds = gin
        if backward:
            shards, saveds = _after((shards, saveds), carry)
            return [comm.backward_gather(s, sv, leaf)
                    for s, sv, leaf in zip(shards, saveds, leaves)], None
        pairs = [comm.forward_gather(s, leaf) for s, leaf in zip(shards, leaves)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return gather


def _layer_stack_fwd(fn, leaves, comm, prefetch, shards, x):
    num_layers = leaves[0].layers

    def step(h, full, _):
        return fn(full, h), h                                # save each layer's input

    h, (inputs, saveds) = layer_loop(step, _gather_layer(comm, leaves, backward=False),
                                     (shards, [None] * len(shards)), None, x,
                                     num_layers=num_layers, reverse=False, prefetch=prefetch)
    return h, (shards, saveds, inputs)


def _layer_stack_bwd(fn, leaves, comm, prefetch, residuals, g):
    shards, saveds, inputs = residuals
    num_layers = leaves[0].layers

    def step(g_h, full, x_i):
        g_full, g_x = _trainable_vjp(fn, leaves, full, x_i, g_h)   # recomputes layer i
        return g_x, _scatter_gradients(comm, leaves, g_full)

    g_x, (g_shards, _) = layer_loop(step, _gather_layer(comm, leaves, backward=True),
                                    (shards, saveds), inputs, g, num_layers=num_layers,
                                    reverse=True, prefetch=prefetch)
    return g_shards, g_x


gathered_layer_stack.defvjp(_layer_stack_fwd, _layer_stack_bwd)


# ----------------------------------------------------------------------------------------------
# Rebuilding a model around its partitions.
class _GatheredModule:
    """Stands in for a module that owns partitioned parameters; every method call gathers them."""

    def __init__(self, module: nnx.Module, prefix: str, plan: ShardingPlan, comm: ZeroCollectives):
        self._graphdef, self._shards, self._treedef, paths = _split_shards(module)
        self._leaves = tuple(plan[_join(prefix, p)] for p in paths)
        self._comm = comm

    def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        def fn(full, call_args):
            module = nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, full))
            return getattr(module, method)(*call_args, **kwargs)
        return gathered_call(fn, self._leaves, self._comm, self._shards, args)

    def __call__(self, *args, **kwargs):
        return self._invoke("__call__", args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._invoke(name, args, kwargs)


class _GatheredLayerStack:
    """Stands in for a `LayerStack`: runs its layers with per-layer gathers and prefetch."""

    def __init__(self, stack: LayerStack, prefix: str, plan: ShardingPlan,
                 comm: ZeroCollectives, prefetch: bool):
        self._graphdef, self._shards, self._treedef, paths = _split_shards(stack.layers)
        self._leaves = tuple(plan[_join(prefix, "layers/" + p)] for p in paths)
        self._comm, self._prefetch = comm, prefetch

    def __call__(self, x: jax.Array) -> jax.Array:
        def fn(full, h):
            return nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, full))(h)
        return gathered_layer_stack(fn, self._leaves, self._comm, self._prefetch,
                                    self._shards, x)


def _split_shards(module: nnx.Module) -> tuple[Any, list[Any], Any, list[str]]:
    """(graphdef, shards, treedef, paths) of a module's parameters; stored codes (a
    `QuantizedArray`) count as one shard."""
    graphdef, state = nnx.split(module)
    shards, treedef = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return graphdef, shards, treedef, [path_str(p) for p, _ in nnx.to_flat_state(state)]


def _join(prefix: str, path: str) -> str:
    return f"{prefix}/{path}" if prefix else path


def _direct_params(module: nnx.Module) -> list[str]:
    return [name for name, value in vars(module).items() if isinstance(value, nnx.Variable)]


def _wrap(module: Any, prefix: str, plan: ShardingPlan, comm: ZeroCollectives,
          prefetch: bool) -> Any:
    """Returns `module` or its stand-in; recurses into children that need none."""
    if isinstance(module, LayerStack):
        return _GatheredLayerStack(module, prefix, plan, comm, prefetch)
    if isinstance(module, nnx.Module):
        direct = _direct_params(module)
        if any(plan[_join(prefix, name)].params_partitioned for name in direct):
            return _GatheredModule(module, prefix, plan, comm)
        for name, child in list(vars(module).items()):
            replacement = _wrap(child, _join(prefix, name), plan, comm, prefetch)
            if replacement is not child:
                setattr(module, name, replacement)
        return module
    return module


def zero3_module(model: nnx.Module, plan: ShardingPlan, comm: ZeroCollectives,
                 prefetch: bool) -> Any:
    """Wraps a model whose parameters hold *local partitions* so that it computes as if full.

    `model` must be a fresh copy (nnx.merge of the local storage) made inside the traced step.
    """
    return _wrap(model, "", plan, comm, prefetch)

