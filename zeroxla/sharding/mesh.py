"""The device mesh and the role of each of its axes.

A zeroxla mesh has up to six axes, outermost first:

    stage     pipeline stages (1F1B / GPipe); omitted when there is one stage
    node      data parallel across hosts: the slow network (hpZ and qgZ keep traffic off it)
    local     data parallel inside a host: the fast links
    expert    expert parallel (DeepSpeed-MoE's `ep_size`): data parallel for every dense
              parameter, and each Mixture-of-Experts layer's experts split over it (E / EP per
              device); omitted when there is one
    sequence  sequence parallel inside a host (DeepSpeed-Ulysses): each sequence split over
              these devices; omitted when there is one
    tensor    tensor parallel (Megatron column/row splits); omitted when there is one

ZeRO partitions parameters, gradients and optimizer state over the data axes, whatever else the
mesh has: `("node", "local")`, then "expert" and "sequence" when the mesh has them (DeepSpeed's
DP x EP x SP group: every device of it computes gradients of its own tokens). An expert leaf
(a dim named `experts`) is split over "expert" and ZeRO-partitioned over the other data axes,
its expert-data group (`MeshAxes.expert_data`), where its gradients are reduced. The batch is
split over `("node", "local")` and "expert" (`MeshAxes.batch`), its sequence dim over
"sequence". Inside a node the
sequence devices count as local devices (`MeshAxes.local` is `("local", "sequence")`), so hpZ
and qgZ's intra-node hops run over them too. Every collective takes its axis names from
`MeshAxes`, never from constants of its own. Axes of size 1 may be present or absent:
`MeshAxes` answers the same either way.

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
EXPERT_AXIS = "expert"
SEQUENCE_AXIS = "sequence"
TENSOR_AXIS = "tensor"
AXIS_ORDER = (STAGE_AXIS, NODE_AXIS, LOCAL_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS)
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
                f"('node', 'local'), optionally with 'stage' first, 'expert', 'sequence' and "
                f"'tensor' after them, in the order {AXIS_ORDER} (build it with "
                "zeroxla.make_mesh(nodes, local, stages=, expert=, sequence=, tensor=))")
        return cls(names, tuple(int(mesh.shape[n]) for n in names))

    def size(self, axis: str) -> int:
        """The size of `axis` (1 when the mesh has no such axis)."""
        return dict(zip(self.names, self.sizes)).get(axis, 1)

    def present(self, axis: str) -> str | None:
        """`axis` if the mesh has it, else None (for PartitionSpec entries)."""
        return axis if axis in self.names else None

    @property
    def data(self) -> tuple[str, ...]:
        """The axes ZeRO partitions over and reduces gradients over: ("node", "local"), then
        "expert" and "sequence" when the mesh has them (DeepSpeed's DP x EP x SP group)."""
        return self.batch + ((SEQUENCE_AXIS,) if SEQUENCE_AXIS in self.names else ())

    @property
    def batch(self) -> tuple[str, ...]:
        """The axes the batch dim is split over (the data replicas): ("node", "local"), and
        "expert" when the mesh has it (expert-parallel devices hold rows of their own)."""
        return DATA_AXES + ((EXPERT_AXIS,) if EXPERT_AXIS in self.names else ())

    @property
    def expert(self) -> str | None:
        """The expert-parallel axis, or None when the mesh has none."""
        return self.present(EXPERT_AXIS)

    @property
    def expert_size(self) -> int:
        """The expert-parallel degree EP (1 without an expert axis)."""
        return self.size(EXPERT_AXIS)

    @property
    def expert_data(self) -> tuple[str, ...]:
        """An expert leaf's ZeRO group: the data axes but "expert" (DeepSpeed's expert-data
        parallel group): where its partition lies and its gradients are reduced."""
        return tuple(a for a in self.data if a != EXPERT_AXIS)

    @property
    def node(self) -> str:
        return NODE_AXIS

    @property
    def local(self) -> str | tuple[str, ...]:
        """The intra-node data axes: "local", or ("local", "expert", "sequence") where the mesh
        has those (their devices are a node's too: hpZ and qgZ's local hops cover them)."""
        inner = tuple(a for a in (LOCAL_AXIS, EXPERT_AXIS, SEQUENCE_AXIS) if a in self.names)
        return inner if len(inner) > 1 else LOCAL_AXIS

    @property
    def sequence(self) -> str | None:
        """The sequence-parallel axis, or None when the mesh has none."""
        return self.present(SEQUENCE_AXIS)

    @property
    def stage(self) -> str | None:
        return self.present(STAGE_AXIS)

    @property
    def tensor(self) -> str | None:
        return self.present(TENSOR_AXIS)

    @property
    def data_size(self) -> int:
        """Devices in one ZeRO group (data x expert x sequence): the partition count N."""
        return self.replicas * self.size(SEQUENCE_AXIS)

    @property
    def replicas(self) -> int:
        """Data replicas: the batch's rows are split over this many devices."""
        return self.size(NODE_AXIS) * self.size(LOCAL_AXIS) * self.size(EXPERT_AXIS)

    @property
    def sequence_size(self) -> int:
        """The sequence-parallel degree P (1 without a sequence axis)."""
        return self.size(SEQUENCE_AXIS)

    @property
    def num_stages(self) -> int:
        return self.size(STAGE_AXIS)

    @property
    def tensor_size(self) -> int:
        return self.size(TENSOR_AXIS)

    @property
    def local_size(self) -> int:
        """Data devices inside one node (local x expert x sequence)."""
        return self.size(LOCAL_AXIS) * self.size(EXPERT_AXIS) * self.size(SEQUENCE_AXIS)

    @property
    def node_size(self) -> int:
        return self.size(NODE_AXIS)

    def describe(self) -> str:
        """'stage 2 x node 1 x local 4' (size-1 stage/expert/sequence/tensor axes left out)."""
        return " x ".join(f"{n} {s}" for n, s in zip(self.names, self.sizes)
                          if s > 1 or n in DATA_AXES)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_factor(name: str, value: object, count: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or count % value:
        raise ValueError(f"make_mesh: {name}={value!r} does not divide the {count} devices; "
                         f"use one of {_divisors(count)}")


def make_mesh(nodes: int = 1, local: int | None = None, *, stages: int = 1, expert: int = 1,
              sequence: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of shape `[stages, nodes, local, expert, sequence, tensor]` with Auto axis types.

    The axes are ("node", "local"), with "stage" in front when `stages > 1`, "expert" after
    "local" when `expert > 1` (expert parallelism: DeepSpeed-MoE's `ep_size`; contiguous
    devices of a node, as DeepSpeed's expert-parallel groups are consecutive ranks), "sequence"
    after them when `sequence > 1` (sequence parallelism: DeepSpeed's `sequence_parallel_size`)
    and "tensor" at the end when `tensor > 1`. `local` defaults to the devices left per node.
    Devices are ordered by (process index, id), so the `local` x `expert` x `sequence` x
    `tensor` devices of one node are one host's when each host runs one process (a sequence
    group's all-to-alls and an expert group's gathers stay on a host's fast links). Raises a
    ValueError naming the argument when the sizes do not match the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    for name, value in (("stages", stages), ("expert", expert), ("sequence", sequence),
                        ("tensor", tensor), ("nodes", nodes)):
        _check_factor(name, value, count)
    fixed = stages * tensor * nodes * expert * sequence
    if count % fixed:
        raise ValueError(f"make_mesh: stages={stages} x nodes={nodes} x expert={expert} x "
                         f"sequence={sequence} x tensor={tensor} = {fixed} does not divide the "
                         f"{count} devices")
    if local is None:
        local = count // fixed
    if (not isinstance(local, int) or isinstance(local, bool) or local < 1
            or fixed * local != count):
        product = fixed * local if isinstance(local, int) else "?"
        factors = " x ".join(f"{name}={value!r}" for name, value in (
            ("stages", stages), ("nodes", nodes), ("local", local), ("expert", expert),
            ("sequence", sequence), ("tensor", tensor)) if name in ("nodes", "local") or value != 1)
        raise ValueError(f"make_mesh: {factors} = {product} devices, but {count} are "
                         f"available; use local={count // fixed} (or pass devices=)")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    shape = {STAGE_AXIS: stages, NODE_AXIS: nodes, LOCAL_AXIS: local, EXPERT_AXIS: expert,
             SEQUENCE_AXIS: sequence, TENSOR_AXIS: tensor}
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
    `local` x `expert` x `sequence` x `tensor` devices). A mesh whose nodes are hosts has one
    process in each set."""
    axes = MeshAxes.of(mesh)
    grid = np.asarray(mesh.devices)
    inner = [axes.names.index(n) for n in (LOCAL_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS)
             if n in axes.names]
    outer = [i for i in range(grid.ndim) if i not in inner]
    rows = np.transpose(grid, outer + inner).reshape(-1, math.prod(grid.shape[i] for i in inner))
    return [{d.process_index for d in row} for row in rows]
