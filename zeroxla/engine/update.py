"""Between storage and the optimizer: each leaf's layouts around the optax update.

The step's update runs on global arrays outside the `shard_map` (`zeroxla.engine.step`). For
every trainable leaf it needs three conversions, all pure functions of the leaf's plan:

* `logical_gradient`: the reduced gradient leaving the gradient pass (padded partition, or
  replicated) -> the logical gradient the optimizer sees, laid out like the optimizer state;
* `optimizer_input`: the stored parameter -> the logical parameter on the optimizer's layout
  (a leaf stored with a 16-bit copy gives its float32 master partition, never the copy);
* `stored_update`: the optimizer's new logical parameter -> storage: partitioned leaves stay
  this device's partition; replicated ones are all-gathered once, as DeepSpeed's all-gather
  after the optimizer step (in 16 bits into a `MasterWithCopy`'s compute copy, the float32
  partition kept exactly).

Padding (data padding and, pipelined, the stage slots) is cut off before the optimizer or a norm
sees a parameter, and put back, as zero, after the update.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroxla.collectives.wire import all_gather_dim
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.stored_forms import MasterWithCopy
from zeroxla.sharding.mesh import MeshAxes


def constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def gradient_padded(leaf: LeafPlan, stage: int) -> bool:
    """Whether the reduced gradient is a padded, partitioned array (stage 3's partitioned
    leaves; every optimizer-partitioned leaf at stage 2)."""
    return leaf.params_partitioned or (stage == 2 and leaf.optimizer_partitioned)


def gradient_spec(leaf: LeafPlan, stage: int) -> P:
    """Layout of a trainable leaf's reduced gradient leaving the gradient pass."""
    if gradient_padded(leaf, stage):
        return leaf.optimizer_spec       # stage 3's partitioned leaves: their param layout
    return leaf.gradient_spec            # replicated (split over the stages if stage_split)


def logical_gradient(leaf: LeafPlan, g: jax.Array, stage: int, mesh: Mesh) -> jax.Array:
    """The reduced gradient `g` (layout `gradient_spec`) -> the logical gradient, on the
    optimizer state's layout (a replicated gradient of a partitioned optimizer state is cut to
    this device's part)."""
    if gradient_padded(leaf, stage):
        return leaf.unpad(g)
    if leaf.optimizer_partitioned:
        return leaf.unpad(constrain(leaf.data_pad(g), mesh, leaf.optimizer_spec))
    return leaf.stage_unpad(g)           # the identity unless pipelined (stage slots)


def optimizer_input(leaf: LeafPlan, stored: object, mesh: Mesh) -> jax.Array:
    """The stored parameter -> the logical parameter the optimizer updates."""
    if not leaf.optimizer_partitioned:
        return leaf.stage_unpad(stored)  # the identity unless pipelined (stage slots)
    padded = (stored.master if leaf.has_compute_copy else stored if leaf.params_partitioned
              else leaf.data_pad(stored))
    return leaf.unpad(constrain(padded, mesh, leaf.optimizer_spec))


def with_rounding(new: jax.Array, dtype, token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(new, new.astype(dtype))`, the rounding read from the same array the master is
    stored from.

    Computed plainly, XLA may evaluate the update's last elementwise ops twice, once into the
    stored master and once into the cast (a cheap producer duplicated into two fusions, here
    in two layouts), and XLA:CPU's code generator may contract one evaluation into a fused
    multiply-add and not the other: the two float32 results then differ in the last bit, and
    where that straddles a 16-bit tie the copy is the other neighbour of the master's rounding
    (gpt-tiny fp16, stage 1: 7 of 65,760 elements per step), so a restored run (copy rebuilt
    from the master) would not compute what the uninterrupted one did. Passing both through one
    `lax.cond` makes `new` one materialized array that both are read from. Its predicate is
    `token >= 0` of a replicated scalar XLA cannot know (the step counter: no communication);
    both branches are the same."""
    def both(x):
        return x, x.astype(dtype)
    return lax.cond(token >= 0, both, both, new)


def stored_update(leaf: LeafPlan, new: jax.Array, mesh: Mesh, axes: MeshAxes,
                  token: jax.Array) -> object:
    """The optimizer's new logical parameter -> its storage layout (`token`: see
    `with_rounding`)."""
    if not leaf.optimizer_partitioned:
        return leaf.stage_pad(new)
    new = constrain(leaf.pad(new), mesh, leaf.optimizer_spec)
    if leaf.has_compute_copy:
        # The float32 partition is kept exactly; its 16-bit rounding is gathered (stage 3's
        # partitioned copy is this device's rounding alone: nothing to gather).
        new, copy = with_rounding(new, leaf.compute_copy_dtype, token)
        return MasterWithCopy(master=new, compute=copy if leaf.params_partitioned
                              else all_gather_update(copy, leaf, mesh, axes))
    if not leaf.params_partitioned:
        return all_gather_update(new, leaf, mesh, axes)
    return new


def all_gather_update(padded: jax.Array, leaf: LeafPlan, mesh: Mesh,
                      axes: MeshAxes) -> jax.Array:
    """Stage 1-2 (and stage 3's persistent leaves): the updated partitions all-gathered into
    the replicated parameter, as DeepSpeed's one all-gather after the optimizer step (in
    float32, or in 16 bits into a leaf's compute copy: `padded` is then already cast).
    Explicit, in its own `shard_map`, so it is one tiled all-gather over the data axes (and
    `comm_report` attributes it to the update)."""
    gather = jax.shard_map(
        lambda x: all_gather_dim(x, leaf.data_axes, leaf.shard_dim), mesh=mesh,
        in_specs=leaf.optimizer_spec, out_specs=leaf.compute_input_spec, check_vma=False)
    return leaf.data_unpad(gather(padded))   # param_spec: P(), or split over the stages
