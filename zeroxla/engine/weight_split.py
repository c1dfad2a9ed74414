"""A linear pullback split into its input-gradient part B and its weight-gradient part W.

Zero-bubble pipeline schedules (`zeroxla.pipeline.zero_bubble`) run a stage's backward as two
passes: B computes the cotangent d_x of the stage input (the previous stage waits for it), W the
weight gradients (deferred into bubbles). `split_pullback(fn, *args)` splits any function
`fn(*args) -> (weights, inputs)` whose program is a pullback - the blocks' vjp applied to d_y,
its residuals constants - at the jaxpr level, for any user block:

    B  the equations `inputs` needs (dead-code elimination from d_x), also returning ("stashing")
       every value of theirs that a weight-gradient equation reads: per parameter-consuming op,
       its output cotangent (dW = x^T dy reads x from the residuals, dy from the stash);
    W  only the equations `weights` needs that B does not run, reading the stash. A cheap
       layout or elementwise op of B whose inputs W has (a transpose or convert of a residual)
       is recomputed in W rather than stashed. B also takes the weight gradients' small sums
       over its own values (a norm's scale, a bias: a `reduce_sum`) and stashes the sum, not
       the activation-sized cotangent it reduces.

The blocks run as a `lax.scan` over layers, so the pullback holds a reverse scan whose carry is
d_x. The split recurses into it: the B-scan carries d_x (and whatever d_x's update reads: a
ZeRO-3 stack's prefetched layer, its next residuals) and emits its stash as stacked per-layer
outputs; the W-scan carries only what the weight gradients' update needs (a gathered stack's
gradient buffer) and reads the stacked stash. A collective goes where its result is needed: the
all-gather a layer's d_x reads runs in B, the reduce-scatter of a layer's gradient in W. Calls
(`pjit`, `closed_call`, `checkpoint`, `custom_jvp_call`) are inlined. An equation with an inner
program that is neither (a `while`, a `cond`) runs whole where its outputs are needed; if W
needs one of its outputs and B runs it, `UnsupportedSplit` is raised (B would do W's work, or
stash it), and the caller keeps the unsplit pullback.

B writes the stash into caller-owned buffers at an index (`at`, a pipeline's stash buffer) and a
scan's part row by row inside its loop, and W reads it there row by row: no stacked copy of the
stash is made on either side (`zeroxla.engine.layer_loop` keeps its per-layer values the same
way). How the jaxpr is divided: `zeroxla.engine.weight_split_plan`; the version-specific facts
read about jaxprs: `zeroxla.compat.jaxpr`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.compat import jaxpr as compat
from zeroxla.engine.weight_split_plan import Region, ScanSplit, UnsupportedSplit, plan

__all__ = ["UnsupportedSplit", "WeightSplit", "split_pullback"]


def _bind_invars(jaxpr: Any, values: list[Any]) -> dict:
    return {v: x for v, x in zip(jaxpr.invars, values) if x is not None}


def _set(buffer: jax.Array, at: tuple, value: jax.Array) -> jax.Array:
    """`buffer` with entry `at` (leading indices, in range) set to `value`, as a clamping
    update: `.at[at].set`'s bounds check puts a select around it, which XLA cannot run in
    place (a copy of the whole buffer per layer's write)."""
    if not at:
        return value
    start = (*at, *(0,) * (buffer.ndim - len(at)))
    return lax.dynamic_update_slice(
        buffer, jnp.reshape(value, (1,) * len(at) + value.shape).astype(buffer.dtype), start)


# ----------------------------------------------------------------------------------------------
# B: runs its equations and writes the stash into `buffers` (this region's, in stash order) at
# index `at`; returns (values of B's outvars, None elsewhere; the updated buffers).
def _run_b(r: Region, env: dict, buffers: list[Any], at: tuple) -> tuple[list[Any], list[Any]]:
    env = {**env, **dict(zip(r.jaxpr.constvars, r.consts))}
    done: list[Any] = []                    # sub-regions' updated buffers, in stash order
    rest = buffers[len(r.stash):]
    for i, eqn in enumerate(r.jaxpr.eqns):
        if i in r.subs:
            sub = r.subs[i]
            mine, rest = rest[:sub.stash_count], rest[sub.stash_count:]
            operands = [compat.read(env, v) if m else None for v, m in zip(eqn.invars, sub.b_reads)]
            with compat.scope_of(eqn):
                outs, mine = (_run_scan_b(sub, operands, mine, at) if isinstance(sub, ScanSplit)
                              else _run_b(sub, _bind_invars(sub.jaxpr, operands), mine, at))
            compat.write(env, eqn.outvars, [o if m else None for o, m in zip(outs, sub.b_outs)])
            done += mine
        elif r.run_b[i]:
            compat.write(env, eqn.outvars, compat.bind(eqn, [compat.read(env, v) for v in eqn.invars]))
    own = [_set(b, at, compat.read(env, v)) for b, v in zip(buffers, r.stash)]
    return [compat.read(env, v) if m else None for v, m in zip(r.jaxpr.outvars, r.b_outs)], own + done


def _run_scan_b(s: ScanSplit, operands: list[Any], buffers: list[Any], at: tuple
                ) -> tuple[list[Any], list[Any]]:
    p, body = s.params, s.body
    nc, nk = p.num_consts, p.num_carry
    invars = body.jaxpr.invars
    consts = _bind_invars(body.jaxpr, operands[:nc] + [None] * (len(invars) - nc))
    carried = [k for k in range(nk) if s.b_carry[k]]
    xs_at = [j for j in range(nc + nk, len(invars)) if body.b_reads[j]]

    def step(state, xs):
        carry, buffers = state
        row, xs = xs
        env = {**consts, **{invars[nc + k]: c for k, c in zip(carried, carry)},
               **{invars[j]: x for j, x in zip(xs_at, xs)}}
        outs, buffers = _run_b(body, env, buffers, (*at, row))
        return ([outs[k] for k in carried], buffers), [o for o in outs[nk:] if o is not None]

    (carry, buffers), ys = lax.scan(
        step, ([operands[nc + k] for k in carried], buffers),
        (jnp.arange(p.length), [operands[j] for j in xs_at]), length=p.length,
        reverse=p.reverse, unroll=p.unroll)
    carry_it, ys_it = iter(carry), iter(ys)
    outs = [next(carry_it) if m else None for m in s.b_carry]
    return outs + [next(ys_it) if m else None for m in s.b_ys], buffers


# ----------------------------------------------------------------------------------------------
# W: reads the stash from `buffers` at index `at`; returns W's outvars' values, None elsewhere.
def _run_w(r: Region, env: dict, buffers: list[Any], at: tuple) -> list[Any]:
    env = {**env, **dict(zip(r.jaxpr.constvars, r.consts)),
           **{v: b[at] if at else b for v, b in zip(r.stash, buffers)}}
    rest = buffers[len(r.stash):]
    for i, eqn in enumerate(r.jaxpr.eqns):
        if i in r.subs:
            sub = r.subs[i]
            mine, rest = rest[:sub.stash_count], rest[sub.stash_count:]
            if not any(sub.w_outs):
                continue
            operands = [compat.read(env, v) if m else None for v, m in zip(eqn.invars, sub.w_reads)]
            with compat.scope_of(eqn):
                outs = (_run_scan_w(sub, operands, mine, at) if isinstance(sub, ScanSplit) else
                        _run_w(sub, _bind_invars(sub.jaxpr, operands), mine, at))
            compat.write(env, eqn.outvars, [o if m else None for o, m in zip(outs, sub.w_outs)])
        elif r.run_w[i]:
            compat.write(env, eqn.outvars, compat.bind(eqn, [compat.read(env, v) for v in eqn.invars]))
    return [compat.read(env, v) if m else None for v, m in zip(r.jaxpr.outvars, r.w_outs)]


def _run_scan_w(s: ScanSplit, operands: list[Any], buffers: list[Any], at: tuple
                ) -> list[Any]:
    p, body = s.params, s.body
    nc, nk = p.num_consts, p.num_carry
    invars = body.jaxpr.invars
    consts = _bind_invars(body.jaxpr, operands[:nc] + [None] * (len(invars) - nc))
    carried = [k for k in range(nk) if s.w_carry[k]]
    xs_at = [j for j in range(nc + nk, len(invars)) if body.w_reads[j]]

    def step(carry, xs):
        row, xs = xs
        env = {**consts, **{invars[nc + k]: c for k, c in zip(carried, carry)},
               **{invars[j]: x for j, x in zip(xs_at, xs)}}
        outs = _run_w(body, env, buffers, (*at, row))      # the stash read row by row
        return [outs[k] for k in carried], [o for o in outs[nk:] if o is not None]

    carry, ys = lax.scan(step, [operands[nc + k] for k in carried],
                         (jnp.arange(p.length), [operands[j] for j in xs_at]),
                         length=p.length, reverse=p.reverse, unroll=p.unroll)
    carry_it, ys_it = iter(carry), iter(ys)
    outs = [next(carry_it) if m else None for m in s.w_carry]
    return outs + [next(ys_it) if m else None for m in s.w_ys]


# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class WeightSplit:
    """`fn(*args) -> (weights, inputs)` split into B (`input_cotangents`) and W
    (`weight_cotangents`); see the module docstring. Built per trace (`split_pullback`)."""

    region: Region
    num_weights: int                # leaves of `weights`
    out_tree: Any                   # of (weights, inputs)

    @property
    def stash_shapes(self) -> list[jax.ShapeDtypeStruct]:
        """What B stashes for W (a scan's part stacked over its iterations), in order."""
        return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.region.stash_shapes()]

    def input_cotangents(self, *args: Any, stash: list[Any] | None = None,
                         at: tuple = ()) -> tuple[Any, list[Any]]:
        """(inputs, stash): B's result, and `stash` (buffers whose entry `at` has the
        `stash_shapes`; new ones if None) with that entry written."""
        if stash is None:
            stash = [jnp.zeros(s.shape, s.dtype) for s in self.stash_shapes]
        self._check(stash, at)
        env = dict(zip(self.region.jaxpr.invars, jax.tree.leaves(args)))
        outs, stash = _run_b(self.region, env, list(stash), tuple(at))
        return self._tree(outs)[1], stash

    def weight_cotangents(self, *args: Any, stash: list[Any], at: tuple = ()) -> Any:
        """`weights`, from the same `args` and entry `at` of B's `stash`."""
        self._check(stash, at)
        env = dict(zip(self.region.jaxpr.invars, jax.tree.leaves(args)))
        return self._tree(_run_w(self.region, env, list(stash), tuple(at)))[0]

    def _check(self, stash: list[Any], at: tuple) -> None:
        got = [(tuple(b.shape[len(at):]), b.dtype) for b in stash]
        if got != [(s.shape, s.dtype) for s in self.stash_shapes]:
            raise ValueError(f"stash buffers {got} do not hold this split's stash "
                             f"{self.stash_shapes} at an index of {len(at)} dims")

    def _tree(self, outs: list[Any]) -> tuple[Any, Any]:
        w_def, b_def = self.out_tree.children()
        n = self.num_weights
        return jax.tree.unflatten(w_def, outs[:n]), jax.tree.unflatten(b_def, outs[n:])


def split_pullback(fn: Callable[..., tuple[Any, Any]], *args: Any) -> WeightSplit:
    """The split of `fn(*args) -> (weights, inputs)` (traced on `args`, in the current trace);
    `UnsupportedSplit` if some equation cannot be placed (module docstring)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    if compat.ordering_effects(jaxpr.effects):
        raise UnsupportedSplit(f"the pullback has effects {jaxpr.effects}")
    num_weights = len(jax.tree.leaves(out_shape[0]))
    region = plan(jaxpr, tuple(closed.consts),
                  [n < num_weights for n in range(len(jaxpr.outvars))])
    return WeightSplit(region, num_weights, jax.tree.structure(out_shape))
