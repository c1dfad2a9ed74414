"""The device mesh and the role of each of its axes.

A zeroxla mesh has up to four axes, outermost first:

    stage   pipeline stages (1F1B / GPipe); omitted when there is one stage
    node    data parallel across hosts: the slow network (hpZ and qgZ keep traffic off it)
    local   data parallel inside a host: the fast links
    tensor  tensor parallel (Megatron column/row splits); omitted when there is one

ZeRO partitions parameters, gradients and optimizer state over the data axes `("node",
"local")`, whatever else the mesh has; every collective takes its axis names from `MeshAxes`,
never from constants of its own. Axes of size 1 may be present or absent: `MeshAxes` answers the
same either way.

Device order: the devices of one host (one `jax.process_index()`) are contiguous, so with one
process per host each `local` (x `tensor`) row is one host and `node` crosses hosts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

STAGE_AXIS = "stage"
NODE_AXIS = "node"
LOCAL_AXIS = "local"
TENSOR_AXIS = "tensor"
AXIS_ORDER = (STAGE_AXIS, NODE_AXIS, LOCAL_AXIS, TENSOR_AXIS)
DATA_AXES = (NODE_AXIS, LOCAL_AXIS)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The roles of a mesh's axes and their sizes (1 for an axis the mesh does not have)."""

    names: tuple[str, ...]          # the mesh's axis names, in mesh order
    sizes: tuple[int, ...]          # their sizes

    @classmethod
    def of(cls, mesh: Mesh) -> "MeshAxes":
        """The roles of `mesh`'s axes; ValueError unless they are a subset of AXIS_ORDER, in that
        order, including "node" and "local" (build such a mesh with `make_mesh`)."""
        names = tuple(mesh.axis_names)
        known = [n for n in AXIS_ORDER if n in names]
        if (set(names) - set(AXIS_ORDER) or list(names) != known
                or not set(DATA_AXES) <= set(names)):
            raise ValueError(
                f"mesh axes {names} are not supported; zeroxla needs the axes "
                f"('node', 'local'), optionally with 'stage' first and 'tensor' last, in the "
                f"order {AXIS_ORDER} (build it with zeroxla.make_mesh(nodes, local, stages=, "
                "tensor=))")
        return cls(names, tuple(int(mesh.shape[n]) for n in names))

    def size(self, axis: str) -> int:
        """The size of `axis` (1 when the mesh has no such axis)."""
        return dict(zip(self.names, self.sizes)).get(axis, 1)

    def present(self, axis: str) -> str | None:
        """`axis` if the mesh has it, else None (for PartitionSpec entries)."""
        return axis if axis in self.names else None

    @property
    def data(self) -> tuple[str, ...]:
        """The data-parallel axes ZeRO partitions over: ("node", "local")."""
        return DATA_AXES

    @property
    def node(self) -> str:
        return NODE_AXIS

    @property
    def local(self) -> str:
        return LOCAL_AXIS

    @property
    def stage(self) -> str | None:
        return self.present(STAGE_AXIS)

    @property
    def tensor(self) -> str | None:
        return self.present(TENSOR_AXIS)

    @property
    def data_size(self) -> int:
        """Devices in one data-parallel group: the ZeRO partition count N."""
        return self.size(NODE_AXIS) * self.size(LOCAL_AXIS)

    @property
    def num_stages(self) -> int:
        return self.size(STAGE_AXIS)

    @property
    def tensor_size(self) -> int:
        return self.size(TENSOR_AXIS)

    @property
    def local_size(self) -> int:
        return self.size(LOCAL_AXIS)

    @property
    def node_size(self) -> int:
        return self.size(NODE_AXIS)

    def describe(self) -> str:
        """'stage 2 x node 1 x local 4' (size-1 stage/tensor axes left out)."""
        return " x ".join(f"{n} {s}" for n, s in zip(self.names, self.sizes)
                          if s > 1 or n in DATA_AXES)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_factor(name: str, value: object, count: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or count % value:
        raise ValueError(f"make_mesh: {name}={value!r} does not divide the {count} devices; "
                         f"use one of {_divisors(count)}")


def make_mesh(nodes: int = 1, local: int | None = None, *, stages: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of shape `[stages, nodes, local, tensor]` with Auto axis types.

    The axes are ("node", "local"), with "stage" in front when `stages > 1` and "tensor" at the
    end when `tensor > 1`. `local` defaults to the devices left per node. Devices are ordered by
    (process index, id), so the `local` x `tensor` devices of one node are one host's when each
    host runs one process. Raises a ValueError naming the argument when the sizes do not match
    the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    for name, value in (("stages", stages), ("tensor", tensor), ("nodes", nodes)):
        _check_factor(name, value, count)
    if count % (stages * tensor * nodes):
        raise ValueError(f"make_mesh: stages={stages} x nodes={nodes} x tensor={tensor} = "
                         f"{stages * nodes * tensor} does not divide the {count} devices")
    if local is None:
        local = count // (stages * nodes * tensor)
    if (not isinstance(local, int) or isinstance(local, bool) or local < 1
            or stages * nodes * local * tensor != count):
        product = stages * nodes * tensor * local if isinstance(local, int) else "?"
        factors = " x ".join(f"{name}={value!r}" for name, value in (
            ("stages", stages), ("nodes", nodes), ("local", local), ("tensor", tensor))
            if name in ("nodes", "local") or value != 1)
        raise ValueError(f"make_mesh: {factors} = {product} devices, but {count} are "
                         f"available; use local={count // (stages * nodes * tensor)} (or pass "
                         "devices=)")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    shape = {STAGE_AXIS: stages, NODE_AXIS: nodes, LOCAL_AXIS: local, TENSOR_AXIS: tensor}
    names = tuple(n for n in AXIS_ORDER if n in DATA_AXES or shape[n] > 1)
    grid = np.asarray(ordered, dtype=object).reshape([shape[n] for n in names])
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def data_size(mesh: Mesh) -> int:
    """Number of data-parallel devices (the ZeRO partition count)."""
    return MeshAxes.of(mesh).data_size


def check_mesh(mesh: Mesh) -> MeshAxes:
    """The mesh's `MeshAxes`; ValueError for a mesh zeroxla cannot run on."""
    return MeshAxes.of(mesh)


def host_groups(mesh: Mesh) -> list[set[int]]:
    """The process indices in each node of the mesh (one set per (stage, node) index, over its
    `local` x `tensor` devices). A mesh whose nodes are hosts has one process in each set."""
    axes = MeshAxes.of(mesh)
    grid = np.asarray(mesh.devices)
    inner = [axes.names.index(n) for n in (LOCAL_AXIS, TENSOR_AXIS) if n in axes.names]
    outer = [i for i in range(grid.ndim) if i not in inner]
    rows = np.transpose(grid, outer + inner).reshape(-1, math.prod(grid.shape[i] for i in inner))
    return [{d.process_index for d in row} for row in rows]
