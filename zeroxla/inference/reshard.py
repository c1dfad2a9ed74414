"""ZeRO-3 storage -> tensor-parallel layout in one program, each device receiving only (about)
its own tensor-parallel slice.

Storage splits a leaf's dim `s` over all D = dp x tp devices (chunk d on flat device d). On the
inference mesh `(node=1, local=dp, tensor=tp)` flat device d = l tp + t, so the same arrays read
as `s` split over ("node", "local", "tensor"). Per leaf, with `t` its tensor-parallel dim:

* t != s: `all_to_all` over `tensor` (split t into tp pieces, concatenate along s), then
  `all_gather` over the data axes along s: device (l, t) receives its 1/tp slice, (dp-1)/dp
  of it from others (Megatron slice, no full copy anywhere).
* t == s, no padding: `ppermute` so device (l, t) holds storage chunk t dp + l, then
  `all_gather` over the data axes: the chunks t dp .. t dp + dp - 1, i.e. slice t.
* otherwise (no t; t == s with padding; replicated KV heads; a replicated or quantized leaf):
  the whole leaf is gathered (or already there) and sliced locally.

GSPMD given only the two layouts replicates the whole leaf first ("involuntary full
rematerialization"), which is why this is written out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zeroxla.engine.stored import storage_to_logical
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.inference.layout import TensorParallelLayout


def _tensor_dim(spec: P, tensor: str | None) -> int | None:
    return next((i for i, e in enumerate(spec) if e == tensor and tensor is not None), None)


def _slice(x: jax.Array, dim: int, tp: int, tensor: str) -> jax.Array:
    """This device's 1/tp slice of the whole `x` along `dim`."""
    size = x.shape[dim] // tp
    return lax.dynamic_slice_in_dim(x, lax.axis_index(tensor) * size, size, axis=dim)


def plan_route(leaf: LeafPlan, t: int | None, kv_dim: int | None, devices: int) -> str:
    """How `leaf` travels: "all_to_all", "permute", "gather" or "local" (see the module).
    "local" also when storage does not split over all `devices` (a pipeline or tensor axis in
    the training mesh): XLA then moves it as it sees fit."""
    if leaf.params_quantized or not leaf.params_partitioned or leaf.data_size != devices:
        return "local"
    if t is None or kv_dim is not None:
        return "gather"
    if t != leaf.shard_dim:
        return "all_to_all"
    return "permute" if leaf.padded_size == leaf.shape[t] else "gather"


def reshard_function(plan: ShardingPlan, layout: TensorParallelLayout
                     ) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """`params` (a TrainState's storage) -> {path: float32 array in the layout}; jit it."""
    axes = layout.axes
    tp, dp, tensor, data = layout.tp, layout.data_size, axes.tensor, axes.data
    everything = (*data, tensor) if tensor else data
    specs, kv_dims = dict(layout.specs), dict(layout.kv_dims)
    routes = {leaf.path: plan_route(leaf, _tensor_dim(specs[leaf.path], tensor),
                                    kv_dims.get(leaf.path), dp * tp) for leaf in plan.leaves}
    moved = [leaf for leaf in plan.leaves if routes[leaf.path] != "local"]

    def storage_spec(leaf: LeafPlan) -> P:
        entries: list[Any] = [None] * len(leaf.shape)
        entries[leaf.shard_dim] = everything
        return P(*entries)

    def local(chunks: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for leaf in moved:
            x, s = chunks[leaf.path], leaf.shard_dim                 # x: [.., s / D, ..]
            t = _tensor_dim(specs[leaf.path], tensor)
            route = routes[leaf.path]
            if route == "all_to_all":
                x = lax.all_to_all(x, tensor, split_axis=t, concat_axis=s, tiled=True)
                x = lax.all_gather(x, data, axis=s, tiled=True)       # [.., s, .., T/tp, ..]
                out[leaf.path] = leaf.unpad(x)
            elif route == "permute":
                # device l tp + t takes chunk t dp + l
                pairs = [(t_ * dp + l, l * tp + t_) for l in range(dp) for t_ in range(tp)]
                x = lax.ppermute(x, everything, pairs)
                out[leaf.path] = lax.all_gather(x, data, axis=s, tiled=True)   # [.., S/tp, ..]
            else:
                x = leaf.unpad(lax.all_gather(x, everything, axis=s, tiled=True))
                if leaf.path in kv_dims:
                    x = jnp.repeat(x, layout.kv_repeat, axis=kv_dims[leaf.path])
                out[leaf.path] = x if t is None else _slice(x, t, tp, tensor)
        return out

    gather = jax.shard_map(local, mesh=layout.mesh, check_vma=False,
                           in_specs=({leaf.path: storage_spec(leaf) for leaf in moved},),
                           out_specs={leaf.path: specs[leaf.path] for leaf in moved})

    def reshard(params: dict[str, Any]) -> dict[str, jax.Array]:
        out = gather({leaf.path: params[leaf.path] for leaf in moved})
        for leaf in plan.leaves:
            if routes[leaf.path] == "local":              # XLA slices it where it lies
                x = storage_to_logical(leaf, params[leaf.path])
                if leaf.path in kv_dims:
                    x = jnp.repeat(x, layout.kv_repeat, axis=kv_dims[leaf.path])
                out[leaf.path] = x
        return {path: out[path].astype(jnp.float32) for path in plan.paths}

    return reshard
