"""Per-device memory: measured from a live state and the compiled step, or predicted beforehand.

`memory_report(step.compile(state, batch), state, layout=step.layout)` reads the bytes each
device actually holds (the addressable shards of every state leaf) and XLA's own accounting of the
compiled step (`compiled.memory_analysis()`).
`estimate_memory` predicts the model-state bytes from the ZeRO paper's formula (§5.1: stage 1
divides the optimizer state by N, stage 2 also the gradients, stage 3 also the parameters)
before anything is allocated, counting parameters under the persistence threshold as replicated.
Frozen parameters (`make_step(..., trainable=)`) have no gradient or optimizer state; with
`quantized_nontrainable_weights` their partitions are stored as codes plus float32 scales.
With ZeRO-Offload (`ZeroConfig.offload_optimizer="cpu"`, `offload_param="cpu"`) both count what is
held in host memory apart from device memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from zeroxla import models
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.layout_argument import layout_argument
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.plan import plan_for
from zeroxla.engine.step import frozen_paths

MASTER_BYTES = 4          # float32 master weights (`LeafPlan.param_bytes_per_device`)
GRAD_BYTES = 4            # float32 gradients after reduction
ADAM_STATE_BYTES = 8      # two float32 moments per parameter


def _in_host_memory(leaf: Any) -> bool:
    """Held in a host memory kind (`pinned_host`, `unpinned_host`: ZeRO-Offload)."""
    return getattr(leaf.sharding, "memory_kind", None) not in (None, "device")


def _device_bytes(tree: Any, host: bool = False) -> dict[Any, int]:
    """Bytes of `tree`'s shards for each device, in device memory (or, with `host`, in the host
    memory kinds attached to that device)."""
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if _in_host_memory(leaf) != host:
            continue
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def argument_bytes_by_memory_kind(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled program's arguments by memory kind ("device",
    "pinned_host", "unpinned_host"), from the compiled program's own input shardings (XLA's
    `memory_analysis` on the CPU backend counts host-kind arguments as device bytes; on GPU its
    `host_argument_size_in_bytes` agrees with this)."""
    totals: dict[str, int] = {}
    infos = jax.tree.leaves(compiled.args_info)
    shardings = jax.tree.leaves(compiled.input_shardings)
    for info, sharding in zip(infos, shardings, strict=True):
        shape = sharding.shard_shape(info.shape)
        kind = sharding.memory_kind or "device"
        totals[kind] = totals.get(kind, 0) + math.prod(shape) * jnp.dtype(info.dtype).itemsize
    return totals


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes (the maximum over devices for the state parts). `params` and
    `optimizer` are in device memory; `host_params` and `host_optimizer` are what ZeRO-Offload
    keeps in host memory for each device (`ZeroConfig.offload_optimizer`, `offload_param`)."""

    params: int
    optimizer: int
    gradients: int          # transient: the reduced gradient buffer, from the plan
    secondary_partition: int  # hpZ: 1/local of every gathered layer, held forward -> backward
    loss_scale: int
    temporaries: int        # XLA's temp buffers of the compiled step
    arguments: int
    outputs: int
    aliased: int            # donated state buffers reused for the outputs
    host_params: int = 0    # float32 masters (offload_param: parameter partitions) in host memory
    host_optimizer: int = 0  # optimizer state in host memory

    @property
    def host_state(self) -> int:
        """Bytes held in host memory for each device between steps (ZeRO-Offload)."""
        return self.host_params + self.host_optimizer

    @property
    def training_state(self) -> int:
        """Bytes a device holds between steps: parameters + optimizer state (+ loss scale)."""
        return self.params + self.optimizer + self.loss_scale

    @property
    def peak_estimate(self) -> int:
        """XLA's bound for the step: live arguments + temporaries + non-aliased outputs."""
        return self.arguments + self.temporaries + self.outputs - self.aliased

    def to_dict(self) -> dict[str, int]:
        out = dataclasses.asdict(self)
        out.update(training_state=self.training_state, peak_estimate=self.peak_estimate,
                   host_state=self.host_state)
        return out

    def table(self) -> str:
        rows = [("parameters", self.params), ("optimizer state", self.optimizer),
                ("gradients (transient)", self.gradients),
                ("hpZ secondary partition", self.secondary_partition),
                ("training state", self.training_state),
                *([("host state (offload)", self.host_state)] if self.host_state else []),
                ("step temporaries (XLA)", self.temporaries), ("step peak (XLA)", self.peak_estimate)]
        return "\n".join(f"{name:<24}{value / 2**20:>10.3f} MiB" for name, value in rows)


def memory_report(compiled: Any, state: Any, *, layout: ZeroLayout) -> MemoryReport:
    """Measures per-device memory of `state` and of `compiled` (a `jax.stages.Compiled`, the
    step's: `step.compile(state, batch)`), whose gradients and hpZ copy are counted from
    `layout` (`step.layout`)."""
    if not callable(getattr(compiled, "memory_analysis", None)):
        raise TypeError(f"memory_report: compiled is a {type(compiled).__name__}; accepted: a "
                        "jax.stages.Compiled (step.compile(state, batch))")
    layout = layout_argument(layout, "memory_report(..., layout=step)",   # a ZeroStep warns
                             "memory_report(..., layout=step.layout)")
    if not isinstance(layout, ZeroLayout):
        raise TypeError(f"memory_report: layout is a {type(layout).__name__}; accepted: the "
                        "ZeroLayout of the step (step.layout)")

    def worst(tree, host=False):
        per_device = _device_bytes(tree, host)
        return max(per_device.values()) if per_device else 0
    analysis = compiled.memory_analysis()
    return MemoryReport(
        params=worst(state.params), optimizer=worst(state.opt_state),
        gradients=_gradient_bytes(layout), secondary_partition=_secondary_bytes(layout),
        loss_scale=worst(state.loss_scale),
        temporaries=int(analysis.temp_size_in_bytes),
        arguments=int(analysis.argument_size_in_bytes),
        outputs=int(analysis.output_size_in_bytes),
        aliased=int(analysis.alias_size_in_bytes),
        host_params=worst(state.params, host=True),
        host_optimizer=worst(state.opt_state, host=True))


def _gradient_bytes(layout: ZeroLayout) -> int:
    """Per-device float32 gradients: a partition each from stage 2 on, else whole leaves."""
    config = layout.config
    return sum(GRAD_BYTES * leaf.local_layers * (
        leaf.chunk if leaf.optimizer_partitioned and config.stage >= 2 else leaf.unit_numel)
        for leaf in layout.plan.trainable_leaves)   # local_layers: a pipeline stage's own


def _secondary_bytes(layout: ZeroLayout) -> int:
    """Per-device hpZ secondary partition (ZeRO++ §3.2): the compute-dtype copy of every
    partitioned parameter, split over `hpz_partition_size` devices; 0 without hpZ."""
    config = layout.config
    if config.hpz_partition_size <= 1:
        return 0
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    return sum(itemsize * leaf.layers * leaf.padded_numel // config.hpz_partition_size
               for leaf in layout.plan.leaves if leaf.params_partitioned)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Predicted per-device bytes: `params`, `gradients` and `optimizer` in device memory;
    `host_params` (separate float32 masters; with `offload_param`, the parameter partitions)
    and `host_optimizer` in host memory, for each device, under ZeRO-Offload."""
    params: int
    gradients: int
    optimizer: int
    host_params: int = 0
    host_optimizer: int = 0

    @property
    def training_state(self) -> int:
        """Device bytes between steps: parameters + optimizer state."""
        return self.params + self.optimizer

    @property
    def host_state(self) -> int:
        return self.host_params + self.host_optimizer

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "training_state": self.training_state,
                "host_state": self.host_state}


def estimate_memory(model_config: Any, mesh: Mesh, config: ZeroConfig, *,
                    optimizer_bytes_per_param: int = ADAM_STATE_BYTES,
                    trainable: Any = None) -> MemoryEstimate:
    """Predicted per-device bytes of float32 master parameters, gradients and optimizer state.

    `model_config` is a models config (GPTConfig, LlamaConfig) or an (abstract) nnx.Module;
    nothing is allocated. Ψ partitioned parameters cost Ψ/N each, persistent ones Ψ.
    `trainable` is `make_step`'s nnx filter (None: all). With `offload_optimizer="cpu"` the
    optimizer state, and a float32 master kept apart from its 16-bit copy (stages 1-2 under
    bf16/fp16), are counted in host memory (`zeroxla.engine.offload`); with `offload_param="cpu"`
    every partitioned leaf's partition is too.
    """
    model = (model_config if isinstance(model_config, nnx.Module)
             else models.abstract_model(model_config))
    model_def, _ = ModelDef.of(model)
    plan = plan_for(model_def, config, MeshAxes.of(mesh), frozen=frozen_paths(model, trainable))
    offload = config.offload_optimizer != "none"
    params = gradients = optimizer = host_params = 0
    for leaf in plan.leaves:
        share = leaf.chunk * leaf.layers            # this device's partition (padding included)
        if config.offload_param != "none" and leaf.params_partitioned:
            host_params += leaf.param_bytes_per_device          # all of it
        elif offload and leaf.trainable and leaf.has_compute_copy:
            master = jnp.dtype(leaf.master_dtype).itemsize * share   # on the host
            params += leaf.param_bytes_per_device - master
            host_params += master
        else:
            params += leaf.param_bytes_per_device
        if not leaf.trainable:
            continue
        optimizer += optimizer_bytes_per_param * (share if leaf.optimizer_partitioned
                                                  else leaf.numel)
        gradients += GRAD_BYTES * (share if leaf.optimizer_partitioned and config.stage >= 2
                                   else leaf.numel)
    if offload:
        return MemoryEstimate(params=params, gradients=gradients, optimizer=0,
                              host_params=host_params, host_optimizer=optimizer)
    return MemoryEstimate(params=params, gradients=gradients, optimizer=optimizer,
                          host_params=host_params)
