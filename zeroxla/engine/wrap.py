"""Rebuilding a user's model around its local partitions, inside the traced step.

`zero3_module` walks the module tree of a model whose parameters hold *local shards* and swaps
each `LayerStack` for a `GatheredStack` stand-in and each module that owns partitioned
parameters for a stand-in that gathers around every call (`gathered_call`). The model then
computes as if its parameters were whole. The user's model object is never touched: the
stand-ins live in a copy (`nnx.merge` of the local storage) made inside the traced step.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from zeroxla.collectives.zero import ZeroCollectives
from zeroxla.engine.gather import GatheredStack, gathered_call
from zeroxla.engine.model_def import path_str
from zeroxla.engine.plan import ShardingPlan
from zeroxla.models.layers import LayerStack, call_block
from zeroxla.pallas_kernels import QuantizedArray


def _split_shards(module: nnx.Module) -> tuple[Any, list[Any], Any, list[str]]:
    """(graphdef, shards, treedef, paths) of a module's parameters; stored codes (a
    `QuantizedArray`) count as one shard."""
    graphdef, state = nnx.split(module)
    shards, treedef = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, QuantizedArray))
    return graphdef, shards, treedef, [path_str(p) for p, _ in nnx.to_flat_state(state)]


def _join(prefix: str, path: str) -> str:
    return f"{prefix}/{path}" if prefix else path


class _GatheredModule:
    """Stands in for a module that owns partitioned parameters; every method call gathers them."""

    def __init__(self, module: nnx.Module, prefix: str, plan: ShardingPlan,
                 comm: ZeroCollectives):
        self._graphdef, self._shards, self._treedef, paths = _split_shards(module)
        self._leaves = tuple(plan[_join(prefix, p)] for p in paths)
        self._comm = comm

    def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        def fn(full, inputs):
            call_args, call_kwargs = inputs
            module = nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, full))
            return getattr(module, method)(*call_args, **call_kwargs)
        return gathered_call(fn, self._leaves, self._comm, self._shards, (args, kwargs))

    def __call__(self, *args, **kwargs):
        return self._invoke("__call__", args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._invoke(name, args, kwargs)


class _GatheredLayerStack:
    """Stands in for a `LayerStack`: its layers run with per-layer gathers and prefetch."""

    def __init__(self, stack: LayerStack, prefix: str, plan: ShardingPlan,
                 comm: ZeroCollectives, prefetch: bool):
        graphdef, self._shards, treedef, paths = _split_shards(stack.layers)
        leaves = tuple(plan[_join(prefix, "layers/" + p)] for p in paths)

        def layer(full, x, consts, cache_i):
            block = nnx.merge(graphdef, jax.tree.unflatten(treedef, full))
            return call_block(block, x, consts, cache_i)
        self._stack = GatheredStack(layer, leaves, comm, prefetch)

    def __call__(self, x: Any, *args: Any, cache: Any = None) -> tuple[Any, Any]:
        return self._stack(self._shards, x, args, cache)


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
    """Wraps a model whose parameters hold *local shards* so that it computes as if whole.

    `model` must be a fresh copy (nnx.merge of the local storage) made inside the traced step.
    """
    return _wrap(model, "", plan, comm, prefetch)
