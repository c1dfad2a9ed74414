"""A unit's pullback run so that each weight cotangent a transposed dot makes stays in the dot's
dim order (`zeroxla.collectives.dot_layout.Permuted`), for the reduce-scatter that follows.

`pull_permuted(pullback, cotangent)` is `pullback(cotangent)` re-emitted equation by equation
from its jaxpr (as `jax.core.eval_jaxpr` would, names and scopes kept), except that a weight
cotangent whose equation is a `transpose` of a `dot_general`'s result comes back as
`Permuted(dot result, permutation)`. The transpose is then dead code (XLA drops it) and the
reduce-scatter decides where the transpose goes (`dot_layout`: on CPU after the scatter, on the
shard). Plain calls (`pjit`) in the pullback are inlined so that a dot inside one is seen too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from zeroxla.collectives.dot_layout import Permuted
from zeroxla.compat import jaxpr as compat



def _run(jaxpr: Any, consts: list[Any], args: list[Any], made_by_dot: dict[int, Any],
         transposed: dict[int, tuple[Any, Permuted]]) -> list[Any]:
    """The jaxpr's outputs from `args`; records, by `id`, every value a `dot_general` made
    (`made_by_dot`) and every transpose of one (`transposed`: the value and its `Permuted`).
    Each record holds its value, so no id is reused for another array while the records live
    (an inlined call's dead values would otherwise be freed)."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [compat.read(env, v) for v in eqn.invars]
        called = compat.called_jaxpr(eqn) if eqn.primitive.name in compat.PLAIN_CALLS else None
        if called is not None:
            with compat.scope_of(eqn):
                outs = _run(called[0], called[1], invals, made_by_dot, transposed)
        else:
            outs = compat.bind(eqn, invals)
        if eqn.primitive.name == "dot_general":
            made_by_dot[id(outs[0])] = outs[0]
        elif eqn.primitive.name == "transpose" and id(invals[0]) in made_by_dot:
            transposed[id(outs[0])] = (outs[0], Permuted(invals[0],
                                                         tuple(eqn.params["permutation"])))
        compat.write(env, eqn.outvars, outs)
    return [compat.read(env, v) for v in jaxpr.outvars]


def pull_permuted(pullback: Callable[[Any], tuple[Any, Any]], cotangent: Any) -> tuple[Any, Any]:
    """`(weight_cotangents, input_cotangents) = pullback(cotangent)`, each weight cotangent a
    transposed dot made as a `Permuted` (module docstring)."""
    closed, out_shape = jax.make_jaxpr(pullback, return_shape=True)(cotangent)
    made_by_dot: dict[int, Any] = {}
    transposed: dict[int, tuple[Any, Permuted]] = {}
    outs = _run(closed.jaxpr, list(closed.consts), jax.tree.leaves(cotangent), made_by_dot,
                transposed)
    weights_def, inputs_def = jax.tree.structure(out_shape).children()
    n = weights_def.num_leaves
    weights = [transposed[id(g)][1] if id(g) in transposed else g for g in outs[:n]]
    return jax.tree.unflatten(weights_def, weights), jax.tree.unflatten(inputs_def, outs[n:])
