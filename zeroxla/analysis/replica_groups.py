"""Replica groups: which devices each collective of an HLO program runs among.

XLA prints `replica_groups=` in three forms (jax 0.10 and 0.12; each is checked in
tests/zeroxla/analysis/test_hlo.py):
- `shard_map` collectives print explicit groups, `replica_groups={{0,1,2,3},{4,5,6,7}}`.
- Collectives that the SPMD partitioner inserts print the mesh-axes form. jax 0.10's XLA names
  a mesh of its own and says where each of its devices sits,
  `replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_1':(2)2}`;
  jax 0.12's names the program's own mesh axes, here with no `device_ids` (devices in order),
  `replica_groups=mesh['node'=2,'local'=4] {'local':(2)2}`. One parser reads both.
- The iota form `replica_groups=[2,4]<=[4,2]T(1,0)` is what XLA's parser and older printers use.
`parse_replica_groups` expands any of them to id lists. What the ids mean depends on XLA's
`CollectiveOpGroupMode` (`group_mode`); `flattened_groups` / `flattened_pairs` turn them into
flattened ids `replica * num_partitions + partition`. A jitted SPMD program has one replica, so
those are partition ids, i.e. positions in `mesh.devices.flat` (not `Device.id`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from zeroxla.analysis.hlo_text import HloParseError, split_top, take_group


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Expands a `replica_groups=` value, in any of XLA's three printed forms, to id lists.

    - explicit: `{{0,1},{2,3}}` (`{}` means one group of everyone and returns `()`);
    - iota: `[2,4]<=[4,2]T(1,0)` = `arange(8).reshape(4,2).transpose(1,0).reshape(2,4)`;
    - mesh axes: `mesh['x'=2,'y'=4] {'y'}`, optionally with `device_ids=(...)` and sub-axes
      `'y':(2)2` (Shardy's notation: the 2 devices of `y` after a major part of size 2).
    """
    text = text.strip()
    if text.startswith("mesh["):
        return _mesh_axes_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("{"):
        inner = text[1:-1].strip()
        return tuple(tuple(int(i) for i in re.findall(r"-?\d+", group))
                     for group in re.findall(r"\{([^{}]*)\}", inner))
    raise HloParseError(f"unrecognised replica_groups {text!r}")


def iota_array(dims: Sequence[int], reshape_dims: Sequence[int],
               transpose_perm: Sequence[int] | None = None) -> np.ndarray:
    """XLA's iota tile assignment `[dims]<=[reshape_dims]T(perm)` as an integer array."""
    count = math.prod(reshape_dims)
    if math.prod(dims) != count:
        raise HloParseError(f"iota [{dims}]<=[{reshape_dims}]: sizes differ")
    perm = tuple(range(len(reshape_dims))) if transpose_perm is None else tuple(transpose_perm)
    return np.arange(count).reshape(reshape_dims).transpose(perm).reshape(dims)


_IOTA = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")


def _ints(text: str | None) -> list[int] | None:
    return None if text is None else [int(i) for i in text.split(",") if i.strip()]


def _iota_groups(text: str) -> tuple[tuple[int, ...], ...]:
    match = _IOTA.match(text.replace(" ", ""))
    if match is None:
        raise HloParseError(f"unrecognised iota replica_groups {text!r}")
    dims, reshape, perm = (_ints(group) for group in match.groups())
    if len(dims) != 2:
        raise HloParseError(f"iota replica_groups {text!r} must be [groups,group_size]<=...")
    return tuple(tuple(int(i) for i in row) for row in iota_array(dims, reshape, perm))


def _mesh_axes_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Port of XLA's `MeshAxesReplicaGroupList::flattened_replica_groups`."""
    axes_text, rest = take_group(text, text.index("["))
    names, sizes = [], []
    for axis in filter(None, map(str.strip, axes_text.split(","))):
        name, _, size = axis.rpartition("=")
        names.append(name.strip("'\""))
        sizes.append(int(size))
    rest = rest.strip()
    devices = np.arange(math.prod(sizes)).reshape(sizes)
    if rest.startswith(","):
        ids_at = rest.index("(")
        ids_text, rest = take_group(rest, ids_at)
        devices = _mesh_device_ids(ids_text, sizes)
    refs_text, _ = take_group(rest.strip(), 0)
    refs = []
    for ref in filter(None, map(str.strip, split_top(refs_text))):
        match = re.match(r"^['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?$", ref)
        if match is None or match.group(1) not in names:
            raise HloParseError(f"unrecognised mesh axis {ref!r} in replica_groups {text!r}")
        pre, size = match.group(2), match.group(3)
        refs.append((names.index(match.group(1)), None if pre is None else int(pre),
                     None if size is None else int(size)))
    return _group_mesh(devices, refs)


def _mesh_device_ids(text: str, sizes: Sequence[int]) -> np.ndarray:
    """`device_ids=(...)` of a mesh: an iota `[2,2,2]T(1,0,2)` or an explicit id list."""
    text = text.replace(" ", "")
    if text.startswith("["):
        match = re.match(r"^(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?$", text)
        if match is None:
            raise HloParseError(f"unrecognised mesh device_ids ({text})")
        return iota_array(sizes, _ints(match.group(1)), _ints(match.group(2)))
    return np.asarray(_ints(text)).reshape(sizes)


def _group_mesh(devices: np.ndarray, refs: list[tuple[int, int | None, int | None]]
                ) -> tuple[tuple[int, ...], ...]:
    """Groups of `devices` that vary along the mesh (sub-)axes `refs`, in `refs` order.

    Each mesh axis with sub-axes is split into [pre, size, rest] pieces (major to minor); the
    array is transposed so the grouped pieces come last and cut into rows.
    """
    sizes = devices.shape
    split: dict[int, list[int]] = {}
    grouped_piece: dict[int, int] = {}
    for axis in sorted({axis for axis, _, _ in refs}):
        on_axis = [i for i, ref in enumerate(refs) if ref[0] == axis]
        if len(on_axis) == 1 and refs[on_axis[0]][1] is None:
            split[axis], grouped_piece[on_axis[0]] = [sizes[axis]], 0
            continue
        if any(refs[i][1] is None for i in on_axis):
            raise HloParseError(f"mesh axis {axis} is used both whole and as sub-axes")
        pieces, covered = [], 1
        for i in sorted(on_axis, key=lambda i: refs[i][1]):
            pre, size = refs[i][1], refs[i][2]
            if pre != covered:
                pieces.append(pre // covered)
                covered = pre
            grouped_piece[i] = len(pieces)
            pieces.append(size)
            covered *= size
        if covered != sizes[axis]:
            pieces.append(sizes[axis] // covered)
        split[axis] = pieces
    reshaped, offsets = [], []
    for axis, size in enumerate(sizes):
        offsets.append(len(reshaped))
        reshaped.extend(split.get(axis, [size]))
    grouped = [offsets[refs[i][0]] + grouped_piece[i] for i in range(len(refs))]
    perm = [d for d in range(len(reshaped)) if d not in grouped] + grouped
    group_size = math.prod(reshaped[d] for d in grouped)
    rows = devices.reshape(reshaped).transpose(perm).reshape(-1, group_size)
    return tuple(tuple(int(i) for i in row) for row in rows)


def group_mode(kind: str, channel_id: int | None, use_global_device_ids: bool) -> str:
    """XLA's `CollectiveOpGroupMode`: what the ids in replica_groups are."""
    if kind in ("all-to-all", "collective-permute"):
        return "cross_partition" if channel_id is not None else "cross_replica"
    if channel_id is None:
        return "cross_replica"
    return "flattened_id" if use_global_device_ids else "cross_replica_and_partition"


def flattened_groups(groups: tuple[tuple[int, ...], ...], mode: str, replicas: int,
                   partitions: int) -> tuple[tuple[int, ...], ...]:
    """`groups` in flattened ids `replica * partitions + partition`, per XLA's group modes."""
    every = {"flattened_id": replicas * partitions, "cross_partition": partitions}
    base = groups or (tuple(range(every.get(mode, replicas))),)
    if mode == "flattened_id":
        return base
    if mode == "cross_partition":
        return tuple(tuple(r * partitions + p for p in group)
                     for r in range(replicas) for group in base)
    if mode == "cross_replica":
        return tuple(tuple(r * partitions + p for r in group)
                     for p in range(partitions) for group in base)
    return tuple(tuple(r * partitions + p for r in group for p in range(partitions))
                 for group in base)


def flattened_pairs(pairs: tuple[tuple[int, int], ...], mode: str, replicas: int,
                  partitions: int) -> tuple[tuple[int, int], ...]:
    """collective-permute `pairs` in flattened ids, per XLA's group modes."""
    if mode == "cross_partition":
        return tuple((r * partitions + s, r * partitions + t)
                     for r in range(replicas) for s, t in pairs)
    return tuple((s * partitions + p, t * partitions + p)
                 for p in range(partitions) for s, t in pairs)
