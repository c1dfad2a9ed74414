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
  two layers' parameters are ever live (one without prefetch, or when two layers exceed
  `ZeroConfig.max_live_parameters`), and gathered parameters are never saved for backward
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
from zeroxla.engine.invariant_residuals import HoistedResiduals, hoist_invariant
from zeroxla.engine.layer_loop import Peeled, layer_loop
from zeroxla.engine.offload import cotangent, fetch
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
    re-gathered shard, and so does a NaN in the shards themselves: a cotangent XLA can compute
    at compile time (a log-prob head's under an unmasked mean is -1 / tokens everywhere) would
    let it fold the test away and merge the gathers, the parameters it cannot.
    """
    if not [leaf for leaf in jax.tree.leaves(dependency) if is_float(leaf) and leaf.size]:
        return x
    return lax.platform_dependent(x, dependency, cpu=_poisoned_by, default=_barrier_with)


def _barrier_with(x: Any, dependency: Any) -> Any:
    x, _ = lax.optimization_barrier((x, dependency))
    return x


def _poisoned_by(x: Any, dependency: Any) -> Any:
    """XLA:CPU's stand-in for the barrier: `x` made data-dependent on `dependency` (and on
    itself, so that a constant `dependency` still leaves a test XLA cannot fold)."""
    probes = [leaf for leaf in jax.tree.leaves((dependency, x))
              if is_float(leaf) and leaf.size]
    firsts = jnp.stack([p.reshape(-1)[0].astype(jnp.float32) for p in probes])
    poisoned = jnp.any(firsts != firsts)             # a NaN test of data: not constant-folded

    def tie(leaf):
        if leaf is None:
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating):     # stored int8 codes
            return jnp.where(poisoned, jnp.zeros_like(leaf), leaf)
        return jnp.where(poisoned, jnp.nan, leaf).astype(leaf.dtype)
    return jax.tree.map(tie, x)


def _as_bits(x: Any) -> Any:
    """A 16-bit float carry kept for remat "full"'s backward as its uint16 bits: the layer loop
    stacks the kept carries and reads them back layer by layer through their bits
    (`layer_loop._Stacked`: XLA:CPU has no 16-bit float dynamic-slice); kept as bits from the
    start, the [L, B, T, D] stack is never bitcast whole, which XLA:CPU does as a copy held
    beside it at the turn from forward to backward. Elsewhere a bitcast is free."""
    return lax.bitcast_convert_type(x, jnp.uint16) if is_16bit_float(x.dtype) else x


def _from_bits_like(kept: Any, cotangent_leaf: Any) -> Any:
    """`_as_bits`' inverse: a 16-bit float carry's cotangent has its dtype."""
    if kept.dtype == jnp.uint16 and is_16bit_float(cotangent_leaf.dtype):
        return lax.bitcast_convert_type(kept, cotangent_leaf.dtype)
    return kept


def _integer_cotangents(g_in: Any, g_out: Any) -> Any:
    """A layer's input-carry cotangent `g_in` (None at the carry's integer leaves, a layer
    counter's: `cotangent_tree`) with those leaves taken from its output-carry cotangent
    `g_out` (their float0 zeros, as autodiff hands them to the stack): one loop carry shape,
    and the next layer's vjp gets the float0 cotangent it requires for an integer output. An
    empty field of the carry (a None, no leaf) is None in both and stays None: both trees are
    read with None as a leaf, so their positions line up."""
    outs = jax.tree.leaves(g_out, is_leaf=lambda x: x is None)
    ins, treedef = jax.tree.flatten(g_in, is_leaf=lambda x: x is None)
    return jax.tree.unflatten(treedef, [o if i is None else i for i, o in zip(ins, outs)])


def check_live(numel: int, max_live: int | None, what: str) -> None:
    """Refuses a gather unit of `numel` gathered elements that `ZeroConfig.max_live_parameters`
    (DeepSpeed's `stage3_max_live_parameters`) cannot hold: ZeRO-3 gathers a unit whole."""
    if max_live is not None and numel > max_live:
        raise ValueError(f"ZeroConfig.max_live_parameters={max_live} (DeepSpeed's "
                         f"stage3_max_live_parameters) is smaller than {what}: {numel} gathered "
                         f"parameters, gathered whole; accepted: >= {numel}")


def _scatter_gradients(comm: ZeroCollectives, leaves: tuple[LeafPlan, ...],
                       g_full: list[Any]) -> list[Any]:
    """Reduce-scatters each trainable leaf's gradient (a `Permuted` one in its dot's dim order,
    `zeroxla.collectives.dot_layout`); frozen leaves have none."""
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
    full = [comm.forward_gather(fetch(s), leaf)[0] for s, leaf in zip(shards, leaves)]
    return fn(full, inputs)


def _gathered_call_fwd(fn, leaves, comm, remat, shards, inputs):
    pairs = [comm.forward_gather(fetch(s), leaf) for s, leaf in zip(shards, leaves)]
    full = [p[0] for p in pairs]
    saved = [p[1] for p in pairs]                # hpZ's secondary partition; None for plain ZeRO
    if remat == FULL:
        return fn(full, inputs), (shards, saved, inputs)                  # gathered released
    out, kept, layout = linearize_keeping(fn, leaves, full, inputs, remat)
    return out, (shards, saved, KeptVjp(kept, layout))                     # gathered released


def _gathered_call_bwd(fn, leaves, comm, remat, residuals, g):
    stored, saved, kept = residuals
    shards, saved = _after(([fetch(s) for s in stored], saved), g)
    full = [comm.backward_gather(s, sv, leaf) for s, sv, leaf in zip(shards, saved, leaves)]
    if remat == FULL:
        g_full, g_inputs = vjp(fn, leaves, full, kept, g,             # kept: the inputs
                               permuted=comm.permuted_gradients)
    else:
        g_full, g_inputs = kept.layout.cotangents(kept.arrays, full, g,
                                                   permuted=comm.permuted_gradients)
    d_shards = _scatter_gradients(comm, leaves, g_full)
    return [cotangent(s, d) for s, d in zip(stored, d_shards)], g_inputs


gathered_call.defvjp(_gathered_call_fwd, _gathered_call_bwd)


# ----------------------------------------------------------------------------------------------
# One parameter, gathered as a value.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gathered_value(leaf: LeafPlan, comm: ZeroCollectives, shard: Any) -> jax.Array:
    """The full parameter of `shard`, all-gathered once; its cotangent (summed over every use)
    is reduce-scattered back. For a module's own parameters when the module also has children
    (a root-owned table): gathered alone, not with the descendants, and kept only where an op
    needs it for its backward (autodiff decides; an addition keeps nothing)."""
    return comm.forward_gather(fetch(shard), leaf)[0]


def _gathered_value_fwd(leaf, comm, shard):
    # Residual: the shard's kind only (a `PartitionSink` with no arrays, or None), which
    # the cotangent's form follows.
    return comm.forward_gather(fetch(shard), leaf)[0], cotangent(shard, None)


def _gathered_value_bwd(leaf, comm, kind, g):
    return (cotangent(kind, comm.reduce_scatter(g, leaf)) if leaf.trainable else None,)


gathered_value.defvjp(_gathered_value_fwd, _gathered_value_bwd)


# ----------------------------------------------------------------------------------------------
# A scanned stack of layers (its loop: `zeroxla.engine.layer_loop`).
@dataclasses.dataclass(frozen=True)
class StackResiduals:
    """What `GatheredStack.forward` keeps for `backward`: the shards (re-gathered later), hpZ's
    secondary partitions, the stack's consts and per-layer xs, and per layer either its input
    carry (remat "full": the layer is recomputed in backward) or its vjp's residuals less the
    gathered parameters (`kept`, laid out by the static `layout`; `zeroxla.engine.remat`) and
    less those that are the same at every layer (`hoisted`, kept once,
    `zeroxla.engine.invariant_residuals`)."""

    shards: list[Any]
    saveds: list[Any]
    consts: Any
    xs: Any
    kept: Peeled          # per layer: its input carry (remat "full") or its kept residuals
    layout: VjpLayout | None = None       # None for remat "full"
    hoisted: HoistedResiduals | None = None               # None for remat "full"


jax.tree_util.register_dataclass(StackResiduals,
                                 ["shards", "saveds", "consts", "xs", "kept", "hoisted"],
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
    max_live_parameters: int | None = None    # `ZeroConfig.max_live_parameters`; None: no bound

    def __post_init__(self) -> None:
        check_live(self.layer_numel, self.max_live_parameters, "one layer of the stack")

    @property
    def num_layers(self) -> int:
        return self.leaves[0].layers

    @property
    def layer_numel(self) -> int:
        """Elements one layer gathers (its partitioned leaves)."""
        return sum(leaf.unit_numel for leaf in self.leaves if leaf.params_partitioned)

    @property
    def prefetching(self) -> bool:
        """Whether the layer loop gathers the next layer while one computes (two layers live):
        `prefetch`, and two layers within `max_live_parameters` (DeepSpeed prefetches only
        while its live count stays under stage3_max_live_parameters)."""
        bound = self.max_live_parameters
        return self.prefetch and (bound is None or 2 * self.layer_numel <= bound)

    @property
    def partitioned(self) -> bool:
        """Whether any leaf's parameters are stored partitioned, to be gathered (ZeRO-3; not
        ZeRO-2, whose "gather" is the identity)."""
        return any(leaf.params_partitioned for leaf in self.leaves)

    @property
    def collective(self) -> bool:
        """Whether any leaf's units go through the collectives (`ZeroCollectives.gathers`:
        stage 3's partitioned leaves, stage 2's partitioned gradients). A stack with none
        (every leaf persistent, or a data group of one device) has no re-gather for backward
        to order after its cotangent: it reads its layers as a plain scan does, no barrier."""
        return any(self.comm.gathers(leaf) for leaf in self.leaves)

    def _gather(self, backward: bool) -> Callable:
        comm, leaves, ordered = self.comm, self.leaves, self.collective

        def gather(gin, dependency):
            shards, saveds = gin
            shards = [fetch(s) for s in shards]    # offload_param: copied in from the host
            if backward:
                if ordered:
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
        hoisted = None if self.remat == FULL else self._hoisted(shards, carry, consts, xs)

        def step(c, full, x_i, _):
            if self.remat == FULL:
                c_out, y = self.fn(full, c, consts, x_i)
                return c_out, y, jax.tree.map(_as_bits, c)   # keep each layer's input carry
            (c_out, y), kept, layout = linearize_keeping(self._layer, self.leaves, full,
                                                         (c, consts, x_i), self.remat)
            layouts.append(layout)
            return c_out, y, hoisted.varying(kept)       # its residuals, not its weights

        carry_out, (ys, saveds), per_layer = layer_loop(
            step, self._gather(backward=False), (shards, [None] * len(shards)), xs, carry,
            num_layers=self.num_layers, reverse=False, prefetch=self.prefetching,
            partitioned=self.partitioned)
        if any(layout.slots != layouts[0].slots for layout in layouts):
            raise AssertionError("the layer's residuals differ between traces of the same layer")
        return carry_out, ys, StackResiduals(shards, saveds, consts, xs, per_layer,
                                             layouts[0] if layouts else None, hoisted)

    def _hoisted(self, shards: list[Any], carry: Any, consts: Any, xs: Any) -> HoistedResiduals:
        """The layer's kept residuals that no layer's parameters, input carry or xs reach
        (`hoist_invariant`), computed once from `consts`."""
        def first(tree):
            return jax.tree.map(lambda a: a[0], tree)
        full, x_0 = jax.eval_shape(
            lambda s, x: (self._gather(backward=False)((first(s), [None] * len(s)), carry)[0],
                          first(x)), shards, xs)

        def kept_of(varying, k):
            full_i, c, x_i = varying
            return linearize_keeping(self._layer, self.leaves, full_i, (c, k, x_i),
                                     self.remat)[1]
        return hoist_invariant(kept_of, (full, carry, x_0), consts)

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
                c_i = jax.tree.map(_from_bits_like, kept_i, g_c)
                g_full, (g_c_in, g_k_i, g_x_i) = vjp(self._layer, self.leaves, full,
                                                     (c_i, r.consts, x_i), (g_c, g_y),
                                                     permuted=self.comm.permuted_gradients)
            else:
                g_full, (g_c_in, g_k_i, g_x_i) = r.layout.cotangents(
                    r.hoisted.merged(kept_i), full, (g_c, g_y),
                    permuted=self.comm.permuted_gradients)
            g_c_in = _integer_cotangents(g_c_in, g_c)
            g_k = [a + b for a, b in zip(g_k, split_floats(g_k_i)[0])] if g_k else g_k
            g_x_floats = split_floats(g_x_i)[0]
            d_shards_i = _scatter_gradients(self.comm, self.leaves, g_full)
            return (g_c_in, g_k), (d_shards_i, g_x_floats), None

        (d_carry_in, d_consts_floats), ((d_shards, d_x_floats), _), _ = layer_loop(
            step, self._gather(backward=True), (r.shards, r.saveds), (r.xs, d_ys),
            (d_carry, d_consts0), num_layers=self.num_layers, reverse=True,
            prefetch=self.prefetching, partitioned=self.partitioned, kept=r.kept)
        d_shards = [cotangent(s, d) for s, d in zip(r.shards, d_shards)]
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
