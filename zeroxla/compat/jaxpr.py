"""The few facts about JAX's jaxprs that `zeroxla.engine.weight_split`,
`zeroxla.engine.cotangent_layout` and `zeroxla.engine.invariant_residuals` read and that no
public API states, as they hold on jax 0.10.2 and on jax 0.12.0.1 (check them again on an
upgrade). All three re-emit a jaxpr equation by equation, with the environment helpers here
(`read`, `write`).

* Which primitives are calls of an inner jaxpr, under which parameter that jaxpr sits, and
  which of them have no semantics of their own (`PLAIN_CALLS`): the split inlines them all, the
  cotangent layout and the invariant residuals the plain ones. On both versions: `jit`
  (`jaxpr`), `remat2` (`jax.checkpoint`, `jaxpr`), `custom_jvp_call` and `custom_vjp_call`
  (`call_jaxpr`). A call of a jaxpr value is `closed_call` on 0.10 and `eval_jaxpr` from 0.12
  on (both `call_jaxpr`): the table names both, so no version is asked.
* A called jaxpr with its constants: on 0.10 a `ClosedJaxpr` (`.jaxpr`, `.consts`) or an open
  `Jaxpr`; from 0.11 on the two are one class (`jax.extend.core.ClosedJaxpr` is `Jaxpr`), whose
  `.jaxpr` is itself, `.consts` the values of its `constvars` and `.invars` the rest. The same
  reads (`.jaxpr.invars`, `.jaxpr.constvars`, `.consts`) mean the same on both.
* A `scan` equation's loop (`scan_params`): operands are consts, then carries, then xs; results
  carries, then ys. On 0.10 the parameters count them (`num_consts`, `num_carry`); from 0.11 on
  they are flat trees of the operands and results (`ft_in`: (consts, carries, xs); `ft_out`:
  (carries, ys)), counted here. `length`, `reverse`, `unroll` and `jaxpr` (the body) are the
  same on both. The split rebuilds a scan as two `lax.scan`s from them.
* Which effects are only a collective's mesh axis names (`NamedAxisEffect`, on both), not an
  order.
* How `jax.core.eval_jaxpr` re-emits an equation, the same on both: `bind` with
  `Primitive.get_bind_params`, under the equation's context (`eqn.ctx.manager`) and its name
  stack (`jax._src.source_info_util.user_context` and `current_name_stack`, private), so the
  ops the split re-emits keep their `jax.named_scope` names (the comm report reads
  "zero_bwd_gather" / "zero_grad_reduce" from the compiled ops' names). That private use is
  here only.

* Which inputs a jaxpr's outputs depend on (`live_jaxpr`): JAX's dead-code elimination
  (`jax._src.interpreters.partial_eval.dce_jaxpr`, private, the same signature on both), which
  prunes inside `shard_map`, `scan`, `jit` and `remat` by their own rules; and the name stack an
  equation was traced under (`name_stack`: `eqn.source_info.name_stack`). The step reads both
  to prove that a model used a packed batch's keys and its `SequenceParallel`
  (`zeroxla.engine.consumption`).

Everything else the split uses is public: `jax.extend.core` (`Jaxpr`, `Var`, `Literal`,
`jaxprs_in_params`), `jax.make_jaxpr` and `lax.scan`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from jax._src import source_info_util   # private: see the module docstring
from jax._src.interpreters import partial_eval   # private: see the module docstring
from jax.extend import core as jex_core

from zeroxla.compat.versions import jax_at_least

# primitive name -> the parameter holding the jaxpr it calls (a Jaxpr or ClosedJaxpr)
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "eval_jaxpr": "call_jaxpr", "core_call": "call_jaxpr", "checkpoint": "jaxpr",
          "remat": "jaxpr", "remat2": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


# The calls among them with no semantics of their own (no rematerialization, no custom rule):
# inlining one changes nothing but the call boundary.
PLAIN_CALLS = ("pjit", "jit", "closed_call", "eval_jaxpr", "core_call")


def called_jaxpr(eqn: Any) -> tuple[Any, list[Any]] | None:
    """(jaxpr, consts) of a call equation whose inputs are the jaxpr's invars one to one, or
    None for any other equation."""
    param = _CALLS.get(eqn.primitive.name)
    inner = eqn.params.get(param) if param else None
    if inner is None:
        return None
    if isinstance(inner, jex_core.ClosedJaxpr):
        jaxpr, consts = inner.jaxpr, list(inner.consts)
    else:
        jaxpr, consts = inner, []
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None                                   # not a plain call (extra operands)
    return jaxpr, consts


def is_scan(eqn: Any) -> bool:
    return eqn.primitive.name == "scan"


@dataclasses.dataclass(frozen=True)
class ScanParams:
    """A scan equation's loop: operands are consts, then carries, then xs."""

    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any
    jaxpr: Any                    # the body, a ClosedJaxpr: (consts, carries, xs) -> (carries, ys)


def scan_params(eqn: Any) -> ScanParams:
    p = eqn.params
    num_consts, num_carry = _scan_counts(p)
    return ScanParams(num_consts, num_carry, p["length"], p["reverse"], p["unroll"], p["jaxpr"])


def _counted_scan(p: dict) -> tuple[int, int]:
    """jax 0.10: `num_consts`, `num_carry`."""
    return p["num_consts"], p["num_carry"]


def _flat_tree_scan(p: dict) -> tuple[int, int]:
    """jax 0.11 on: the leaf counts of `ft_in`'s consts and carries (`ft_out`'s carries are the
    same, checked)."""
    consts, carries, _ = p["ft_in"].unpack()
    out_carries, _ = p["ft_out"].unpack()
    if len(carries) != len(out_carries):
        raise ValueError(f"scan ft_in has {len(carries)} carries, ft_out {len(out_carries)}")
    return len(consts), len(carries)


_scan_counts = _flat_tree_scan if jax_at_least(0, 11) else _counted_scan


def ordering_effects(effects: Any) -> set:
    """The effects that order a program's equations: all but `NamedAxisEffect`, which only
    records that a collective names a mesh axis (a `shard_map` body's all-gathers have it)."""
    return {e for e in effects if type(e).__name__ != "NamedAxisEffect"}


def has_inner_jaxprs(eqn: Any) -> bool:
    return bool(list(jex_core.jaxprs_in_params(eqn.params)))


def is_var(v: Any) -> bool:
    """An equation operand or result that is a variable: not a literal, not a dropped output."""
    return not isinstance(v, (jex_core.Literal, jex_core.DropVar))


def read(env: dict, v: Any) -> Any:
    """The value of operand `v` where `env` maps variables to values (a literal's own)."""
    return v.val if isinstance(v, jex_core.Literal) else env[v]


def write(env: dict, outvars: list, values: list) -> None:
    """Records each result's value in `env`; None values and dropped outputs are not kept."""
    for v, x in zip(outvars, values):
        if x is not None and is_var(v):
            env[v] = x


def bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """The equation applied to `invals` as `jax.core.eval_jaxpr` applies it: its outputs, as a
    list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with scope_of(eqn), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def scope_of(eqn: Any) -> Iterator[None]:
    """Re-enters the name stack the equation was traced under (its `jax.named_scope`s and
    transforms, e.g. "transpose(jvp(zero_fwd_gather))/zero_bwd_gather"), below the current."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        yield


def live_jaxpr(jaxpr: Any) -> tuple[Any, list[bool]]:
    """`jaxpr` (open) with the equations its outputs do not depend on removed, and for each
    of its `invars` whether they do depend on it."""
    return partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))


def name_stack(eqn: Any) -> str:
    """The `jax.named_scope`s and transforms the equation was traced under, "a/jvp(b)/c",
    relative to the jaxpr holding it."""
    return str(eqn.source_info.name_stack)


__all__ = ["PLAIN_CALLS", "ScanParams", "bind", "called_jaxpr", "has_inner_jaxprs", "is_scan",
           "is_var", "live_jaxpr", "name_stack", "ordering_effects", "read", "scan_params",
           "scope_of", "write"]
