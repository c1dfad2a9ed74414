"""Rebuilding a user's model around its local partitions, inside the traced step.

`zero3_module` walks the module tree of a model whose parameters hold *local shards* and swaps
each `LayerStack` for a `GatheredStack` stand-in and each module that owns partitioned
parameters *directly* for a stand-in that gathers exactly those around every call
(`gathered_call`). The model then computes as if its parameters were whole. The user's model
object is never touched: the stand-ins live in a copy (`nnx.merge` of the local storage) made
inside the traced step.

Gather units follow the module tree, not Python containers: children are found in attributes,
`nnx.List`, and plain lists, tuples and dicts (`nnx.data([...])`). A module that owns a
partitioned parameter and also has children (a root-owned positional table, say) is not a unit:
its own parameters are gathered alone, as values (`gathered_value`), when the copy is built, and
its children stay units of their own.

Shared weights (one `nnx.Param` reachable from two paths, or one submodule used twice) are one
parameter of the plan, keyed by its first path (its *canonical* path, the one `nnx.split`
gives). At stage 3 every use gathers it from the same traced shard, so autodiff sums the uses'
reduce-scattered gradients. At stage 2 nothing is gathered, so a weight used by more than one
call (`reduced_once`, found by counting the calls, `uses`) is instead taken out of the per-call
units: it enters the model copy once, through `gathered_value`, and autodiff sums its uses'
gradients before the one reduce-scatter (DeepSpeed's tied-module gradient reduction: the
gradient hook fires once, after every use has accumulated into `.grad`).

Model state and RNG streams (BatchNorm statistics, a Dropout's Rngs) run inside the call of the
unit that holds them; what the call changes is returned from the custom VJP and written back to
the step's copy, as are Variables passed as arguments (an `nnx.Rngs` given at call time).

`local_model` builds that copy from a step's `ZeroLayout`: the training step's gradient pass and
evaluation, and the ZeRO-3 generation baseline (`zeroxla.inference.baseline`), all compute on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zeroxla.collectives.zero import GradientSink, ZeroCollectives
from zeroxla.engine.offload import PartitionSink
from zeroxla.engine.gather import GatheredStack, check_live, gathered_call, gathered_value
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.model_state import cross_replica_batch_norm, model_state_variables
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.stored_forms import StoredCodes
from zeroxla.sharding.model_def import direct_variables, has_descendant_params, variable_paths
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.models.layers import LayerStack, call_block

_CONTAINERS = (list, tuple, dict)


class _Context:
    """What every stand-in needs: the plan, the collectives, and each Variable's canonical path
    (by object identity, so a shared Variable is recognised under any of its paths). `uses`,
    when given, counts per leaf path the stand-in calls that gather it (`zero3_module`)."""

    def __init__(self, plan: ShardingPlan, comm: ZeroCollectives, prefetch: bool, remat: str,
                 paths: Mapping[int, str], uses: Counter | None = None,
                 max_live: int | None = None):
        self.plan, self.comm, self.prefetch, self.paths = plan, comm, prefetch, paths
        self.remat, self.uses, self.max_live = remat, uses, max_live

    def count(self, leaves: tuple[LeafPlan, ...]) -> None:
        """One call of a unit gathering `leaves` (their `LeafPlan`s), when counting."""
        if self.uses is not None:
            self.uses.update(leaf.path for leaf in leaves)

    def path_of(self, variable: nnx.Variable) -> str:
        return self.paths[id(variable)]

    def leaf_of(self, variable: nnx.Variable):
        return self.plan[self.path_of(variable)]

    def rebound(self, variables: list[nnx.Variable], paths: list[str]) -> "_Context":
        """The same context for a fresh copy of a module, whose `variables` (in split order)
        have these canonical `paths`."""
        return _Context(self.plan, self.comm, self.prefetch, self.remat,
                        {id(v): p for v, p in zip(variables, paths, strict=True)}, self.uses,
                        self.max_live)

    def partitioned(self, variable: nnx.Variable) -> bool:
        """A parameter whose units go through the collectives: stored partitioned (stage 3),
        or with its gradient partitioned (stage 2); model state, such as batch statistics,
        never is."""
        return isinstance(variable, nnx.Param) and self.comm.gathers(self.leaf_of(variable))


class _GatheredModule:
    """Stands in for a module that owns partitioned parameters directly; every method call
    gathers those (and only those) around the call.

    The call rebuilds the module from its graph definition and the values of all its Variables:
    its own partitioned ones gathered, every other one (descendants' shards, replicated leaves)
    passed in as an explicit input of the custom VJP, so nothing traced is closed over and the
    descendants' gradients flow back through the call. Model state the call updates (batch
    statistics) comes back as an output and is written to the step's model copy.
    """

    def __init__(self, module: nnx.Module, ctx: _Context, gathered: frozenset[str],
                 own: frozenset[str]):
        """`own`: the paths of the partitioned parameters this call gathers (the module's own,
        less those `gathered` by an ancestor)."""
        self._graphdef, state = nnx.split(module)
        self._treedef = jax.tree.structure(state, is_leaf=_is_codes)
        variables = _variables_of(module)
        self._paths = [ctx.path_of(v) for v in variables]
        self._own = frozenset(i for i, p in enumerate(self._paths) if p in own)
        self._leaves = tuple(ctx.plan[self._paths[i]] for i in sorted(self._own))
        check_live(sum(leaf.unit_numel for leaf in self._leaves if leaf.params_partitioned),
                   ctx.max_live, f"module {type(module).__name__}'s parameters")
        if len(jax.tree.leaves(state, is_leaf=_is_codes)) != len(variables):
            raise ValueError(f"module {type(module).__name__}: nested Variables are not supported")
        self._variables = variables            # the step's model copy's: read at each call
        self._mutable = [i for i, v in enumerate(variables) if not isinstance(v, nnx.Param)]
        self._ctx = ctx
        # Parameters gathered by this call (or an ancestor's): the children's stand-ins, built
        # inside the call, must not gather them again.
        self._gathered = gathered | own

    def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        own, mutable = self._own, self._mutable
        self._ctx.count(self._leaves)
        current = [v.get_value() for v in self._variables]
        shards = [v for i, v in enumerate(current) if i in own]
        rest = [v for i, v in enumerate(current) if i not in own]

        def fn(full, inputs):
            call_args, call_kwargs, rest_values = inputs
            full_it, rest_it = iter(full), iter(rest_values)
            values = [next(full_it) if i in own else next(rest_it) for i in range(len(current))]
            module = nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, values))
            variables = _variables_of(module)
            ctx = self._ctx.rebound(variables, self._paths)
            _wrap_children(module, ctx, self._gathered, {})
            out = getattr(module, method)(*call_args, **call_kwargs)
            updated = [variables[i].get_value() for i in mutable]
            passed = [v.get_value() for v in _variables_in((call_args, call_kwargs))]
            return (out, updated, passed) if mutable or passed else out

        out = gathered_call(fn, self._leaves, self._ctx.comm, self._ctx.remat, shards, (args, kwargs, rest))
        passed_in = _variables_in((args, kwargs))
        if not (mutable or passed_in):
            return out
        # Write back what the call changed: the module's model state (batch statistics, RNG
        # counters) and Variables passed as arguments (an `nnx.Rngs` advanced by a dropout).
        out, updated, passed = out
        for i, value in zip(mutable, updated):
            self._variables[i].set_value(value)
        for variable, value in zip(passed_in, passed):
            variable.set_value(value)
        return out

    def __call__(self, *args, **kwargs):
        return self._invoke("__call__", args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._invoke(name, args, kwargs)

    def __getitem__(self, index):
        """A module read as a weight (`module[...]`, a `zeroxla.lora.LoRAWeight`) is indexed
        by the value its call returns: the call gathers, the indexing happens outside it."""
        return self._invoke("__call__", (), {})[index]


def _is_codes(x: Any) -> bool:
    """One parameter's storage that is a pytree: frozen codes, stage 2's gradient sink, or a
    partition read beside its gradient sink (`engine.offload.PartitionSink`)."""
    return isinstance(x, (StoredCodes, GradientSink, PartitionSink))


def _variables_in(tree: Any) -> list[nnx.Variable]:
    """The Variables inside a pytree of call arguments (an `nnx.Rngs`' keys and counters)."""
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
            if isinstance(x, nnx.Variable)]


def _variables_of(module: nnx.Module) -> list[nnx.Variable]:
    """The module's Variables in `nnx.split` order (shared ones once)."""
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Variable)]


class _GatheredLayerStack:
    """Stands in for a `LayerStack`: its layers run with per-layer gathers and prefetch."""

    def __init__(self, stack: LayerStack, ctx: _Context):
        graphdef, state = nnx.split(stack.layers)
        extra = [path for path, v in nnx.to_flat_state(state) if not isinstance(v, nnx.Param)]
        if extra:
            raise ValueError(f"LayerStack layers hold non-parameter Variables {extra[:4]} "
                             "(batch statistics?); a scanned stack runs parameters only: hold "
                             "such layers in an nnx.List instead")
        self._shards, treedef = jax.tree.flatten(state, is_leaf=_is_codes)
        leaves = tuple(ctx.leaf_of(v) for v in _variables_of(stack.layers))
        self._leaves, self._ctx = leaves, ctx

        def layer(full, x, consts, cache_i):
            block = nnx.merge(graphdef, jax.tree.unflatten(treedef, full))
            return call_block(block, x, consts, cache_i)
        self._stack = GatheredStack(layer, leaves, ctx.comm, ctx.prefetch, ctx.remat,
                                    ctx.max_live)

    def __call__(self, x: Any, *args: Any, cache: Any = None) -> tuple[Any, Any]:
        self._ctx.count(self._leaves)
        return self._stack(self._shards, x, args, cache)


def _wrap(node: Any, ctx: _Context, gathered: frozenset[str], memo: dict[int, Any]) -> Any:
    """Returns `node` or its stand-in; recurses into children and containers that need none.
    `memo` maps modules already seen to their replacement, so a shared submodule gets one."""
    if isinstance(node, LayerStack):
        if id(node) not in memo:
            memo[id(node)] = _GatheredLayerStack(node, ctx)
        return memo[id(node)]
    if isinstance(node, nnx.Module):
        if id(node) in memo:
            return memo[id(node)]
        memo[id(node)] = node            # cycles (a child pointing back) end here
        own = [v for v in direct_variables(node)
               if ctx.partitioned(v) and ctx.path_of(v) not in gathered]
        # Descendants holding only model state or RNG streams (a BatchNorm's statistics, a
        # Dropout's Rngs) run inside the module's call, their updates written back.
        if own and not has_descendant_params(node):
            memo[id(node)] = _GatheredModule(node, ctx, gathered,
                                             frozenset(ctx.path_of(v) for v in own))
            return memo[id(node)]
        for variable in own:       # a module with children: its own parameters, gathered alone
            if ctx.leaf_of(variable).params_partitioned:
                check_live(ctx.leaf_of(variable).unit_numel, ctx.max_live,
                           f"parameter {ctx.path_of(variable)}")
            variable.set_value(gathered_value(ctx.leaf_of(variable), ctx.comm,
                                              variable.get_value()))
        _wrap_children(node, ctx, gathered | {ctx.path_of(v) for v in own}, memo)
        return node
    if isinstance(node, list):
        node[:] = [_wrap(x, ctx, gathered, memo) for x in node]
        return node
    if isinstance(node, tuple):
        wrapped = [_wrap(x, ctx, gathered, memo) for x in node]
        if all(a is b for a, b in zip(wrapped, node)):
            return node
        return type(node)(*wrapped) if hasattr(node, "_fields") else tuple(wrapped)
    if isinstance(node, dict):
        for key, value in list(node.items()):
            node[key] = _wrap(value, ctx, gathered, memo)
        return node
    return node


def _wrap_children(module: nnx.Module, ctx: _Context, gathered: frozenset[str],
                   memo: dict[int, Any]) -> None:
    for name, child in list(vars(module).items()):
        if isinstance(child, (nnx.Module, *_CONTAINERS)):
            replacement = _wrap(child, ctx, gathered, memo)
            if replacement is not child:
                setattr(module, name, replacement)


def zero3_module(model: nnx.Module, plan: ShardingPlan, comm: ZeroCollectives,
                 prefetch: bool, remat: str, *, reduced_once: frozenset[str] = frozenset(),
                 uses: Counter | None = None, max_live: int | None = None) -> Any:
    """Wraps a model whose parameters hold *local shards* so that it computes as if whole.

    `model` must be a fresh copy (nnx.merge of the local storage) made inside the traced step.
    `remat` is the activation policy of every gathered unit (`zeroxla.engine.remat`).
    `reduced_once`: paths of parameters that no call gathers; each enters the copy once as a
    `gathered_value`, whose backward reduce-scatters the gradient summed over all its uses
    (stage 2's weights used by more than one call, `engine.gradients.reduced_once`).
    `uses`: a Counter that every stand-in call adds one to for each leaf it gathers (the
    counting pass that finds those weights). `max_live`: `ZeroConfig.max_live_parameters`
    (stage 3), the bound on gathered elements live at once (`GatheredStack.prefetching`).
    """
    ctx = _Context(plan, comm, prefetch, remat, variable_paths(model), uses, max_live)
    for variable in _variables_of(model):
        if isinstance(variable, nnx.Param) and ctx.path_of(variable) in reduced_once:
            variable.set_value(gathered_value(ctx.leaf_of(variable), comm, variable.get_value()))
    return _wrap(model, ctx, frozenset(reduced_once), {})


def local_model(layout: ZeroLayout, params: dict[str, Any], model_state: dict[str, jax.Array],
                key: jax.Array | None, *, training: bool = True,
                reduced_once: frozenset[str] = frozenset(), uses: Counter | None = None
                ) -> tuple[Any, Any]:
    """This device's copy of the model inside the step's `shard_map` (stage 3: wrapped to gather
    its partitions, `zero3_module`) and a function reading its model state after a forward
    pass, averaged over the data devices. `params` is what compute reads of the stored
    parameters (`ShardingPlan.compute_inputs`), local shards; `reduced_once` and `uses` go to
    `zero3_module` (stage 2's weights used more than once).

    BatchNorm statistics are computed over the global batch (`axis_name` = the data axes,
    Flax's cross-replica BatchNorm), as on one device with the whole batch. The model's RNG
    streams are keyed from `key`, this device's and micro-batch's key."""
    config, data = layout.config, layout.axes.data
    dtype = config.dtype
    if config.stage < 3:      # stage 2's sinks are cast per unit (Zero2Collectives)
        values = {p: v if isinstance(v, GradientSink) else v.astype(dtype)
                  for p, v in params.items()}
    else:
        values = {leaf.path: params[leaf.path] if leaf.params_partitioned
                  else params[leaf.path].astype(dtype) for leaf in layout.plan.leaves}
    model = layout.model_def.module(values, model_state, key)
    if not training:
        model.eval()
    variables = model_state_variables(model)
    cross_replica_batch_norm(model, data)
    if config.stage == 3 or (config.stage == 2 and training):
        # Stage 2 gathers nothing, so there is nothing to prefetch.
        prefetch = config.prefetch and config.stage == 3
        max_live = config.max_live_parameters if config.stage == 3 else None
        model = zero3_module(model, layout.model_plan, layout.comm, prefetch, config.remat,
                             reduced_once=reduced_once, uses=uses, max_live=max_live)

    def read_state() -> dict[str, jax.Array]:
        return {p: lax.pmean(v.get_value(), data)
                if jnp.issubdtype(v.get_value().dtype, jnp.inexact) else v.get_value()
                for p, v in variables.items()}
    return model, read_state
