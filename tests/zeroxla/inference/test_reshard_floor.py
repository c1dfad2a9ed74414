"""The Hybrid Engine's switch at its byte floor: with every tensor-parallel dim divisible by the
N = 8 devices, each device receives at most W/T (1 - T/N) bytes (W: the model's bytes, counted
here from the model's own parameter shapes and dtypes, not from the plan) to go from ZeRO-3
storage to T-way tensor parallelism, for T = 1, 2, 4, 8 on the 2 x 4 mesh, and generates the
unsharded model's greedy tokens. Storage choosing the tensor-parallel dim costs training
nothing: the same padding and bytes per device as the first dividing dim."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx

import zeroxla
from inference_helpers import MODELS, greedy_reference, prompts_of, train, zero3_step
from zeroxla import comm_report
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.inference.reshard import reshard_account
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.plan import make_plan
from zeroxla.sharding.rules import ZERO_STORAGE_RULES

N = 8
# DeepSpeed's rule (unit numel < threshold persists): the learned positions (16 x 64), biases
# and norms stay replicated and local; every matrix (>= 64 x 64 per layer) is partitioned.
THRESHOLD = 2048


def model_bytes(model):
    """Bytes of the model's parameters (a tied embedding once): from the model, not the plan."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


def test_storage_takes_the_tensor_parallel_dim_at_no_training_cost():
    model_def = zero3_step("gpt-8heads", THRESHOLD).layout.model_def
    axes = MeshAxes.of(zeroxla.make_mesh(2, 4))
    kwargs = dict(stage=3, axes=axes, persistence_threshold=THRESHOLD)
    ours = make_plan(model_def.shape_dict(), model_def.axes_dict(), **kwargs)
    first = make_plan(model_def.shape_dict(), model_def.axes_dict(), **kwargs,
                      storage_rules=dataclasses.replace(ZERO_STORAGE_RULES, data_first=()))
    tensor_names = ("heads", "kv_heads", "mlp", "vocab")
    moved = 0
    for leaf, old in zip(ours.leaves, first.leaves):
        assert (leaf.padding, leaf.param_bytes_per_device, leaf.optimizer_numel_per_device) == \
            (old.padding, old.param_bytes_per_device, old.optimizer_numel_per_device)
        if leaf.params_partitioned:
            assert leaf.logical_axes[leaf.shard_dim] in tensor_names, leaf.path
            moved += leaf.shard_dim != old.shard_dim
    assert moved >= 4                       # wq, wk, wv, w_fc: embed before their split dim


@pytest.mark.slow
def test_reshard_at_the_byte_floor_and_greedy_tokens_unchanged():
    step = zero3_step("gpt-8heads", THRESHOLD)
    state = train(step, 1)
    whole = model_bytes(MODELS["gpt-8heads"]())
    logical = dict(zip(step.layout.model_def.paths,
                       step.layout.model_def.treedef.flatten_up_to(zeroxla.gather_params(state))))
    prompts = prompts_of()
    expected = greedy_reference(state, prompts, 6)
    for tp in (1, 2, 4, 8):
        engine = HybridEngine(step.layout,
                              HybridEngineConfig(inference_tp_size=tp, max_out_tokens=16))
        program = engine.reshard_program(state)
        out = program(engine.reshard_inputs(state))
        for path, value in logical.items():
            np.testing.assert_array_equal(np.asarray(out[path]), np.asarray(value))
        report = comm_report(program, mesh=engine.mesh)
        floor = whole / tp * (1 - tp / N)
        assert report.total_bytes <= floor * 1.01, (tp, report.total_bytes, floor)
        # only all-gathers inside the tensor groups' data rows: no all_to_all, no permute
        assert set(report.bytes_by_kind) <= {"all-gather"}, report.bytes_by_kind
        assert report.total_bytes == sum(row.received for row in
                                         reshard_account(step.layout.plan, engine.layout))
        for want, got in zip(expected, engine.generate(state, prompts, max_new_tokens=6)):
            np.testing.assert_array_equal(got, want)
        engine.release()
