"""A rollout group: the Hybrid Engine on devices of its own, fed by weight syncs.

Asynchronous RL (verl's one-step-off-policy, AReaL, NeMo-RL) splits the devices into a
training group, which runs the ZeRO step, and a rollout group, which generates; the rollouts
run while the training group updates. `RolloutGroup(step.layout, mesh, config)` builds the
Hybrid Engine over `mesh`, a mesh of the training mesh's shape on devices disjoint from it:
the policy's `ZeroLayout` on `mesh` (the same model, ZeRO config and sharding plan, so a
training state's storage fits it shard for shard), which the engine generates from.

`sync(state)` moves the training state's parameters into the group (`state` is only read):

1. one transfer (`jax.device_put`, dispatched asynchronously: it waits on the state's producer
   on the devices, not on the host): every stored array as ONE copy split over the group's
   devices (`transfer_spec`: its own partition when stored partitioned, else its first dim
   the group's devices divide, replicated only when none does), so the bytes that cross
   between the groups are one copy of the weights, the floor (`floor_bytes`; a partitioned
   leaf's padding and a leaf no dim of which divides are above it, and counted);
2. a program within the group lays them out as the training layout stores them (the
   replicated small leaves gathered over the group's own links), which the engine's
   reshard to its tensor-parallel layout reads, as it reads a colocated state.

A frozen leaf moves on the first sync alone. `bytes_moved` is the last sync's transfer: the sum
over its destination arrays of each device's shard bytes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroxla.engine.layout import ModelSource, ZeroLayout, zero_layout
from zeroxla.engine.state import TrainState
from zeroxla.inference.checks import check_state
from zeroxla.inference.config import HybridEngineConfig
from zeroxla.inference.engine import HybridEngine


def transfer_spec(shape: tuple[int, ...], spec: P, data: tuple[str, ...], devices: int) -> P:
    """How a stored array of `shape` (stored with `spec`) crosses to the rollout group: its
    own spec when it splits the array (one copy already), else its first dim `devices`
    divides split over the `data` axes, else replicated (P())."""
    if any(entry is not None for entry in spec):
        return spec
    dim = next((i for i, size in enumerate(shape) if size % devices == 0), None)
    if dim is None:
        return P()
    return P(*([None] * dim), data)


def _shard_bytes(tree: Any) -> int:
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards)


class RolloutGroup:
    """The Hybrid Engine over `mesh` (disjoint from `layout`'s, of its shape) and the synced
    copy of the policy it generates from (see the module docstring). `layout` is the training
    step's `ZeroLayout`; `config` the engine's. ValueError naming the argument for a mesh that
    shares a device with the training mesh or stores the parameters otherwise."""

    def __init__(self, layout: ZeroLayout, mesh: Mesh, config: HybridEngineConfig):
        shared = set(np.asarray(mesh.devices).flat) & set(np.asarray(layout.mesh.devices).flat)
        if shared:
            raise ValueError(f"RolloutGroup: mesh shares {len(shared)} devices with the training "
                             "mesh; accepted: a mesh on devices the training mesh lacks")
        frozen = frozenset(leaf.path for leaf in layout.plan.leaves if not leaf.trainable)
        self.layout = zero_layout(ModelSource(layout.model_def, None, None, None, frozen), mesh,
                                  optimizer=layout.optimizer, config=layout.config,
                                  loss_fn=layout.loss_fn, trainable=layout.trainable)
        if self.layout.plan != layout.plan:
            raise ValueError(f"RolloutGroup: mesh {dict(mesh.shape)} stores the parameters "
                             f"otherwise than the training mesh {dict(layout.mesh.shape)}; "
                             "accepted: a mesh of the training mesh's shape on other devices")
        self.mesh = mesh
        self.engine = HybridEngine(self.layout, config)
        self.state: TrainState | None = None        # the synced copy (no optimizer state)
        self.syncs = 0
        self.bytes_moved = 0                        # the last sync's transfer
        # one copy of the trainable weights, as the master stores them (float32)
        self.floor_bytes = sum(math.prod(leaf.shape) * np.dtype(leaf.master_dtype).itemsize
                               for leaf in layout.plan.trainable_leaves)
        self._trainable = tuple(leaf.path for leaf in layout.plan.trainable_leaves)
        self._place: dict[tuple[str, ...], Any] = {}      # in-group programs per path set

    def _transfer_sharding(self, x: jax.Array) -> NamedSharding:
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        return NamedSharding(self.mesh, transfer_spec(x.shape, spec, self.layout.axes.data,
                                                      self.mesh.devices.size))

    def sync(self, state: TrainState) -> int:
        """Moves `state`'s parameters (all on the first sync, the trainable ones after) and its
        model state into the group; returns the bytes of the transfer (`bytes_moved`)."""
        check_state(state, self.layout.plan, self.layout.model_def)
        paths = tuple(state.params) if self.state is None else self._trainable
        params = {path: state.params[path] for path in paths}
        replicated = NamedSharding(self.mesh, P())
        moved, model_state, step = jax.device_put(
            (params, state.model_state, state.step),
            (jax.tree.map(self._transfer_sharding, params),
             {path: replicated for path in state.model_state}, replicated))
        self.bytes_moved = _shard_bytes(moved)
        if paths not in self._place:
            stored = self.layout.state_shardings.params
            self._place[paths] = jax.jit(lambda tree: tree,
                                         out_shardings={path: stored[path] for path in paths})
        kept = {} if self.state is None else dict(self.state.params)   # frozen: first sync's
        self.state = TrainState(step=step, params={**kept, **self._place[paths](moved)},
                                opt_state=None, loss_scale=None, plan=self.layout.plan,
                                model_def=self.layout.model_def, model_state=model_state)
        self.syncs += 1
        return self.bytes_moved


__all__ = ["RolloutGroup", "transfer_spec"]
