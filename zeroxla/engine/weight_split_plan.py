"""How `zeroxla.engine.weight_split` divides a pullback's jaxpr between B and W: the plan.

Phase 1 (`_plan_b`): what B runs, by dead-code elimination from B's outputs (d_x), recursing
into scans (a carry whose update B reads is B's, to a fixed point) and inlined calls.
Phase 2 (`_plan_w`): what W runs - the equations its outputs (the weight cotangents) need that
B does not run, or cheap ones of B it can redo from what it has - and which of B's values W
reads: the stash. In a scan body the stash also holds B's carries W reads, per iteration; a
carry W's update reads and B lacks becomes a W carry (again to a fixed point). Equations are
never changed, only assigned: B and W together run each needed equation once (bar the cheap
recomputes), so their sum is the pullback's work.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


from zeroxla.compat import jaxpr as compat
from zeroxla.compat.jaxpr import is_var


class UnsupportedSplit(Exception):
    """The pullback holds something the split cannot place between B and W."""


# Recomputed in W rather than stashed when their inputs are W's (layout / elementwise ops).
_CHEAP = frozenset({
    "convert_element_type", "reshape", "broadcast_in_dim", "transpose", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "select_n", "neg", "add", "add_any", "sub", "mul",
    "div", "max", "min", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "copy",
    "copy_p", "bitcast_convert_type", "iota", "reduce_precision", "integer_pow", "square"})


# ----------------------------------------------------------------------------------------------
# Phase 1: what B runs (dead-code elimination from B's outputs, recursing into scans and calls).
@dataclasses.dataclass(frozen=True)
class _BPlan:
    run: tuple[bool, ...]           # per equation: runs whole in B
    subs: dict                      # equation index -> _ScanB | _BPlan (an inlined call)
    outs: tuple[bool, ...]          # the outvars B computes
    reads: tuple[bool, ...]         # the invars B reads


@dataclasses.dataclass(frozen=True)
class _ScanB:
    carry: tuple[bool, ...]         # the carries B's scan carries
    ys: tuple[bool, ...]            # the ys B's scan emits
    body: _BPlan
    reads: tuple[bool, ...]         # the scan's operands B reads


def _plan_b(jaxpr: Any, outs: list[bool], has: list[bool]) -> _BPlan:
    """What B runs of `jaxpr` for its outvars `outs`; `has`: the invars B may read beyond
    those (for `_with_reductions`)."""
    need = {v for v, m in zip(jaxpr.outvars, outs) if m and is_var(v)}
    run, subs = [False] * len(jaxpr.eqns), {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        wanted = [v in need for v in eqn.outvars]
        if not any(wanted):
            continue
        called = compat.called_jaxpr(eqn)
        if compat.is_scan(eqn):
            subs[i] = _plan_scan_b(eqn, wanted)
            reads = subs[i].reads
        elif called is not None:
            subs[i] = _plan_b(called[0], wanted, [False] * len(eqn.invars))
            reads = subs[i].reads
        else:
            run[i], reads = True, [True] * len(eqn.invars)
        need.update(v for v, m in zip(eqn.invars, reads) if m and is_var(v))
    plan_b = _BPlan(tuple(run), subs, tuple(outs), tuple(v in need for v in jaxpr.invars))
    return _with_reductions(jaxpr, plan_b, has)


def _plan_scan_b(eqn: Any, wanted: list[bool]) -> _ScanB:
    p = compat.scan_params(eqn)
    nc, nk = p.num_consts, p.num_carry
    carry, ys = list(wanted[:nk]), list(wanted[nk:])
    while True:                     # a carry B's update reads is B's: to a fixed point
        nx = len(p.jaxpr.jaxpr.invars) - nc - nk
        body = _plan_b(p.jaxpr.jaxpr, carry + ys, [True] * nc + carry + [True] * nx)
        grown = [k for k in range(nk) if body.reads[nc + k] and not carry[k]]
        if not grown:
            break
        for k in grown:
            carry[k] = True
    reads = (*body.reads[:nc], *carry, *body.reads[nc + nk:])
    return _ScanB(tuple(carry), tuple(ys), body, reads)


def _b_outs(sub: Any) -> tuple[bool, ...]:
    return (*sub.carry, *sub.ys) if isinstance(sub, _ScanB) else sub.outs


def _b_defined(eqns: list[Any], b: _BPlan) -> set:
    """The vars B's part of these equations computes (its own equations' and its subs')."""
    return ({v for i, eqn in enumerate(eqns) if b.run[i] for v in eqn.outvars}
            | {v for i, sub in b.subs.items() for v, m in zip(eqns[i].outvars, _b_outs(sub))
               if m})


# ----------------------------------------------------------------------------------------------
# Phase 2: what W runs, and what B stashes for it.
@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """One jaxpr's split: B runs `run_b` and its part of each `subs`, W `run_w` (recomputes
    included) and its part of each; B returns `stash` (this jaxpr's vars) then each sub's."""

    jaxpr: Any
    consts: tuple
    run_b: tuple[bool, ...]
    run_w: tuple[bool, ...]
    subs: dict                      # equation index -> ScanSplit | Region
    b_outs: tuple[bool, ...]
    w_outs: tuple[bool, ...]
    b_reads: tuple[bool, ...]       # invars B reads
    w_reads: tuple[bool, ...]       # invars W reads
    stash: tuple[Any, ...]
    missing: frozenset              # invar indices W needs and neither side has (a scan carry)

    @property
    def stash_count(self) -> int:
        return len(self.stash) + sum(sub.stash_count for sub in self.subs.values())

    def stash_shapes(self) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of each stashed value, in stash order (a scan's: per iteration)."""
        own = [(tuple(v.aval.shape), v.aval.dtype) for v in self.stash]
        return own + [s for i in sorted(self.subs) for s in self.subs[i].stash_shapes()]


@dataclasses.dataclass(frozen=True, eq=False)
class ScanSplit:
    """A scan split into a B-scan (carries `b_carry`, emits `b_ys` and the body's stash per
    iteration) and a W-scan (carries `w_carry`, emits `w_ys`, reads the stacked stash)."""

    params: compat.ScanParams
    body: Region
    b_carry: tuple[bool, ...]
    b_ys: tuple[bool, ...]
    w_carry: tuple[bool, ...]
    w_ys: tuple[bool, ...]

    @property
    def stash_count(self) -> int:
        return self.body.stash_count

    def stash_shapes(self) -> list[tuple[tuple[int, ...], Any]]:
        return [((self.params.length, *shape), dtype)
                for shape, dtype in self.body.stash_shapes()]

    @property
    def b_outs(self) -> tuple[bool, ...]:
        return (*self.b_carry, *self.b_ys)

    @property
    def w_outs(self) -> tuple[bool, ...]:
        return (*self.w_carry, *self.w_ys)

    @property
    def b_reads(self) -> tuple[bool, ...]:
        nc, nk = self.params.num_consts, self.params.num_carry
        return (*self.body.b_reads[:nc], *self.b_carry, *self.body.b_reads[nc + nk:])

    @property
    def w_reads(self) -> tuple[bool, ...]:
        nc, nk = self.params.num_consts, self.params.num_carry
        return (*self.body.w_reads[:nc], *self.w_carry, *self.body.w_reads[nc + nk:])


def _with_reductions(jaxpr: Any, b: _BPlan, b_has: list[bool]) -> _BPlan:
    """`b` also running each weight-gradient reduction (a norm's scale or a bias gradient:
    `reduce_sum` to at most 1/8 of its input) computable from B's values by cheap ops: B then
    stashes the small sum, not the activation-sized cotangent it reduces (a few elementwise
    FLOPs moved into B, a [mb, T, D] per norm and layer less stash)."""
    eqns, run = jaxpr.eqns, list(b.run)
    defined = _b_defined(eqns, b)
    has = {v for v, m in zip(jaxpr.invars, b_has) if m} | set(jaxpr.constvars)
    definer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}

    b_can = set(defined) | has              # what B has or could compute by cheap ops
    for i, eqn in enumerate(eqns):
        if (not run[i] and i not in b.subs and eqn.primitive.name in _CHEAP and not eqn.effects
                and all(not is_var(u) or u in b_can for u in eqn.invars)):
            b_can.update(eqn.outvars)
    for i, eqn in enumerate(eqns):
        if run[i] or i in b.subs or eqn.primitive.name != "reduce_sum" or eqn.effects:
            continue
        size_in, size_out = (math.prod(v.aval.shape) for v in (eqn.invars[0], eqn.outvars[0]))
        if 8 * size_out > size_in or eqn.invars[0] not in b_can:
            continue
        todo = [i]                              # the sum and the cheap ops it reads, into B
        while todo:
            j = todo.pop()
            if not run[j]:
                run[j] = True
                defined.update(eqns[j].outvars)
                todo += [definer[u] for u in eqns[j].invars
                         if is_var(u) and u not in defined and u in definer]
    reads = {v for j, eqn in enumerate(eqns) if run[j] for v in eqn.invars if is_var(v)}
    return dataclasses.replace(b, run=tuple(run), reads=tuple(
        m or v in reads for v, m in zip(jaxpr.invars, b.reads)))


def _plan_w(jaxpr: Any, consts: tuple, b: _BPlan, w_outs: list[bool], w_has: list[bool],
            b_has: list[bool]) -> Region:
    """W's part of `jaxpr` given B's (`b`); `w_has` / `b_has`: the invars each side has."""
    eqns = jaxpr.eqns
    b_defined = _b_defined(eqns, b)
    # B equations W can redo from what it has (cheap ops), and the vars W can have: in order.
    w_can = {v for v, m in zip(jaxpr.invars, w_has) if m} | set(jaxpr.constvars)
    recomputable = [False] * len(eqns)
    for i, eqn in enumerate(eqns):
        if b.run[i]:
            recomputable[i] = (eqn.primitive.name in _CHEAP and not eqn.effects
                               and all(not is_var(v) or v in w_can for v in eqn.invars))
            if recomputable[i]:
                w_can.update(eqn.outvars)
        else:
            w_can.update(v for v in eqn.outvars if v not in b_defined)

    want = {v for v, m in zip(jaxpr.outvars, w_outs) if m and is_var(v)}
    run_w, subs, stash = [False] * len(eqns), {}, []
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        wanted = [v in want for v in eqn.outvars]
        if i in b.subs:
            sub_b = b.subs[i]
            stash += [v for v, m, o in zip(eqn.outvars, wanted, _b_outs(sub_b)) if m and o]
            w_part = [m and not o for m, o in zip(wanted, _b_outs(sub_b))]
            if compat.is_scan(eqn):
                subs[i] = _plan_scan_w(eqn, sub_b, w_part)
            else:
                inner, inner_consts = compat.called_jaxpr(eqn)
                every = [True] * len(eqn.invars)
                subs[i] = _plan_w(inner, tuple(inner_consts), sub_b, w_part, every, every)
            reads = subs[i].w_reads
        elif not any(wanted):
            continue
        elif b.run[i] and not recomputable[i]:
            if compat.has_inner_jaxprs(eqn):
                raise UnsupportedSplit(
                    f"a {eqn.primitive.name} equation computes both what the input gradient "
                    "and what the weight gradients need")
            stash += [v for v, m in zip(eqn.outvars, wanted) if m]
            continue
        else:                                           # W's alone (a call or loop: whole)
            run_w[i], reads = True, [True] * len(eqn.invars)
        want.update(v for v, m in zip(eqn.invars, reads) if m and is_var(v))
    w_reads, missing = [False] * len(jaxpr.invars), set()
    for j, v in enumerate(jaxpr.invars):
        if v in want:
            if w_has[j]:
                w_reads[j] = True
            elif b_has[j]:
                stash.append(v)
            else:
                missing.add(j)
    order = {v: n for n, v in enumerate([*jaxpr.invars, *(o for e in eqns for o in e.outvars)])}
    return Region(jaxpr, consts, b.run, tuple(run_w), subs, b.outs, tuple(w_outs), b.reads,
                   tuple(w_reads), tuple(sorted(set(stash), key=order.__getitem__)),
                   frozenset(missing))


def _plan_scan_w(eqn: Any, b: _ScanB, wanted: list[bool]) -> ScanSplit:
    p = compat.scan_params(eqn)
    nc, nk = p.num_consts, p.num_carry
    nx = len(p.jaxpr.jaxpr.invars) - nc - nk
    carry, ys = list(wanted[:nk]), tuple(wanted[nk:])
    while True:                     # a carry W's update reads (and B lacks) is W's too
        body = _plan_w(p.jaxpr.jaxpr, tuple(p.jaxpr.consts), b.body, carry + list(ys),
                       [True] * nc + carry + [True] * nx,
                       [True] * nc + list(b.carry) + [True] * nx)
        if not body.missing:
            break
        for j in body.missing:
            carry[j - nc] = True
    return ScanSplit(p, body, b.carry, b.ys, tuple(carry), ys)


def plan(jaxpr: Any, consts: tuple, w_outs: list[bool]) -> Region:
    """The split of `jaxpr` whose outvars `w_outs` are W's (the weight cotangents) and the rest
    B's; every invar is available to both. `UnsupportedSplit` where an equation cannot be
    placed (`zeroxla.engine.weight_split`'s docstring)."""
    every = [True] * len(jaxpr.invars)
    b = _plan_b(jaxpr, [not m for m in w_outs], every)
    return _plan_w(jaxpr, consts, b, w_outs, every, every)
