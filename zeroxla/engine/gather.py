"""ZeRO-3 execution: gather parameters just before they are used, release them after.

Three units of gathering, all `jax.custom_vjp`s so that the schedule of collectives is explicit:

* `gathered_value`: one parameter of a module that also has children, gathered alone when the
  step's model copy is built; its summed cotangent reduce-scattered.
* `gathered_call`: one module call. Forward all-gathers the module's shards, runs it, and keeps
  only the shards and the call's inputs; backward re-gathers, recomputes the call under
  `jax.vjp`, and reduce-scatters the parameter gradients (DeepSpeed's per-module pre-forward /
  pre-backward hooks, done without hooks).
* `GatheredStack`: a `LayerStack` (a scanned stack of identical blocks). `forward` gathers layer
  i+1 while layer i computes (prefetch) and returns the layers' results with explicit
  residuals; `backward` walks the layers in reverse, re-gathering layer i-1 while layer i's
  gradient is computed, and reduce-scatters each layer's gradient as soon as it exists. At most
  two layers' parameters are ever live, and gathered parameters are never saved for backward.
  `GatheredStack.__call__` ties the two into a custom VJP (the ZeRO-3 step); the pipeline
  executor calls `forward` and `backward` itself, per micro-batch.

A layer is `fn(full, carry, consts, x_i) -> (carry, y_i)`: `full` the layer's gathered
parameters (a list, in the stack's leaf order), `carry` what flows from layer to layer (the
activations), `consts` what every layer sees (positions, masks), `x_i` / `y_i` the per-layer
inputs and outputs (a KV cache's layer slice; None in training).

Frozen leaves (`LeafPlan.trainable` False) are gathered like the others, but backward
differentiates only with respect to the trainable ones: a frozen leaf gets no gradient, no
reduce-scatter, and a zero (None) cotangent. A frozen leaf's shard may be a `QuantizedArray`
of stored codes (quantized_nontrainable_weights); it is one "shard" to the code below.
Non-float inputs (token positions) get no cotangent either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.zero import ZeroCollectives
from zeroxla.engine.plan import LeafPlan


# ----------------------------------------------------------------------------------------------
# Differentiating with respect to the float leaves of a pytree only.
def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _split_floats(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any], list[bool]]:
    """(float leaves, rebuild(float leaves) -> tree, mask) of a pytree."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [_is_float(leaf) for leaf in leaves]

    def rebuild(floats):
        it = iter(floats)
        return jax.tree.unflatten(treedef, [next(it) if m else leaf
                                            for leaf, m in zip(leaves, mask)])
    return [leaf for leaf, m in zip(leaves, mask) if m], rebuild, mask


def _cotangent_tree(tree: Any, float_cotangents: list[Any]) -> Any:
    """A cotangent for `tree`: the given ones at its float leaves, None elsewhere."""
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(float_cotangents)
    return jax.tree.unflatten(treedef, [next(it) if _is_float(leaf) else None
                                        for leaf in leaves])


def _vjp(fn: Callable, leaves: tuple[LeafPlan, ...], full: list[Any], inputs: Any,
         cotangent: Any) -> tuple[list[Any], Any]:
    """Cotangents of `out = fn(full, inputs)` for the trainable entries of `full` (None for
    frozen ones, which stay constants of the vjp) and for the float leaves of `inputs` (None for
    the rest)."""
    trainable = [i for i, leaf in enumerate(leaves) if leaf.trainable]
    floats, rebuild, _ = _split_floats(inputs)

    def of_differentiable(params, float_inputs):
        merged = list(full)
        for i, p in zip(trainable, params):
            merged[i] = p
        return fn(merged, rebuild(float_inputs))

    _, vjp = jax.vjp(of_differentiable, [full[i] for i in trainable], floats)
    g_trainable, g_floats = vjp(cotangent)
    g_full: list[Any] = [None] * len(full)
    for i, gi in zip(trainable, g_trainable):
        g_full[i] = gi
    return g_full, _cotangent_tree(inputs, g_floats)


def _after(x: Any, dependency: Any) -> Any:
    """`x`, ordered after `dependency` (a backward cotangent).

    A backward re-gather must neither be merged with the identical forward gather (XLA's CSE
    would then keep the gathered parameters alive from forward to backward, defeating ZeRO-3) nor
    be scheduled before backward reaches the layer. `lax.optimization_barrier` says exactly this
    and is what GPU and TPU programs get. XLA's CPU pipeline drops barriers before CSE, so on CPU
    only (chosen per platform when the program is lowered) the dependency is made real instead:
    a NaN in the cotangent (which already makes this step's gradients NaN) poisons the
    re-gathered shard.
    """
    if not [leaf for leaf in jax.tree.leaves(dependency) if _is_float(leaf) and leaf.size]:
        return x
    return lax.platform_dependent(x, dependency, cpu=_poisoned_by, default=_barrier_with)


def _barrier_with(x: Any, dependency: Any) -> Any:
    x, _ = lax.optimization_barrier((x, dependency))
    return x


def _poisoned_by(x: Any, dependency: Any) -> Any:
    """XLA:CPU's stand-in for the barrier: `x` made data-dependent on `dependency`."""
    probes = [leaf for leaf in jax.tree.leaves(dependency) if _is_float(leaf) and leaf.size]
    first = probes[0].reshape(-1)[0]
    poisoned = first != first                        # NaN test XLA cannot constant-fold

    def tie(leaf):
        if leaf is None:
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating):     # stored int8 codes
            return jnp.where(poisoned, jnp.zeros_like(leaf), leaf)
        return jnp.where(poisoned, jnp.nan, leaf).astype(leaf.dtype)
    return jax.tree.map(tie, x)


def _scatter_gradients(comm: ZeroCollectives, leaves: tuple[LeafPlan, ...],
                       g_full: list[Any]) -> list[Any]:
    """Reduce-scatters each trainable leaf's gradient; frozen leaves have none."""
    return [None if gf is None else comm.reduce_scatter(gf, leaf)
            for gf, leaf in zip(g_full, leaves)]


# ----------------------------------------------------------------------------------------------
# One module call.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def gathered_call(fn: Callable, leaves: tuple[LeafPlan, ...], comm: ZeroCollectives,
                  shards: list[Any], inputs: Any) -> Any:
    """fn(full_params: list, inputs) with `full_params` gathered from `shards` around the call.
    `inputs` is any pytree (e.g. a call's `(args, kwargs)`)."""
    full = [comm.forward_gather(s, leaf)[0] for s, leaf in zip(shards, leaves)]
    return fn(full, inputs)


def _gathered_call_fwd(fn, leaves, comm, shards, inputs):
    pairs = [comm.forward_gather(s, leaf) for s, leaf in zip(shards, leaves)]
    saved = [p[1] for p in pairs]                # hpZ's secondary partition; None for plain ZeRO
    return fn([p[0] for p in pairs], inputs), (shards, saved, inputs)   # gathered released


def _gathered_call_bwd(fn, leaves, comm, residuals, g):
    shards, saved, inputs = residuals
    shards, saved = _after((shards, saved), g)
    full = [comm.backward_gather(s, sv, leaf) for s, sv, leaf in zip(shards, saved, leaves)]
    g_full, g_inputs = _vjp(fn, leaves, full, inputs, g)
    return _scatter_gradients(comm, leaves, g_full), g_inputs


gathered_call.defvjp(_gathered_call_fwd, _gathered_call_bwd)


# ----------------------------------------------------------------------------------------------
# One parameter, gathered as a value.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gathered_value(leaf: LeafPlan, comm: ZeroCollectives, shard: Any) -> jax.Array:
    """The full parameter of `shard`, all-gathered once; its cotangent (summed over every use)
    is reduce-scattered back. For a module's own parameters when the module also has children
    (a root-owned table): gathered alone, not with the descendants, and kept only where an op
    needs it for its backward (autodiff decides; an addition keeps nothing)."""
    return comm.forward_gather(shard, leaf)[0]


def _gathered_value_fwd(leaf, comm, shard):
    return comm.forward_gather(shard, leaf)[0], None


def _gathered_value_bwd(leaf, comm, _, g):
    return (comm.reduce_scatter(g, leaf) if leaf.trainable else None,)


gathered_value.defvjp(_gathered_value_fwd, _gathered_value_bwd)


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


@dataclasses.dataclass(frozen=True)
class StackResiduals:
    """What `GatheredStack.forward` keeps for `backward`: the shards (re-gathered later), hpZ's
    secondary partitions, each layer's input carry, and the stack's consts and per-layer xs.
    The layer's activations are recomputed in backward (full rematerialisation)."""

    shards: list[Any]
    saveds: list[Any]
    carries: Any          # [L, ...] the carry entering each layer
    consts: Any
    xs: Any


jax.tree_util.register_dataclass(StackResiduals, ["shards", "saveds", "carries", "consts", "xs"],
                                 [])


@dataclasses.dataclass(frozen=True)
class GatheredStack:
    """A `LayerStack` whose parameters are stored partitioned: layer `fn`, leaf plans, collectives.

    `shards[j]` is leaf j's local storage with a leading layer dim (`leaves` in the same order).
    """

    fn: Callable                      # (full, carry, consts, x_i) -> (carry, y_i)
    leaves: tuple[LeafPlan, ...]
    comm: ZeroCollectives
    prefetch: bool = True

    @property
    def num_layers(self) -> int:
        return self.leaves[0].layers

    def _gather(self, backward: bool) -> Callable:
        comm, leaves = self.comm, self.leaves

        def gather(gin, dependency):
            shards, saveds = gin
            if backward:
                shards, saveds = _after((shards, saveds), dependency)
                return [comm.backward_gather(s, sv, leaf)
                        for s, sv, leaf in zip(shards, saveds, leaves)], None
            pairs = [comm.forward_gather(s, leaf) for s, leaf in zip(shards, leaves)]
            return [p[0] for p in pairs], [p[1] for p in pairs]
        return gather

    def forward(self, shards: list[Any], carry: Any, consts: Any,
                xs: Any) -> tuple[Any, Any, StackResiduals]:
        """Runs every layer; returns `(carry, ys, residuals)`."""
        def step(c, full, x_i):
            c_out, y = self.fn(full, c, consts, x_i)
            return c_out, (c, y)                         # keep each layer's input carry

        carry_out, ((carries, ys), saveds) = layer_loop(
            step, self._gather(backward=False), (shards, [None] * len(shards)), xs, carry,
            num_layers=self.num_layers, reverse=False, prefetch=self.prefetch)
        return carry_out, ys, StackResiduals(shards, saveds, carries, consts, xs)

    def backward(self, residuals: StackResiduals, d_carry: Any,
                 d_ys: Any) -> tuple[list[Any], Any, Any, Any]:
        """Cotangents `(d_shards, d_carry_in, d_consts, d_xs)` from the output cotangents;
        d_shards are reduce-scattered (None for frozen leaves)."""
        r = residuals
        d_consts0 = jax.tree.map(jnp.zeros_like, _split_floats(r.consts)[0])

        def layer(full, inputs):
            c, k, x_i = inputs
            return self.fn(full, c, k, x_i)

        def step(state, full, per_layer):
            g_c, g_k = state
            c_i, x_i, g_y = per_layer
            g_full, (g_c_in, g_k_i, g_x_i) = _vjp(layer, self.leaves, full,
                                                 (c_i, r.consts, x_i), (g_c, g_y))
            g_k = [a + b for a, b in zip(g_k, _split_floats(g_k_i)[0])] if g_k else g_k
            g_x_floats = _split_floats(g_x_i)[0]
            return (g_c_in, g_k), (_scatter_gradients(self.comm, self.leaves, g_full), g_x_floats)

        (d_carry_in, d_consts_floats), ((d_shards, d_x_floats), _) = layer_loop(
            step, self._gather(backward=True), (r.shards, r.saveds), (r.carries, r.xs, d_ys),
            (d_carry, d_consts0), num_layers=self.num_layers, reverse=True,
            prefetch=self.prefetch)
        return (d_shards, d_carry_in, _cotangent_tree(r.consts, d_consts_floats),
                _cotangent_tree(r.xs, d_x_floats))

    def __call__(self, shards: list[Any], carry: Any, consts: Any, xs: Any) -> tuple[Any, Any]:
        """`(carry, ys)` of the whole stack, differentiable: the ZeRO-3 layer schedule."""
        return _gathered_stack(self, shards, carry, consts, xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered_stack(stack: GatheredStack, shards, carry, consts, xs):
    carry, ys, _ = stack.forward(shards, carry, consts, xs)
    return carry, ys


def _gathered_stack_fwd(stack, shards, carry, consts, xs):
    carry, ys, residuals = stack.forward(shards, carry, consts, xs)
    return (carry, ys), residuals


def _gathered_stack_bwd(stack, residuals, g):
    d_carry, d_ys = g
    return stack.backward(residuals, d_carry, d_ys)


_gathered_stack.defvjp(_gathered_stack_fwd, _gathered_stack_bwd)
