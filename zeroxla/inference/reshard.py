"""ZeRO-3 storage -> tensor-parallel layout in one program, at the byte floor where the storage
allows it, and an account of every leaf's bytes against that floor.

The floor: a device holds 1/N of a leaf of W bytes and will hold 1/tp of it, so it must receive
at least W/tp (1 - tp/N), and no more when its 1/N lies inside its 1/tp (verl's 3D-HybridEngine
bound; DeepSpeed's Hybrid Engine gathers whole layers, W (1 - 1/N)). Two choices put it there:

* storage (`sharding.rules.ZERO_STORAGE_RULES`): the ZeRO partition cuts the dim tensor
  parallelism splits (heads, kv_heads, mlp, vocab) when N divides it, so chunk c (on training
  device c) lies in tensor slice floor(c tp / N) for every tp dividing N;
* the inference mesh (`layout.inference_mesh`): `(node=1, local=dp, tensor=tp)`, dp = N / tp,
  tensor-major: position (l, t) is training device t dp + l, which holds chunk t dp + l. The
  training arrays read, unmoved, as their dim `s` split over ("tensor", "node", "local").

Per leaf, with `s` its storage dim and `t` its tensor-parallel dim (`plan_route`):

* "slice" (t == s, no padding): `all_gather` over the data axes along s; device (l, t) gets
  chunks t dp .. t dp + dp - 1, i.e. slice t. Receives W/tp (1 - tp/N): the floor.
* "all_to_all" (t != s: N does not divide the tensor dim, e.g. 4 heads on 8 devices; or
  grouped-query KV heads replicated tp / G times, repeated locally first): `all_to_all` over
  `tensor` (split t, concatenate along s), `all_gather` over the data axes along s, and a local
  reorder of s's chunks from (l, t) to (t, l) order. Receives W' / tp (1 - 1/N), W' = W x the
  KV repeat: the least for this storage, W' / tp (1 - 1/N) - W / tp (1 - tp/N) over the floor
  (a device's chunk is 1/tp inside its slice, not whole).
* "gather" (no t: tensor parallelism replicates it, e.g. norms, a vocabulary tp does not
  divide, learned positions; or t == s padded up to a multiple of N, so chunks straddle
  slices): the whole leaf is gathered over every device and sliced locally. Receives
  W (1 - 1/N) of the padded leaf.
* "local": replicated in storage (under the persistence threshold): 0 bytes, below the floor.
  Stored as quantized codes, or not split over all N devices (a pipeline or tensor axis in the
  training mesh; the inference mesh then keeps the training order, `tensor_major=False`): XLA
  moves it as it sees fit, not counted by `reshard_account`.

W is the leaf's bytes as it travels: the float32 master, which the engine's float32 inference
copy is built from, so 4 bytes a parameter (the issue's 2 Psi / T (1 - T/N) counts 16-bit
ones); for a 16-bit inference copy (`HybridEngineConfig.rollout_dtype="bfloat16"`) each device
casts its partition before any collective, so 2 bytes a parameter travel: half the float32 bytes.

Under a 16-bit compute dtype a persistent leaf's float32 master is partitioned beside its
16-bit replicated copy; the engine reads the master (the same values as `gathered_model`), so it
travels as a partitioned leaf does. GSPMD given only the two layouts replicates the whole leaf
first ("involuntary full rematerialization"), which is why this is written out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zeroxla.collectives.wire import is_16bit_float
from zeroxla.engine.stored import storage_to_logical
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.inference.layout import TensorParallelLayout

ROUTES = ("slice", "all_to_all", "gather", "local")


def _tensor_dim(spec: P, tensor: str | None) -> int | None:
    return next((i for i, e in enumerate(spec) if e == tensor and tensor is not None), None)


def _slice(x: jax.Array, dim: int, tp: int, tensor: str) -> jax.Array:
    """This device's 1/tp slice of the whole `x` along `dim`."""
    size = x.shape[dim] // tp
    return lax.dynamic_slice_in_dim(x, lax.axis_index(tensor) * size, size, axis=dim)


def _moved(leaf: LeafPlan, devices: int) -> bool:
    """Stored as a float32 partition over all `devices` (a stage-3 parameter, or the master of a
    leaf with a 16-bit compute copy): the shard_map moves it."""
    return (leaf.master_partitioned and not leaf.params_quantized
            and not leaf.stage_split and leaf.data_size == devices)


def plan_route(leaf: LeafPlan, t: int | None, kv_dim: int | None, devices: int) -> str:
    """How `leaf` travels: one of `ROUTES` (see the module docstring)."""
    if not _moved(leaf, devices):
        return "local"
    if t is None:
        return "gather"
    if t != leaf.shard_dim:
        return "all_to_all"
    # t == s: a replicated KV head's dim cannot be N-divisible (G < tp <= N), so it is padded
    return "slice" if leaf.padded_size == leaf.shape[t] and kv_dim is None else "gather"


def _reorder(x: jax.Array, dim: int, dp: int, tp: int) -> jax.Array:
    """`dim` holds dp x tp chunks in (l, t) order (gathered over the data axes after the
    all_to_all) -> (t, l) order, the storage order t dp + l: [.., dp tp c, ..] reshaped."""
    shape = x.shape
    x = x.reshape(*shape[:dim], dp, tp, shape[dim] // (dp * tp), *shape[dim + 1:])
    return jnp.swapaxes(x, dim, dim + 1).reshape(shape)


@dataclasses.dataclass(frozen=True)
class LeafTraffic:
    """One leaf's reshard: its route, the bytes each device receives, the floor, and why it
    misses the floor (`reason`, one of `REASONS`, and `why` in words; both empty when it does
    not)."""

    path: str
    route: str
    received: float | None          # bytes per device; None: XLA decides ("local", not split)
    floor: float                    # W / tp (1 - tp / N), W the logical leaf's bytes
    reason: str = ""
    why: str = ""


REASONS = ("padding", "replicated by tensor parallelism", "tensor dim not divisible by N",
           "tensor dim padded", "KV heads replicated", "moved by XLA")


def _why(leaf: LeafPlan, route: str, t: int | None, kv: bool, tp: int) -> tuple[str, str]:
    """(reason, words) for a leaf above its floor."""
    s, n = leaf.shard_dim, leaf.data_size
    if route == "gather" and tp == 1:
        return "padding", f"dim {s} padded {leaf.shape[s]} -> {leaf.padded_size}; it travels"
    if route == "all_to_all" and kv:
        return "KV heads replicated", (f"KV heads replicated for tp={tp}: each device needs "
                                       f"1/{leaf.shape[t]} of the leaf, more than 1/tp")
    if route == "all_to_all":
        return "tensor dim not divisible by N", (
            f"tensor dim {t} ({leaf.shape[t]}) not divisible by N={n}: the partition cuts dim "
            f"{s}, each chunk only 1/tp inside its slice")
    if route == "gather" and t is None:
        return "replicated by tensor parallelism", "every device needs all of it"
    return "tensor dim padded", (f"tensor dim {t} padded {leaf.shape[t]} -> "
                                 f"{leaf.padded_size}: chunks straddle the tensor slices")


def reshard_account(plan: ShardingPlan, layout: TensorParallelLayout,
                    dtype: Any = None) -> list[LeafTraffic]:
    """Every leaf's route and bytes received per device (the convention of
    `zeroxla.comm_report`: an all-gather's received bytes are its output's (g-1)/g, an
    all-to-all's its operand's), against the floor W / tp (1 - tp / N). `dtype`: the
    inference copy's (`reshard_function`'s), whose bytes travel; None: the stored master's."""
    tp, tensor = layout.tp, layout.axes.tensor
    devices = layout.data_size * tp
    specs, kv_dims = dict(layout.specs), dict(layout.kv_dims)
    rows = []
    for leaf in plan.leaves:
        itemsize = jnp.dtype(leaf.master_dtype if dtype is None else dtype).itemsize
        t = _tensor_dim(specs[leaf.path], tensor)
        route = plan_route(leaf, t, kv_dims.get(leaf.path), devices)
        floor = itemsize * leaf.numel / tp * (1 - tp / devices)
        padded = itemsize * math.prod(leaf.padded_shape)
        repeat = layout.kv_repeat if leaf.path in kv_dims else 1
        received = {"slice": padded / tp * (1 - tp / devices),
                    "all_to_all": padded * repeat / tp * (1 - 1 / devices),
                    "gather": padded * (1 - 1 / devices)}.get(route)
        if route == "local" and not leaf.master_partitioned:
            received = 0.0      # replicated in storage: already on every device
        if received is None:
            why = ("moved by XLA", "not split over all devices, or stored as codes")
        elif received <= floor * (1 + 1e-9):       # at or under the floor
            why = ("", "")
        else:
            why = _why(leaf, route, t, leaf.path in kv_dims, tp)
        rows.append(LeafTraffic(leaf.path, route, received, floor, *why))
    return rows


def _inference_spec(spec: P, training: MeshAxes, layout: TensorParallelLayout, path: str) -> P:
    """A training storage spec (over the mesh `training` names) -> the same chunks on the
    tensor-major inference mesh: the training data axes (("node", "local"), and "sequence"
    when the mesh has one: for parameters the sequence devices are data devices, ZeRO's
    partition runs over them in the mesh's order) become (tensor, "node", "local") (chunk
    t dp + l on position (l, t), `layout.inference_mesh`). ValueError naming the parameter for
    any other mesh axis of size > 1 (the engine only builds a tensor-major mesh when the data
    axes hold every device)."""
    data = training.data
    entries = []
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        axes = tuple(axis for axis in axes if training.size(axis) > 1 or axis in data)
        if axes and set(axes) - set(data):
            raise ValueError(f"HybridEngine: parameter {path!r} is stored split over mesh axes "
                             f"{axes}; accepted: a training mesh whose parameters are split "
                             f"over the data axes {data} only (no pipeline stages or tensor "
                             "axis in training)")
        tensor = (layout.axes.tensor,) if layout.axes.tensor else ()
        entries.append((*tensor, *layout.axes.data) if axes else None)
    return P(*entries)


def check_storage(shardings: dict[str, Any], layout: TensorParallelLayout) -> None:
    """ValueError naming the first parameter whose stored sharding (`shardings`: {path: a
    `NamedSharding`, or a pytree of them for codes}, a step's `state_shardings.params`) the
    engine cannot read onto `layout`'s mesh (`_inference_spec`): the refusal `storage_view`
    would give at the first generation, given when the engine is built."""
    if not layout.tensor_major:
        return
    for path, stored in shardings.items():
        for sharding in jax.tree.leaves(stored):
            _inference_spec(sharding.spec, MeshAxes.of(sharding.mesh), layout, path)


def storage_view(params: dict[str, Any], layout: TensorParallelLayout) -> dict[str, Any]:
    """`state.params` relabelled onto the inference mesh's device order: the same buffers on
    the same devices (no copy), each leaf's chunks read as `_inference_spec` says; the reshard
    program's argument (one program's arguments and results share one device order).
    Abstract leaves (`jax.ShapeDtypeStruct`) give abstract leaves. `params` as they are when
    the inference mesh is in the training order (`layout.tensor_major` False)."""
    mesh = layout.mesh
    if not layout.tensor_major:
        return params

    def view(path: str, x: Any) -> Any:
        spec = _inference_spec(x.sharding.spec, MeshAxes.of(x.sharding.mesh), layout, path)
        sharding = jax.sharding.NamedSharding(mesh, spec)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return relabel(x, sharding)

    return {path: jax.tree.map(lambda x, p=path: view(p, x), stored)
            for path, stored in params.items()}


def relabel(array: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`array` as an array of `sharding`, which must give every device the slice it holds
    already (the same device set in another order): its device buffers, no copy."""
    return jax.make_array_from_single_device_arrays(
        array.shape, sharding, [shard.data for shard in array.addressable_shards])


def reshard_function(plan: ShardingPlan, layout: TensorParallelLayout, dtype: Any = jnp.float32
                     ) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """`params` (a TrainState's storage seen through `storage_view`) -> {path: array of `dtype`
    (float32, or bfloat16 for a 16-bit rollout) in the layout}; jit it. Each partition is cast
    to `dtype` where it lies, before it travels: a 16-bit copy moves half the float32 bytes."""
    axes = layout.axes
    tp, dp, tensor, data = layout.tp, layout.data_size, axes.tensor, axes.data
    # storage chunk t dp + l on position (l, t) (tensor-major; else l tp + t)
    everything = data if not tensor else (tensor, *data) if layout.tensor_major else (*data,
                                                                                      tensor)
    specs, kv_dims = dict(layout.specs), dict(layout.kv_dims)
    routes = {leaf.path: plan_route(leaf, _tensor_dim(specs[leaf.path], tensor),
                                    kv_dims.get(leaf.path), dp * tp) for leaf in plan.leaves}
    moved = [leaf for leaf in plan.leaves if routes[leaf.path] != "local"]
    if moved and not layout.tensor_major:
        raise ValueError(f"reshard_function: {moved[0].path!r} is split over all {dp * tp} "
                         "devices but the layout's inference mesh is in the training order "
                         "(tensor_major=False); accepted: tensor_parallel_layout(..., "
                         "tensor_major=True) for storage split over the data axes alone")

    def storage_spec(leaf: LeafPlan) -> P:
        entries: list[Any] = [None] * len(leaf.shape)
        entries[leaf.shard_dim] = everything
        return P(*entries)

    def repeat_kv(leaf: LeafPlan, x: jax.Array) -> jax.Array:
        if leaf.path not in kv_dims:
            return x
        return jnp.repeat(x, layout.kv_repeat, axis=kv_dims[leaf.path])

    def local(chunks: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for leaf in moved:
            x, s = chunks[leaf.path], leaf.shard_dim      # x: [.., s / N, ..], chunk t dp + l
            t = _tensor_dim(specs[leaf.path], tensor)
            route = routes[leaf.path]
            if route == "slice":                          # the floor: [.., s / tp, ..]
                out[leaf.path] = lax.all_gather(x, data, axis=s, tiled=True)
            elif route == "all_to_all":
                x = repeat_kv(leaf, x)                                    # [.., s/N, .., T, ..]
                x = lax.all_to_all(x, tensor, split_axis=t, concat_axis=s, tiled=True)
                x = lax.all_gather(x, data, axis=s, tiled=True)           # [.., s, .., T/tp, ..]
                out[leaf.path] = leaf.data_unpad(_reorder(x, s, dp, tp))
            else:
                x = repeat_kv(leaf, leaf.data_unpad(
                    lax.all_gather(x, everything, axis=s, tiled=True)))   # the whole leaf
                out[leaf.path] = x if t is None else _slice(x, t, tp, tensor)
        return out

    def on_wire(chunks: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """`local` of the chunks cast to `dtype` where they lie; a 16-bit dtype moved as its
        raw bits on CPU, whose XLA widens 16-bit float collectives to float32
        (`collectives.wire`): the bytes on the wire are the 16-bit copy's everywhere."""
        chunks = {path: x.astype(dtype) for path, x in chunks.items()}
        if not is_16bit_float(dtype):
            return local(chunks)

        def as_bits(chunks: dict[str, jax.Array]) -> dict[str, jax.Array]:
            out = local({path: lax.bitcast_convert_type(x, jnp.uint16)
                         for path, x in chunks.items()})
            return {path: lax.bitcast_convert_type(x, dtype) for path, x in out.items()}
        return lax.platform_dependent(chunks, cpu=as_bits, default=local)

    gather = jax.shard_map(on_wire, mesh=layout.mesh, check_vma=False,
                           in_specs=({leaf.path: storage_spec(leaf) for leaf in moved},),
                           out_specs={leaf.path: specs[leaf.path] for leaf in moved})

    def master(leaf: LeafPlan, stored: Any) -> jax.Array:
        return stored.master if leaf.has_compute_copy else stored

    def reshard(params: dict[str, Any]) -> dict[str, jax.Array]:
        out = gather({leaf.path: master(leaf, params[leaf.path]) for leaf in moved})
        for leaf in plan.leaves:
            if routes[leaf.path] == "local":              # XLA slices it where it lies
                out[leaf.path] = repeat_kv(leaf, storage_to_logical(leaf, params[leaf.path]))
        return {path: out[path].astype(dtype) for path in plan.paths}

    return reshard


__all__ = ["LeafTraffic", "REASONS", "ROUTES", "check_storage", "plan_route", "reshard_account",
           "relabel", "reshard_function", "storage_view"]
