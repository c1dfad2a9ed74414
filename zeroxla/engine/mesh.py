"""The device mesh: `("node", "local")`, the two-level hierarchy that ZeRO++ needs.

All data-parallel work (batch sharding, ZeRO partitioning) runs over both axes together
(`DATA_AXES`); hpZ and qgZ use the split: `local` devices share a node's fast links, `node`
crosses the slow network.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

NODE_AXIS = "node"
LOCAL_AXIS = "local"
DATA_AXES = (NODE_AXIS, LOCAL_AXIS)


def make_mesh(nodes: int = 1, local: int | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `Mesh` of shape `[nodes, local]` with axes `("node", "local")` and Auto axis types.

    `local` defaults to the devices per node (all devices divided by `nodes`). Raises a ValueError
    naming the argument when the shape does not match the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if not isinstance(nodes, int) or nodes < 1 or count % nodes:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(f"make_mesh: nodes={nodes!r} does not divide the {count} devices; "
                         f"use one of {divisors}")
    if local is None:
        local = count // nodes
    if not isinstance(local, int) or local < 1 or nodes * local != count:
        raise ValueError(f"make_mesh: nodes={nodes} x local={local!r} = "
                         f"{nodes * local if isinstance(local, int) else '?'} devices, but "
                         f"{count} are available; use local={count // nodes} (or pass devices=)")
    grid = np.asarray(devices, dtype=object).reshape(nodes, local)
    return Mesh(grid, DATA_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def data_size(mesh: Mesh) -> int:
    """Number of data-parallel devices (the ZeRO partition count)."""
    return int(np.prod([mesh.shape[a] for a in DATA_AXES]))


def check_mesh(mesh: Mesh) -> None:
    """Raises a ValueError unless `mesh` has exactly the axes `("node", "local")`."""
    if tuple(mesh.axis_names) != DATA_AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are not supported; zeroxla needs "
                         f"{DATA_AXES} (build it with zeroxla.make_mesh(nodes, local))")
