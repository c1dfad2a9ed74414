"""The switch after an optimizer step that changed only the trainable leaves (LoRA adapters
under `only_optimize_lora`, `zeroxla.lora`): reshard those alone, keep the frozen base's
tensor-parallel copy (verl's and Tunix's LoRA-only weight sync).

The frozen leaves are never written by a ZeRO step, but a state is only arrays: a restored
checkpoint or another run's state may hold another base under the same plan. So the first
switch keeps a device copy of the frozen leaves' stored partitions (each device its own: the
base's bytes / N, as stored, int8/int4 codes included), and each later switch compares the
state's frozen storage with it bit for bit (`unchanged`: local compares, then one all-reduced
bool). Equal: only the trainable leaves are resharded (`trainable_reshard`); else the full
reshard runs and the copy is taken again. Cost: that copy's memory while parameters are pinned,
and one read of it per switch; no base bytes cross devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.inference.layout import TensorParallelLayout
from zeroxla.inference.reshard import reshard_function
from zeroxla.sharding.plan import ShardingPlan


def frozen_paths(plan: ShardingPlan) -> tuple[str, ...]:
    """The leaves no optimizer step writes; empty when every leaf trains (then there is no
    adapter-only switch: a step changes everything)."""
    if not plan.trainable_leaves:
        return ()
    return tuple(leaf.path for leaf in plan.leaves if not leaf.trainable)


@jax.jit
def keep(stored: dict[str, Any]) -> dict[str, Any]:
    """A device copy of stored leaves (codes and steps included), on the same devices."""
    return jax.tree.map(jnp.copy, stored)


def _bits(x: jax.Array) -> jax.Array:
    """`x` as unsigned integers of its width: equal bit patterns, not equal values (-0.0 vs
    0.0, NaN)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


@jax.jit
def unchanged(kept: dict[str, Any], stored: dict[str, Any]) -> jax.Array:
    """Whether `stored` is `kept` bit for bit (a bool scalar)."""
    same = [jnp.all(_bits(a) == _bits(b)) for a, b in zip(jax.tree.leaves(kept),
                                                        jax.tree.leaves(stored))]
    return jnp.all(jnp.stack(same)) if same else jnp.bool_(True)


def trainable_reshard(plan: ShardingPlan, layout: TensorParallelLayout,
                      dtype: Any = jnp.float32
                      ) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """The reshard program (`reshard.reshard_function`, jitted, to `dtype`) of the trainable
    leaves alone: takes and returns only those paths."""
    sub = dataclasses.replace(plan, leaves=plan.trainable_leaves)
    shardings = layout.param_shardings()
    return jax.jit(reshard_function(sub, layout, dtype),
                   out_shardings={path: shardings[path] for path in sub.paths})


__all__ = ["frozen_paths", "keep", "trainable_reshard", "unchanged"]
