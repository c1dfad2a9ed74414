"""ZeRO-3 execution: gather parameters just before they are used, release them after.

Three units of gathering, all `jax.custom_vjp`s so that the schedule of collectives is explicit:

* `gathered_value`: one parameter of a module that also has children, gathered alone when the
  step's model copy is built; its summed cotangent reduce-scattered.
* `gathered_call`: one module call. Forward all-gathers the module's shards, runs it, and keeps
  the shards and, per the activation policy (`ZeroConfig.remat`, `zeroxla.engine.remat`),
  either the call's inputs ("full": backward recomputes the call) or its vjp's residuals less
  the gathered parameters ("none"); backward re-gathers and reduce-scatters the parameter
  gradients (DeepSpeed's per-module pre-forward / pre-backward hooks, done without hooks).
* `GatheredStack`: a `LayerStack` (a scanned stack of identical blocks). `forward` gathers layer
  i+1 while layer i computes (prefetch) and returns the layers' results with explicit
  residuals; `backward` walks the layers in reverse, re-gathering layer i-1 while layer i's
  gradient is computed, and reduce-scatters each layer's gradient as soon as it exists. At most
  two layers' parameters are ever live, and gathered parameters are never saved for backward
  (whatever the policy keeps: each layer's input carry, or its residuals).
  `GatheredStack.__call__` ties the two into a custom VJP (the ZeRO-3 step); the pipeline
  executor calls `forward` and `backward` itself, per micro-batch.

A layer is `fn(full, carry, consts, x_i) -> (carry, y_i)`: `full` the layer's gathered
parameters (a list, in the stack's leaf order), `carry` what flows from layer to layer (the
activations), `consts` what every layer sees (positions, masks), `x_i` / `y_i` the per-layer
inputs and outputs (a KV cache's layer slice; None in training).

Frozen leaves (`LeafPlan.trainable` False) are gathered like the others, but backward
differentiates only with respect to the trainable ones: a frozen leaf gets no gradient, no
reduce-scatter, and a zero (None) cotangent. A frozen leaf's shard may be a `StoredCodes`
(quantized_nontrainable_weights); it is one "shard" to the code below.
Non-float inputs (token positions) get no cotangent either.

ZeRO-2 runs the same units with `Zero2Collectives`: the "gather" is the identity on replicated
parameters and the gradient reduce-scatter is the same, per unit, as backward produces it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.wire import is_16bit_float
from zeroxla.collectives.zero import ZeroCollectives
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.engine.remat import (
    FULL,
    VjpLayout,
    KeptVjp,
    cotangent_tree,
    is_float,
    linearize_keeping,
    split_floats,
    vjp,
)


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
    if not [leaf for leaf in jax.tree.leaves(dependency) if is_float(leaf) and leaf.size]:
        return x
    return lax.platform_dependent(x, dependency, cpu=_poisoned_by, default=_barrier_with)


def _barrier_with(x: Any, dependency: Any) -> Any:
    x, _ = lax.optimization_barrier((x, dependency))
    return x


def _poisoned_by(x: Any, dependency: Any) -> Any:
    """XLA:CPU's stand-in for the barrier: `x` made data-dependent on `dependency`."""
    probes = [leaf for leaf in jax.tree.leaves(dependency) if is_float(leaf) and leaf.size]
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
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def gathered_call(fn: Callable, leaves: tuple[LeafPlan, ...], comm: ZeroCollectives, remat: str,
                  shards: list[Any], inputs: Any) -> Any:
    """fn(full_params: list, inputs) with `full_params` gathered from `shards` around the call.
    `inputs` is any pytree (e.g. a call's `(args, kwargs)`); `remat` the activation policy
    (`zeroxla.engine.remat`): what the call keeps for backward besides its shards."""
    full = [comm.forward_gather(s, leaf)[0] for s, leaf in zip(shards, leaves)]
    return fn(full, inputs)


def _gathered_call_fwd(fn, leaves, comm, remat, shards, inputs):
    pairs = [comm.forward_gather(s, leaf) for s, leaf in zip(shards, leaves)]
    full = [p[0] for p in pairs]
    saved = [p[1] for p in pairs]                # hpZ's secondary partition; None for plain ZeRO
    if remat == FULL:
        return fn(full, inputs), (shards, saved, inputs)                  # gathered released
    out, kept, layout = linearize_keeping(fn, leaves, full, inputs, remat)
    return out, (shards, saved, KeptVjp(kept, layout))                     # gathered released


def _gathered_call_bwd(fn, leaves, comm, remat, residuals, g):
    shards, saved, kept = residuals
    shards, saved = _after((shards, saved), g)
    full = [comm.backward_gather(s, sv, leaf) for s, sv, leaf in zip(shards, saved, leaves)]
    if remat == FULL:
        g_full, g_inputs = vjp(fn, leaves, full, kept, g)                 # kept: the inputs
    else:
        g_full, g_inputs = kept.layout.cotangents(kept.arrays, full, g)
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


@dataclasses.dataclass(frozen=True)
class Peeled:
    """Per-layer values of a `layer_loop`, left where the loop made them: `scanned` stacked for
    the layers computed inside the scan, `outside` the one computed after it with prefetch (else
    None, and `scanned` holds every layer). Joining the two would copy every layer's values;
    the loop over the same layers in the other direction consumes them as they are."""

    scanned: Any
    outside: Any


jax.tree_util.register_dataclass(Peeled, ["scanned", "outside"], [])


def _scan(body: Callable, carry: Any, xs: Any, *, reverse: bool) -> tuple[Any, Any]:
    """`lax.scan(body, carry, xs)`, with the 16-bit float arrays of `xs` sliced as their raw
    bits (uint16) and handed to `body` as floats again.

    XLA:CPU has no 16-bit float `dynamic-slice`: its float normalization (bf16) converts the
    operand, the whole scanned stack, to float32 inside the loop, and loop-invariant code motion
    hoists that convert out of it. A float32 image of every 16-bit stack the loop scans (stage
    2's bf16 compute copy of the layers: twice its bytes) is then live from before the forward
    loop to after the backward one, which scans the same stack. A uint16 slice is native; XLA:CPU
    materialises the bitcast as a uint16 copy of the stack (half the float32 image), and other
    backends, which slice bf16 natively, reinterpret it in place. gpt-small, bf16 ZeRO-2:
    temporaries 19.1 -> 10.2 MiB. Used inside custom VJPs only (`GatheredStack`, the pipeline
    executor): bitcasts have no derivative, and nothing here is differentiated through."""
    leaves, treedef = jax.tree.flatten(xs)
    dtypes = [leaf.dtype if is_16bit_float(leaf.dtype) else None for leaf in leaves]
    bits = [lax.bitcast_convert_type(leaf, jnp.uint16) if dtype else leaf
            for leaf, dtype in zip(leaves, dtypes)]

    def sliced(c, x_bits):
        x = [lax.bitcast_convert_type(leaf, dtype) if dtype else leaf
             for leaf, dtype in zip(jax.tree.leaves(x_bits), dtypes)]
        return body(c, jax.tree.unflatten(treedef, x))
    return lax.scan(sliced, carry, jax.tree.unflatten(treedef, bits), reverse=reverse)


def layer_loop(step: Callable, gather: Callable, gather_inputs: Any, xs: Any, carry: Any, *,
               num_layers: int, reverse: bool, prefetch: bool,
               kept: Peeled | None = None) -> tuple[Any, Any, Peeled]:
    """Runs `carry, y_i, k_i = step(carry, full_i, xs_i, kept_i)` over layers (last to first if
    `reverse`).

    `full_i, saved_i = gather(gather_inputs_i, carry)` (the carry lets a gather depend on it).
    With `prefetch`, the gather of the next layer is issued in the same scan iteration as the
    current layer's compute, before it and independent of it, so XLA can overlap the two; the
    first gather happens before the loop and the last layer's compute after it, so exactly
    `num_layers` gathers run. `kept` is what a loop over the same layers in the other direction
    returned as its `k`s (the forward's residuals, for backward; None: `kept_i` is None); with
    prefetch its layers travel beside the gathers, so they are never joined or copied whole.
    Returns `(carry, (ys, saveds), ks)`: ys and saveds stacked in layer order, ks `Peeled`.
    """
    if not prefetch or num_layers == 1:
        def body(c, inputs):
            gin, x, k_in = inputs
            full, saved = gather(gin, c)
            c, y, k = step(c, full, x, k_in)
            return c, (y, saved, k)
        carry, (ys, saveds, ks) = _scan(
            body, carry, (gather_inputs, xs, None if kept is None else kept.scanned),
            reverse=reverse)
        return carry, (ys, saveds), Peeled(ks, None)

    first, last = (num_layers - 1, 0) if reverse else (0, num_layers - 1)
    current = slice(1, None) if reverse else slice(0, num_layers - 1)
    upcoming = slice(0, num_layers - 1) if reverse else slice(1, None)
    # A loop in the other direction computed `first` outside its scan and `upcoming` inside.
    k_first, k_upcoming = (None, None) if kept is None else (kept.outside, kept.scanned)

    def body(state, inputs):
        c, full, saved, k_in = state
        next_gin, x, next_k_in = inputs
        next_full, next_saved = gather(next_gin, c)          # prefetch the next layer
        c, y, k = step(c, full, x, k_in)
        return (c, next_full, next_saved, next_k_in), (y, saved, k)

    full, saved = gather(_take(gather_inputs, first), carry)
    (carry, full, saved, k_in), (ys, saveds, ks) = _scan(
        body, (carry, full, saved, k_first),
        (_slice(gather_inputs, upcoming), _slice(xs, current), k_upcoming), reverse=reverse)
    carry, y_last, k_last = step(carry, full, _take(xs, last), k_in)
    # In reverse the layer computed outside the scan is layer 0, else layer L-1.
    return carry, (_put_back(ys, y_last, at_front=reverse),
                   _put_back(saveds, saved, at_front=reverse)), Peeled(ks, k_last)


@dataclasses.dataclass(frozen=True)
class StackResiduals:
    """What `GatheredStack.forward` keeps for `backward`: the shards (re-gathered later), hpZ's
    secondary partitions, the stack's consts and per-layer xs, and per layer either its input
    carry (remat "full": the layer is recomputed in backward) or its vjp's residuals less the
    gathered parameters (`kept`, laid out by the static `layout`; `zeroxla.engine.remat`)."""

    shards: list[Any]
    saveds: list[Any]
    consts: Any
    xs: Any
    kept: Peeled          # per layer: its input carry (remat "full") or its kept residuals
    layout: VjpLayout | None = None       # None for remat "full"


jax.tree_util.register_dataclass(StackResiduals, ["shards", "saveds", "consts", "xs", "kept"],
                                 ["layout"])


@dataclasses.dataclass(frozen=True)
class GatheredStack:
    """A `LayerStack` whose parameters are stored partitioned: layer `fn`, leaf plans, collectives.

    `shards[j]` is leaf j's local storage with a leading layer dim (`leaves` in the same order).
    """

    fn: Callable                      # (full, carry, consts, x_i) -> (carry, y_i)
    leaves: tuple[LeafPlan, ...]
    comm: ZeroCollectives
    prefetch: bool = True
    remat: str = FULL                 # the activation policy (`zeroxla.engine.remat`)

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
        layouts: list[VjpLayout] = []        # one per traced layer body (the scan's, the last's)

        def step(c, full, x_i, _):
            if self.remat == FULL:
                c_out, y = self.fn(full, c, consts, x_i)
                return c_out, y, c                       # keep each layer's input carry
            (c_out, y), kept, layout = linearize_keeping(self._layer, self.leaves, full,
                                                         (c, consts, x_i), self.remat)
            layouts.append(layout)
            return c_out, y, kept                        # keep its residuals, not its weights

        carry_out, (ys, saveds), per_layer = layer_loop(
            step, self._gather(backward=False), (shards, [None] * len(shards)), xs, carry,
            num_layers=self.num_layers, reverse=False, prefetch=self.prefetch)
        if any(layout.slots != layouts[0].slots for layout in layouts):
            raise AssertionError("the layer's residuals differ between traces of the same layer")
        return carry_out, ys, StackResiduals(shards, saveds, consts, xs, per_layer,
                                             layouts[0] if layouts else None)

    def _layer(self, full: list[Any], inputs: Any) -> Any:
        c, k, x_i = inputs
        return self.fn(full, c, k, x_i)

    def backward(self, residuals: StackResiduals, d_carry: Any,
                 d_ys: Any) -> tuple[list[Any], Any, Any, Any]:
        """Cotangents `(d_shards, d_carry_in, d_consts, d_xs)` from the output cotangents;
        d_shards are reduce-scattered (None for frozen leaves)."""
        r = residuals
        d_consts0 = jax.tree.map(jnp.zeros_like, split_floats(r.consts)[0])

        def step(state, full, per_layer, kept_i):
            g_c, g_k = state
            x_i, g_y = per_layer
            if r.layout is None:                          # remat "full": recompute the layer
                g_full, (g_c_in, g_k_i, g_x_i) = vjp(self._layer, self.leaves, full,
                                                     (kept_i, r.consts, x_i), (g_c, g_y))
            else:
                g_full, (g_c_in, g_k_i, g_x_i) = r.layout.cotangents(kept_i, full, (g_c, g_y))
            g_k = [a + b for a, b in zip(g_k, split_floats(g_k_i)[0])] if g_k else g_k
            g_x_floats = split_floats(g_x_i)[0]
            d_shards_i = _scatter_gradients(self.comm, self.leaves, g_full)
            return (g_c_in, g_k), (d_shards_i, g_x_floats), None

        (d_carry_in, d_consts_floats), ((d_shards, d_x_floats), _), _ = layer_loop(
            step, self._gather(backward=True), (r.shards, r.saveds), (r.xs, d_ys),
            (d_carry, d_consts0), num_layers=self.num_layers, reverse=True,
            prefetch=self.prefetch, kept=r.kept)
        return (d_shards, d_carry_in, cotangent_tree(r.consts, d_consts_floats),
                cotangent_tree(r.xs, d_x_floats))

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
