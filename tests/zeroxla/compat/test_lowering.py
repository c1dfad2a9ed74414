"""`lower_for_cuda` on this GPU-less machine: a Pallas kernel lowers to its Triton call, and a
sharded program lowers exactly as `lower(lowering_platforms=("cuda",))` lowers it without the
abstract device (which the Pallas-free program never needed)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.sharding.mesh import LOCAL_AXIS, NODE_AXIS, make_mesh

pytest.importorskip("jax._src.lib.triton", reason="jaxlib without Triton bindings")


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def test_a_pallas_kernel_lowers_to_a_triton_call():
    fn = jax.jit(lambda x: pl.pallas_call(      # Triton's parameters choose the Triton backend
        _double_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plt.CompilerParams(num_warps=4))(x))
    text = lower_for_cuda(fn, jax.ShapeDtypeStruct((16,), jnp.float32)).as_text()
    assert re.findall(r"custom_call @(\S+)\(", text) == ["__gpu$xla.gpu.triton"]


def test_a_sharded_program_keeps_its_mesh_and_shardings(devices):
    mesh = make_mesh(2, 4)
    fn = jax.jit(lambda a: (a * 2).sum(0),
                 in_shardings=NamedSharding(mesh, P(LOCAL_AXIS, NODE_AXIS)),
                 out_shardings=NamedSharding(mesh, P(NODE_AXIS)))
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    plain = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "mhlo.num_partitions = 8" in plain
    assert lower_for_cuda(fn, x).as_text() == plain
