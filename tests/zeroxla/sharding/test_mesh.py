"""`make_mesh`: the axes and their roles (ZeRO runs over the data axes "node" and "local",
whatever else the mesh has; one host's devices are contiguous), and meshes that cannot be made
are refused naming the sizes that can. No program is built."""

import numpy as np
import pytest

import zeroxla
from zeroxla.sharding.mesh import MeshAxes

MESHES = {
    "stages2_local4": dict(stages=2, nodes=1, local=4),
    "tensor2_nodes2_local2": dict(tensor=2, nodes=2, local=2),
}


@pytest.mark.parametrize("name,expected_axes", [
    ("stages2_local4", {"stage": 2, "node": 1, "local": 4}),
    ("tensor2_nodes2_local2", {"node": 2, "local": 2, "tensor": 2}),
])
def test_make_mesh_axes_and_roles(name, expected_axes):
    mesh = zeroxla.make_mesh(**MESHES[name])
    assert dict(mesh.shape) == expected_axes
    axes = MeshAxes.of(mesh)
    assert axes.data == ("node", "local") and axes.data_size == 4
    # one host's devices (process index, then id) are contiguous along local x tensor
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1)
    assert list(ids) == sorted(ids)


@pytest.mark.parametrize("nodes,local,message", [
    (3, None, r"nodes=3 does not divide the 8 devices; use one of \[1, 2, 4, 8\]"),
    (2, 3, r"nodes=2 x local=3 = 6 devices, but 8 are available; use local=4"),
])
def test_mesh_that_does_not_match_devices(nodes, local, message):
    with pytest.raises(ValueError, match=message):
        zeroxla.make_mesh(nodes, local)


