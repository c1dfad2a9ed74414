"""`TrainState`: everything a training step reads and writes, as one pytree of sharded arrays.

Parameters live as a flat `{path: array}` dict in their *storage* layout (see `plan.py`);
the plan and the model's static structure ride along as pytree metadata, so a state alone is
enough to reassemble the full parameters (`gather_params`) or the model (`gathered_model`).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from flax import nnx, struct

from zeroxla.engine.loss_scale import LossScaleState
from zeroxla.engine.offload import on_device
from zeroxla.engine.stored import storage_to_logical
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.plan import ShardingPlan


@struct.dataclass
class TrainState:
    step: jax.Array                       # int32 scalar: steps taken (skipped fp16 steps count)
    # float32 master weights in their storage layout; a frozen leaf stored as codes
    # (quantized_nontrainable_weights) is a `StoredCodes` of its partitions.
    params: dict[str, Any]
    opt_state: Any                        # optax state over the trainable leaves' optimizer view
    loss_scale: LossScaleState | None     # fp16 only
    plan: ShardingPlan = struct.field(pytree_node=False)
    model_def: ModelDef = struct.field(pytree_node=False)
    # The model's non-Param Variables (batch statistics), `{path: array}`, replicated: the
    # forward pass updates them from statistics over the whole global batch.
    model_state: dict[str, Any] = struct.field(default_factory=dict)
    # The run's random seed as uint32[2] key data (`jax.random.key_data`), replicated; None when
    # nothing in the model or loss draws random numbers. Step t, data device d, micro-batch m
    # draw from fold_in(fold_in(fold_in(key, t), d), m) (`zeroxla.engine.randomness`).
    rng: jax.Array | None = None


def _logical_params(state: TrainState) -> dict[str, jax.Array]:
    return {leaf.path: storage_to_logical(leaf, state.params[leaf.path])
            for leaf in state.plan.leaves}


def gather_params(state: TrainState) -> nnx.State:
    """The full (unpadded, logical-shape) float32 parameters as an `nnx.State`, on this
    process's first device (so that evaluating or sampling from them is a one-device program);
    leaves stored as codes come back dequantized."""
    values = jax.jit(_logical_params)(on_device(state))
    return state.model_def.state(jax.device_put(values, jax.local_devices()[0]))


def gathered_model(state: TrainState, *legacy: TrainState) -> nnx.Module:
    """A plain model holding the full parameters of `state` (for evaluation, export,
    generation), on this process's first device.

    The older form `gathered_model(step, state)` still works and warns.
    """
    if legacy:
        warnings.warn("gathered_model(step, state) is deprecated; call gathered_model(state)",
                      DeprecationWarning, stacklevel=2)
        state = legacy[0]
    if not isinstance(state, TrainState):
        raise TypeError(f"gathered_model takes a TrainState, got {type(state).__name__}")
    device = jax.local_devices()[0]
    values = jax.device_put(jax.jit(_logical_params)(on_device(state)), device)
    return state.model_def.module(values, jax.device_put(state.model_state, device))
