"""A ZeRO group of one device partitions nothing: on a 1 x 1 mesh stage 3 is stage 0's program
(no per-layer gather, release or barrier) and trains like it, and under expert parallelism
taking every device, the expert leaves (their expert-data group is one device) stay whole.

Counted like `tests/zeroxla/collectives/test_wire_backends.py` counts: all-gathers in the
compiled CPU program, optimization barriers in the program lowered for CUDA (XLA:CPU drops
barriers, so only the CUDA program shows the backward re-gather's ordering)."""

import jax
import numpy as np
import optax

import zeroxla
from zeroxla import models
from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.plan import make_plan
from reference import token_batches, train_single_device
from runs import run_steps

THRESHOLD = 500          # gpt-tiny's matrices and embeddings are above it: partitioned on 2+


def _step(stage, mesh):
    return zeroxla.make_step(models.build("gpt-tiny", num_layers=2, seed=1), mesh,
                             optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=stage,
                                                       persistence_threshold=THRESHOLD))


def test_stage3_on_one_device_gathers_nothing_and_trains_like_stage0():
    mesh = zeroxla.make_mesh(1, 1, devices=jax.devices()[:1])
    batches = token_batches(3, 4, 16, vocab=65)
    step = _step(3, mesh)
    assert not [leaf.path for leaf in step.layout.plan.leaves
                if leaf.params_partitioned or leaf.optimizer_partitioned]
    state = step.init()
    compiled = step.trace(state, batches[0]).lower().compile().as_text()
    cuda = lower_for_cuda(step, state, batches[0]).as_text()
    assert compiled.count("all-gather") == 0
    assert cuda.count("stablehlo.all_gather") == 0
    assert cuda.count("stablehlo.optimization_barrier") == 0
    _, got = run_steps(step, state, batches)
    plain = _step(0, mesh)
    _, stage0 = run_steps(plain, plain.init(), batches)
    expected, _ = train_single_device(models.build("gpt-tiny", num_layers=2, seed=1),
                                      optax.sgd(0.1), batches)
    np.testing.assert_allclose(got, stage0, rtol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_expert_leaves_of_a_one_device_expert_data_group_stay_whole():
    """Expert parallelism over all 8 devices: each expert leaf's ZeRO group is one device, so
    it is stored whole (its E / 8 experts) and never gathered; the dense leaves are partitioned
    over the 8 as ever. The table says why."""
    model_def, _ = ModelDef.of(models.build("qwen3-moe-tiny"))
    plan = make_plan(model_def.shape_dict(), model_def.axes_dict(), stage=3,
                     axes=MeshAxes(("node", "local", "expert"), (1, 1, 8)),
                     persistence_threshold=0)
    experts = [leaf for leaf in plan.leaves if leaf.expert_split]
    dense = [leaf for leaf in plan.leaves if not leaf.expert_split and leaf.shape]
    assert experts and dense
    for leaf in experts:
        assert leaf.data_size == 1 and leaf.persistent, leaf.path
        assert not leaf.params_partitioned and not leaf.optimizer_partitioned, leaf.path
        assert leaf.compute_kind() == "used in place"
        assert "one device" in leaf.storage_kind(), leaf.storage_kind()
    assert all(leaf.params_partitioned and leaf.data_size == 8 for leaf in dense)
