"""A frozen copy of a step's model stored as int8 codes of its partitions (ZeRO++'s MixZ++).

DeepSpeed-Chat stores a frozen model quantized (`zero_quantized_nontrainable_weights`): int8
codes in groups, dequantized just before use. The engine already stores a step's own frozen
leaves that way (`ZeroConfig.quantized_nontrainable_weights`: each device's shard a
`StoredCodes`, its codes all-gathered and dequantized per layer by `collectives.zeropp`).
`FrozenCodesView(step)` is the same step's model seen with every leaf frozen and stored so:

    view = FrozenCodesView(step)                   # its `layout`: stage 3, every leaf frozen,
                                                   # partitioned leaves as int8 codes
    params, model_state = view.codes_of(state)     # a state of `step` -> the view's stored form
    TokenForward(view, fn)(FrozenCopy, batch)      # read per layer, in the view's layout

The view is a step for what reads a step's layout (`TokenForward`, `rlhf.AnswerForward`); it
trains nothing. Its plan is the step's mesh, rules and sequence parallelism at stage 3 with
persistence threshold 0, whatever the step's: every leaf is partitioned, 1/N of it per device
(a frozen copy read once per rollout gains little from keeping small leaves whole, and holding
them whole in float32 is what the codes are for). A leaf with no group of two elements along
its partition (a norm scale) stays a float32 partition. Codes come from the float32 logical
values (the masters), each
shard quantized on its own (`engine.stored`), converted under `jit` with the logical arrays
sharded over the data devices: no device holds the whole model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zeroxla.engine.layout import ModelSource, ZeroLayout, zero_layout
from zeroxla.engine.logical import logical_sharding
from zeroxla.engine.offload import on_device
from zeroxla.engine.stored import logical_to_storage, storage_to_logical

CODE_BITS = 8


def _codes_config(layout: ZeroLayout, owner: str) -> Any:
    """The step's `ZeroConfig` with every leaf partitioned and stored as int8 codes: stage 3,
    persistence threshold 0, the other ZeRO++ options and offloading off (the view is read,
    never updated)."""
    if layout.experts is not None:
        raise ValueError(f"{owner}=True with expert parallelism (the expert axis of "
                         f"{layout.experts.size} devices): stored codes are gathered by the "
                         "ZeRO++ collectives, which do not split experts; accepted: "
                         f"{owner}=False, or a mesh without an expert axis")
    if layout.plan is not layout.model_plan:
        raise ValueError(f"{owner}=True with a pipelined step: the view reads the whole "
                         f"model's plan, a pipeline stores stages; accepted: {owner}=False")
    return dataclasses.replace(
        layout.config, stage=3, persistence_threshold=0, quantized_nontrainable_weights=True,
        weight_quantization_bits=CODE_BITS, quantized_weights=False, quantized_gradients=False,
        hpz_partition_size=1, offload_optimizer="none", offload_param="none",
        offload_pin_memory=False)


class FrozenCodesView:
    """`step`'s model with every leaf frozen, its partitioned leaves stored as int8 codes
    (module docstring): `layout` what `TokenForward` reads, `codes_of(state)` the stored form
    of a state of `step`. `owner` names the option that asked for it in refusals."""

    def __init__(self, step: Any, owner: str = "reference_int8"):
        source = step.layout
        model_def = source.model_def
        frozen = ModelSource(model_def, None, None, None, frozenset(model_def.paths))
        self.source = source
        self.layout = zero_layout(frozen, source.mesh, optimizer=optax.identity(),
                                  config=_codes_config(source, owner), loss_fn=source.loss_fn,
                                  trainable=source.trainable)

    @functools.cached_property
    def _convert(self) -> Any:
        """The jitted {path: stored in the step} -> {path: stored in the view}."""
        view, step_leaves = self.layout, {leaf.path: leaf for leaf in self.source.plan.leaves}

        def convert(params: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for leaf in view.plan.leaves:
                source = step_leaves[leaf.path]
                x = storage_to_logical(source, params[leaf.path])   # float32, logical shape
                x = jax.lax.with_sharding_constraint(x, logical_sharding(
                    view.mesh, x.shape, leaf.stacked, prefer=source.shard_dim))
                out[leaf.path] = logical_to_storage(leaf, x.astype(jnp.float32))
            return out
        return jax.jit(convert, out_shardings=self.layout.state_shardings.params)

    def codes_of(self, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(params in the view's stored form, a copy of the model state) of `state`, a state
        of the step: partitioned leaves int8 codes of each device's shard, the rest float32."""
        params = self._convert(on_device(state.params))
        return params, jax.tree.map(jnp.copy, state.model_state)


__all__ = ["CODE_BITS", "FrozenCodesView"]
