"""A stack's layer residuals that are the same at every layer, kept once instead of per layer.

A gathered stack (`GatheredStack`, remat "none" or a checkpoint policy) keeps each layer's vjp
residuals stacked on a layer dim. Some depend on nothing that changes from layer to layer: the
causal mask `jnp.where` broadcasts to the scores' shape (`models.layers.attention`: bool
[B, G, R, T, S]) is a function of the sequence length alone, yet stacked it is stored L times.
`lax.scan`'s own autodiff (ZeRO stages 0-1 differentiate the model's scan) keeps such
loop-invariant residuals once; `hoist_invariant` does the same for the stack's explicit ones.
gpt-small, AdamW, 32 x 128 on 2x4 (`benchmarks/zero.py`): the mask is 4 x 0.5 MiB stacked, the
one residual the ZeRO-2 forward would keep per layer that ZeRO-1's keeps once; peaks (the
suite's XLA flags) with it hoisted, ZeRO-2 123.48 MiB and ZeRO-3 105.22 MiB, and kept per layer,
124.98 and 106.72 MiB.

It traces the layer's forward once more (a jaxpr from the layer's varying inputs - its
parameters, input carry and per-layer xs - and the stack's consts to its kept residuals), finds
the residuals no varying input reaches, and computes just those, once, from the consts,
re-emitting only the equations they need (`compat.jaxpr.bind`, names and scopes kept). The
dependence read is conservative: a plain call's body (`pjit`, e.g. `jnp.where`) is read
equation by equation, any other equation's results depend on all its operands, and a result
of an equation with an ordering effect (a callback) is never hoisted. The values are those every
layer computes: the same equations on the same operands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from zeroxla.compat import jaxpr as compat


@dataclasses.dataclass(frozen=True)
class HoistedResiduals:
    """The loop-invariant residuals of a layer's kept list: their positions in it (`slots`,
    static) and their `values`, computed once for every layer."""

    values: list[Any]
    slots: tuple[int, ...]
    size: int                     # how many residuals a layer keeps, hoisted ones included

    def varying(self, kept: list[Any]) -> list[Any]:
        """A layer's kept residuals less the hoisted ones: what is stacked per layer."""
        if len(kept) != self.size:
            raise AssertionError(f"the layer keeps {len(kept)} residuals where its traced "
                                 f"forward kept {self.size}")
        hoisted = set(self.slots)
        return [k for i, k in enumerate(kept) if i not in hoisted]

    def merged(self, varying: list[Any]) -> list[Any]:
        """A layer's whole kept list from its stacked residuals and the hoisted ones."""
        at = dict(zip(self.slots, self.values))
        rest = iter(varying)
        return [at[i] if i in at else next(rest) for i in range(self.size)]


jax.tree_util.register_dataclass(HoistedResiduals, ["values"], ["slots", "size"])


def _called(eqn: Any) -> tuple[Any, list[Any]] | None:
    """(jaxpr, consts) of a plain call (`pjit`: `jnp.where` is one), looked into; None for any
    other equation, whose every result is taken to depend on its every operand."""
    return compat.called_jaxpr(eqn) if eqn.primitive.name in compat.PLAIN_CALLS else None


def _moving(jaxpr: Any, moving_in: list[bool]) -> list[bool]:
    """Which outvars of `jaxpr` an invar marked in `moving_in` reaches (or an equation with an
    ordering effect makes)."""
    moving = {v for v, m in zip(jaxpr.invars, moving_in) if m}
    for eqn in jaxpr.eqns:
        ins = [compat.is_var(v) and v in moving for v in eqn.invars]
        called = _called(eqn)
        if compat.ordering_effects(eqn.effects):
            outs = [True] * len(eqn.outvars)
        elif called is not None:
            outs = _moving(called[0], ins)
        else:
            outs = [any(ins)] * len(eqn.outvars)
        moving.update(v for v, m in zip(eqn.outvars, outs) if m and compat.is_var(v))
    return [compat.is_var(v) and v in moving for v in jaxpr.outvars]


def _slice(jaxpr: Any, wanted: list[bool]) -> tuple[list[tuple[Any, list[bool]]], list[bool]]:
    """The equations the `wanted` outvars need, in order, each with which of its results are
    needed, and which invars they read."""
    needed = {v for v, w in zip(jaxpr.outvars, wanted) if w and compat.is_var(v)}
    used = []
    for eqn in reversed(jaxpr.eqns):
        outs = [compat.is_var(v) and v in needed for v in eqn.outvars]
        if not any(outs):
            continue
        called = _called(eqn)
        ins = _slice(called[0], outs)[1] if called is not None else [True] * len(eqn.invars)
        needed.update(v for v, i in zip(eqn.invars, ins) if i and compat.is_var(v))
        used.append((eqn, outs))
    return used[::-1], [v in needed for v in jaxpr.invars]


def _evaluate(jaxpr: Any, consts: list[Any], inputs: dict, wanted: list[bool]) -> list[Any]:
    """The values of the `wanted` outvars of `jaxpr` (None elsewhere) from `inputs` (invar ->
    value, for the invars they read), emitting only the equations they need (a needed call's
    body sliced in turn, under the call's scope)."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(inputs)
    for eqn, outs in _slice(jaxpr, wanted)[0]:
        called = _called(eqn)
        if called is None:
            values = compat.bind(eqn, [compat.read(env, v) for v in eqn.invars])
        else:
            inner, inner_consts = called
            reads = _slice(inner, outs)[1]
            with compat.scope_of(eqn):
                values = _evaluate(inner, inner_consts,
                                   {iv: compat.read(env, v) for iv, v, r
                                    in zip(inner.invars, eqn.invars, reads) if r}, outs)
        compat.write(env, eqn.outvars, values)
    return [compat.read(env, v) if w else None for v, w in zip(jaxpr.outvars, wanted)]


def hoist_invariant(kept_of: Callable[[Any, Any], list[Any]], varying: Any,
                    invariant: Any) -> HoistedResiduals:
    """The residuals of `kept_of(varying, invariant)` (a layer's kept list) that depend on no
    leaf of `varying` (arrays or `jax.ShapeDtypeStruct`s: only their shapes are read), computed
    from `invariant` (the stack's consts, values)."""
    closed = jax.make_jaxpr(kept_of)(varying, invariant)
    jaxpr = closed.jaxpr
    num_varying = len(jax.tree.leaves(varying))
    moving = _moving(jaxpr, [i < num_varying for i in range(len(jaxpr.invars))])
    wanted = [not m for m in moving]
    values = _evaluate(jaxpr, list(closed.consts),
                       dict(zip(jaxpr.invars[num_varying:], jax.tree.leaves(invariant))), wanted)
    slots = tuple(i for i, w in enumerate(wanted) if w)
    return HoistedResiduals([values[i] for i in slots], slots, len(wanted))
