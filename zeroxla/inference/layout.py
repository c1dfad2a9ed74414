"""The tensor-parallel inference layout, derived from logical axis names alone.

The inference mesh is the training mesh's devices regrouped as `(node=1, local=D/tp,
tensor=tp)`, tensor-major (`inference_mesh`: position (l, t) is training device t D/tp + l, so
each device's ZeRO partition lies in the tensor slice it will hold): each `tensor` row is one
tensor-parallel group; the `local` axis serves different prompts data-parallel. Every parameter's spec comes from `TENSOR_PARALLEL_RULES` (heads,
kv_heads, mlp, vocab -> tensor; Megatron column-parallel in, row-parallel out), so a model with
logical axes needs no code here.

Grouped-query attention with more tensor devices than KV heads (tp > G, tp a multiple of G):
the KV heads are replicated tp / G times, as vLLM does, so each device holds the one KV head its
query heads read (query head h reads KV head floor(h G / H) before and floor(h tp / H) after:
the same weights). The KV cache follows (`KV_CACHE_AXES`: batch over the data axes, kv_heads
over `tensor`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zeroxla.sharding.mesh import LOCAL_AXIS, NODE_AXIS, TENSOR_AXIS, MeshAxes
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.rules import TENSOR_PARALLEL_RULES
from zeroxla.models import axes as logical
from zeroxla.models.layers import KV_CACHE_AXES


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """Where every inference parameter and the KV cache live on the inference mesh."""

    mesh: Mesh
    axes: MeshAxes
    specs: tuple[tuple[str, P], ...]            # (path, spec over the inference shape)
    shapes: tuple[tuple[str, tuple[int, ...]], ...]   # (path, inference shape)
    kv_repeat: int                              # KV heads replicated this many times
    kv_dims: tuple[tuple[str, int], ...]        # (path, its kv_heads dim)
    # `inference_mesh`'s order: position (l, t) is training device t dp + l (True), or
    # l tp + t, the training order itself (False: storage not split over the data axes alone)
    tensor_major: bool = True

    @property
    def tp(self) -> int:
        return self.axes.tensor_size

    @property
    def data_size(self) -> int:
        """Tensor-parallel groups: how many prompt shards run side by side."""
        return self.axes.data_size

    def param_shardings(self) -> dict[str, NamedSharding]:
        return {path: NamedSharding(self.mesh, spec) for path, spec in self.specs}

    def cache_spec(self, kv_heads: int) -> P:
        """The KV cache's spec ([L, B, S, G, K], dims named `KV_CACHE_AXES`): batch over the
        data axes, KV heads over `tensor` when it divides them."""
        tensor = self.axes.tensor if kv_heads % self.tp == 0 else None
        named = {logical.BATCH: self.axes.data, logical.KV_HEADS: tensor}
        return P(*(named.get(name) for name in KV_CACHE_AXES))

    def entry_spec(self, names: Sequence[str | None], shape: Sequence[int]) -> P:
        """A decode-cache entry's spec from its dims' logical names (a recurrent model's state,
        `checks.cache_axes`): batch over the data axes, heads and KV heads over `tensor` where
        it divides them, every other dim whole."""
        def axis(name: str | None, size: int):
            if name == logical.BATCH:
                return self.axes.data
            split = name in (logical.HEADS, logical.KV_HEADS) and size % self.tp == 0
            return self.axes.tensor if split else None
        return P(*(axis(name, size) for name, size in zip(names, shape)))

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Rows over the data axes: [B, ...]."""
        return NamedSharding(self.mesh, P(self.axes.data, *([None] * (ndim - 1))))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def describe(self) -> str:
        """One line per parameter: path, inference shape, spec."""
        shapes = dict(self.shapes)
        lines = [f"inference mesh {self.axes.describe()}"
                 + (", tensor-major (position (l, t) = training device t dp + l)"
                    if self.tensor_major and self.tp > 1 else "")
                 + (f"; KV heads replicated x{self.kv_repeat}" if self.kv_repeat > 1 else "")]
        lines += [f"  {path:<28} {str(shapes[path]):<18} {spec}" for path, spec in self.specs]
        return "\n".join(lines)


def tp_fits(tp: int, devices: int | None, heads: Sequence[int], kv_heads: Sequence[int]) -> bool:
    """Whether `tp`-way tensor parallelism fits: `tp` divides the device count (None: any
    count) and every attention-heads size, and divides every KV-heads size or is a multiple of
    it (the KV heads are then replicated)."""
    return ((devices is None or devices % tp == 0) and all(h % tp == 0 for h in heads)
            and all(g % tp == 0 or tp % g == 0 for g in kv_heads))


def accepted_tp_sizes(devices: int | None, heads: Sequence[int],
                      kv_heads: Sequence[int]) -> list[int]:
    """Every tensor-parallel size that fits (`tp_fits`), for error messages: the divisors of
    the device count, or of the heads when the count is not fixed (None)."""
    bound = devices if devices is not None else math.gcd(*heads) if heads else 1
    return [t for t in _divisors(bound) if tp_fits(t, devices, heads, kv_heads)]


def inference_mesh(devices: Sequence[jax.Device], tp: int, tensor_major: bool = True) -> Mesh:
    """`(node=1, local=D/tp, tensor=tp)` over `devices` (the training mesh's, in its flat
    order: device d holds ZeRO storage chunk d), tensor-major: mesh position (l, t) is device
    t D/tp + l. Device (l, t) then holds chunk t D/tp + l, which lies in tensor slice t of a
    dim split into D chunks, so its `local` row of D/tp devices holds exactly slice t between
    them and the reshard is one all-gather over `local` (`zeroxla.inference.reshard`).

    The price: a tensor group is strided over the training order (devices l, l + D/tp, ...),
    so with D/tp < the devices of a node it crosses nodes, as verl's 3D-HybridEngine's
    generation groups do for the same reason; `make_mesh`'s order (l tp + t) would keep it
    within a node but hold the wrong chunk on every device but one per group; it is the order
    with `tensor_major=False` (for storage split over a pipeline or tensor axis too, which the
    reshard leaves to XLA)."""
    count = len(devices)
    grid = np.asarray(devices, dtype=object)
    grid = grid.reshape(tp, count // tp).T if tensor_major else grid.reshape(count // tp, tp)
    if tp == 1:
        return Mesh(grid.reshape(1, count), (NODE_AXIS, LOCAL_AXIS),
                    axis_types=(AxisType.Auto,) * 2)
    return Mesh(grid.reshape(1, count // tp, tp), (NODE_AXIS, LOCAL_AXIS, TENSOR_AXIS),
                axis_types=(AxisType.Auto,) * 3)


def tensor_parallel_layout(model_def: ModelDef, devices: Sequence[jax.Device], tp: int,
                           tensor_major: bool = True) -> TensorParallelLayout:
    """The layout of `model_def`'s parameters for `tp`-way tensor parallelism over `devices`
    (the training mesh's, flat), on `inference_mesh(devices, tp, tensor_major)`.

    ValueError naming `HybridEngineConfig.inference_tp_size` and the accepted sizes when `tp`
    does not divide the devices, a `heads` dim, or a `kv_heads` dim (nor is a multiple of it).
    """
    count = len(devices)
    heads = sorted({shape[i] for shape, names in zip(model_def.shapes, model_def.logical_axes)
                    for i, name in enumerate(names or ()) if name == logical.HEADS})
    kv = sorted({shape[i] for shape, names in zip(model_def.shapes, model_def.logical_axes)
                 for i, name in enumerate(names or ()) if name == logical.KV_HEADS})

    def fits(t: int) -> bool:
        return tp_fits(t, count, heads, kv)

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or not fits(tp):
        what = f"the {count} devices" if count % tp else (
            f"the {', '.join(map(str, heads))} attention heads" if any(h % tp for h in heads)
            else f"the {', '.join(map(str, kv))} KV heads (nor is a multiple of them)")
        raise ValueError(f"HybridEngineConfig.inference_tp_size={tp} does not divide {what}; "
                         f"accepted: {', '.join(map(str, accepted_tp_sizes(count, heads, kv)))}")
    repeats = {tp // g for g in kv if g % tp}
    if len(repeats) > 1:
        raise ValueError(f"kv_heads dims of sizes {kv} need different replication for "
                         f"inference_tp_size={tp}; accepted: a tp dividing all of them")
    kv_repeat = repeats.pop() if repeats else 1
    mesh = inference_mesh(devices, tp, tensor_major)
    axes = MeshAxes.of(mesh)
    specs, shapes, kv_dims = [], [], []
    for path, shape, names in zip(model_def.paths, model_def.shapes, model_def.logical_axes):
        shape = list(shape)
        for i, name in enumerate(names or ()):
            if name == logical.KV_HEADS and kv_repeat > 1:
                shape[i] *= kv_repeat
                kv_dims.append((path, i))
        spec = TENSOR_PARALLEL_RULES.spec(shape, names, axes, partition_data=False).spec
        specs.append((path, spec))
        shapes.append((path, tuple(shape)))
    return TensorParallelLayout(mesh, axes, tuple(specs), tuple(shapes), kv_repeat,
                                tuple(kv_dims), tensor_major)


def bytes_per_device(shapes: Sequence[tuple[int, ...]], specs: Sequence[P], axes: MeshAxes,
                     itemsize: int = 4) -> int:
    """Bytes one device holds of arrays of `shapes` laid out by `specs`."""
    total = 0
    for shape, spec in zip(shapes, specs):
        split = 1
        for entry in spec:
            for axis in (entry if isinstance(entry, tuple) else (entry,)):
                split *= axes.size(axis) if axis else 1
        total += math.prod(shape) * itemsize // split
    return total


__all__ = ["TensorParallelLayout", "accepted_tp_sizes", "bytes_per_device",
           "inference_mesh", "tensor_parallel_layout", "tp_fits"]
