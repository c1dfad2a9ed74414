"""Logical axis rules: which mesh axis role each named tensor dim maps to.

Models name their dims (`Param(..., logical_axes=("embed", "mlp"))`) and know nothing of meshes.
A rules table, in the spirit of MaxText's `logical_axis_rules`, maps each logical name to a mesh
axis *role* (`"stage"`, `"data"`, `"tensor"`, or None for "not sharded"); the plan applies a
table to every parameter to get a `PartitionSpec`. `"*"` matches any name, including a dim with
no name. The first rule whose name matches a dim decides that dim's role.

Four tables ship:

* `ZERO_STORAGE_RULES`: how parameters (and optimizer state) are *stored* under ZeRO: any dim
  but the layer dim of a stacked `LayerStack` parameter may carry the data-parallel partition
  (the layer scan gathers one layer at a time).
* `PIPELINE_STORAGE_RULES`: the same, with the layer dim split over the pipeline stages (each
  stage stores its own layers).
* `TRAINING_COMPUTE_RULES`: how a parameter is laid out when a layer *computes* in training:
  whole (gathered) on every device.
* `TENSOR_PARALLEL_RULES`: the compute layout of tensor-parallel generation (Megatron): attention
  heads and the MLP's inner dim split column-parallel in and row-parallel out, the vocabulary
  split too.

How a role becomes a spec entry (`AxisRules.spec`):
* "data": exactly one dim carries the data axes ("node", "local"): the first data-role dim (in
  the parameter's own dim order, so a shard is contiguous when it can be) whose size the data
  size divides, a dim named in the table's `data_first` before any other; if none divides, the
  data-role dim that needs the least zero padding. Padding is part of the storage layout and
  never reaches the model or the optimizer. `ZERO_STORAGE_RULES` puts the dims tensor-parallel
  generation splits (`TENSOR_PARALLEL_NAMES`) first: each device's ZeRO partition then lies
  inside the tensor-parallel slice it will hold for every tp dividing N, so the Hybrid Engine's
  reshard receives only the rest of that slice (`zeroxla.inference.reshard`). Training
  computes the same numbers as with the parameter's own dim order: the choice is among dims N
  divides, so padding, stored bytes and collective bytes are the same and losses bitwise
  equal; its one cost is that a column-parallel weight's shard (`W[D, H/N, K]`, `W[D, F/N]`)
  is strided in the unit, not contiguous, so XLA may copy a gathered layer (compiled
  temporaries of the CPU step against the dim-order choice: +0.08% on llama-small, +0% on
  gpt-small).
* "stage", "tensor": the first dim with that role whose size the axis size divides; a dim it
  does not divide stays unsharded (`AxisRules.spec` reports it, and callers that need the split,
  e.g. tensor-parallel generation, refuse it by name).
* "expert": a Mixture-of-Experts leaf's expert dim (`experts`) on a mesh with an "expert" axis:
  split over it like "stage" (the plan refuses an expert degree that does not divide the
  experts), and the leaf's data partition then lies over the other data axes only (its
  expert-data group, `MeshAxes.expert_data`). On a mesh without an expert axis the dim is a
  "data" dim like any other, so an unsplit model's layout is what it always was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from jax.sharding import PartitionSpec as P

from zeroxla.sharding.mesh import MeshAxes

ROLES = ("stage", "expert", "data", "tensor")
ANY = "*"


@dataclasses.dataclass(frozen=True)
class DimAssignment:
    """What a rules table gives one parameter: its PartitionSpec over the (padded) shape, the
    dim carrying the data axes (None: none) and the padded size of that dim."""

    spec: P
    data_dim: int | None
    padded_shape: tuple[int, ...]
    unsplit: tuple[tuple[int, str], ...] = ()      # (dim, role) a role could not split
    data_axes: tuple[str, ...] = ()                # the axes `data_dim` is split over
    expert_dim: int | None = None                  # the dim split over the expert axis


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """An ordered table of (logical axis name or "*", role or None)."""

    name: str
    rules: tuple[tuple[str, str | None], ...]
    # Logical names whose dims take the data axes first among the dims N divides.
    data_first: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for logical, role in self.rules:
            if role is not None and role not in ROLES:
                raise ValueError(f"AxisRules {self.name!r}: role {role!r} of {logical!r} is "
                                 f"invalid; accepted: {', '.join(ROLES)} or None")

    def role_of(self, logical: str | None) -> str | None:
        """The role of a dim named `logical` (None: unnamed): the first matching rule's."""
        for name, role in self.rules:
            if name == ANY or name == logical:
                return role
        return None

    def data_dims(self, logical_axes: Sequence[str | None] | None, ndim: int) -> tuple[int, ...]:
        """The dims whose role is "data" (unnamed dims match "*")."""
        names = tuple(logical_axes) if logical_axes else (None,) * ndim
        return tuple(d for d, n in enumerate(names) if self.role_of(n) == "data")

    def spec(self, shape: Sequence[int], logical_axes: Sequence[str | None] | None,
             axes: MeshAxes, *, partition_data: bool = True,
             data_dims: Collection[int] | None = None) -> DimAssignment:
        """The layout of a parameter of `shape` named `logical_axes` on a mesh with `axes`.

        `partition_data=False` leaves out the data role (a replicated parameter: below the
        persistence threshold, or a ZeRO stage that does not partition it). `data_dims`, if
        given, are the only data-role dims that may carry the data axes (frozen int8/int4 codes:
        dims whose shard boundaries never cut a quantization group, `zeroxla.sharding.plan`).
        """
        names = tuple(logical_axes) if logical_axes else (None,) * len(shape)
        roles = [self.role_of(n) for n in names]
        if axes.expert is None:        # no expert axis: an expert dim is a data dim
            roles = ["data" if r == "expert" else r for r in roles]
        entries: list[object] = [None] * len(shape)
        padded = list(shape)
        unsplit = []
        for role, axis in (("stage", axes.stage), ("expert", axes.expert),
                           ("tensor", axes.tensor)):
            dims = [d for d, r in enumerate(roles) if r == role]
            if axis is None or not dims:
                continue
            size = axes.size(axis)
            fitting = [d for d in dims if shape[d] % size == 0 and entries[d] is None]
            if fitting:
                entries[fitting[0]] = axis
            else:
                unsplit.append((dims[0], role))
        expert_dim = next((d for d, e in enumerate(entries)
                           if e is not None and e == axes.expert), None)
        data_axes = axes.data if expert_dim is None else axes.expert_data
        n = axes.data_size // (1 if expert_dim is None else axes.expert_size)
        data_dim = None
        candidates = [d for d, r in enumerate(roles) if r == "data" and entries[d] is None
                      and (data_dims is None or d in data_dims)]
        if partition_data and candidates:
            dividing = [d for d in candidates if shape[d] % n == 0]
            first = [d for d in dividing if names[d] in self.data_first]
            if dividing:
                data_dim = (first or dividing)[0]
            else:   # least padding relative to the dim; the earlier dim on ties
                data_dim = min(candidates, key=lambda d: (-(-shape[d] // n) * n - shape[d])
                               / shape[d])
            padded[data_dim] = -(-shape[data_dim] // n) * n
            entries[data_dim] = data_axes
        return DimAssignment(P(*entries), data_dim, tuple(padded), tuple(unsplit), data_axes,
                             expert_dim)

    def describe(self) -> str:
        """'layers -> stage, * -> data'."""
        return ", ".join(f"{name} -> {role or 'unsharded'}" for name, role in self.rules)


# The dims Megatron tensor parallelism splits (`TENSOR_PARALLEL_RULES`' "tensor" names).
TENSOR_PARALLEL_NAMES = ("heads", "kv_heads", "mlp", "vocab")
ZERO_STORAGE_RULES = AxisRules("zero storage",
                               (("layers", None), ("experts", "expert"), (ANY, "data")),
                               data_first=TENSOR_PARALLEL_NAMES)
PIPELINE_STORAGE_RULES = AxisRules("pipeline storage", (("layers", "stage"), (ANY, "data")))
TRAINING_COMPUTE_RULES = AxisRules("training compute", (("experts", "expert"), (ANY, None)))
TENSOR_PARALLEL_RULES = AxisRules("tensor-parallel compute", (
    ("layers", None), *((name, "tensor") for name in TENSOR_PARALLEL_NAMES), (ANY, None)))
