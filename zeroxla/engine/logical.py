"""The training state's logical form: the same for every mesh, stage and hpZ setting.

A `TrainState` is stored in its step's layout (parameters padded and split per `LeafPlan`,
frozen leaves possibly int8/int4 codes, param-shaped optimizer leaves padded like their
partition). Its logical form is a flat dict of plain arrays, named

    params/<path>                 every parameter at its logical shape (frozen codes dequantized)
    opt_state/<optax tree path>   every optimizer leaf, param-shaped ones at the logical shape
    step, loss_scale/<field>

which is what checkpoints store, so a checkpoint restores onto any device count or stage with no
offline conversion (DeepSpeed needs `zero_to_fp32` or universal checkpoints for that). Both
conversions run under `jax.jit` with explicit output shardings: the logical arrays stay sharded
over the data devices (`logical_sharding`), so a process only ever holds, writes or reads its
own slices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroxla.engine.loss_scale import init_loss_scale
from zeroxla.engine.offload import resident
from zeroxla.engine.optimizer import ShardedOptimizer
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import MeshAxes
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.engine.state import TrainState
from zeroxla.engine.stored import logical_to_storage, storage_to_logical


class StoredLayout(Protocol):
    """What the logical form reads of a step's layout: a `zeroxla.engine.layout.ZeroLayout`,
    named here by its fields because that module imports this one (`ZeroLayout.logical` keeps
    the result of `build_layout`)."""
    mesh: Mesh
    config: ZeroConfig
    plan: ShardingPlan
    model_def: ModelDef
    sharded_optimizer: ShardedOptimizer
    state_shardings: TrainState
    uses_rng: bool


def logical_sharding(mesh: Mesh, shape: Sequence[int], stacked: bool = False,
                     prefer: int | None = None) -> NamedSharding:
    """How a logical array is sharded while it is converted, saved or restored.

    Over all data devices (else the `local` axis, else the `node` axis) on the first dim the
    device count divides, trying first `prefer` (the parameter's shard dim: converting to and
    from its storage layout then moves nothing), then the other dims largest first, and the
    layer dim of a stacked leaf last (export reads one layer at a time). Replicated when nothing
    divides (small or oddly shaped leaves).
    """
    axes = MeshAxes.of(mesh)
    rest = sorted((d for d in range(len(shape)) if d != prefer and not (stacked and d == 0)),
                  key=lambda d: -shape[d])
    order = ([prefer] if prefer is not None else []) + rest + ([0] if stacked else [])
    local = axes.local if isinstance(axes.local, tuple) else (axes.local,)
    for names in (axes.data, local, (axes.node,)):
        n = math.prod(axes.size(a) for a in names)
        if n == 1:
            break
        for dim in order:
            if dim < len(shape) and shape[dim] % n == 0:
                spec: list[Any] = [None] * len(shape)
                spec[dim] = names if len(names) > 1 else names[0]
                return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unsupported pytree key {key!r}")


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{'opt_state/0/mu/blocks/layers/wq': leaf, ...} in flatten order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


@dataclasses.dataclass(frozen=True)
class LogicalLayout:
    """A layout's logical form (`ZeroLayout.logical`): names, abstract arrays, and the two jitted
    conversions.

    `to_logical(state) -> {name: array}`; `to_storage([arrays in names order]) -> TrainState`.
    `plans[name]` is the `LeafPlan` behind a parameter-shaped entry (None for the others).
    """

    names: tuple[str, ...]                        # flatten order of the logical tree
    abstract: dict[str, jax.ShapeDtypeStruct]     # with `logical_sharding`
    plans: dict[str, LeafPlan | None]
    to_logical: Callable[[TrainState], dict[str, jax.Array]]
    to_storage: Callable[[Sequence[jax.Array]], TrainState]


def abstract_storage_state(layout: StoredLayout) -> TrainState:
    """Shapes, dtypes and shardings of the state stored in `layout` (nothing allocated)."""
    loss_scale = (jax.eval_shape(lambda: init_loss_scale(layout.config))
                  if layout.config.uses_loss_scaling else None)
    return TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params={leaf.path: leaf.param_struct() for leaf in layout.plan.leaves},
        opt_state=layout.sharded_optimizer.abstract_state(), loss_scale=loss_scale,
        plan=layout.plan, model_def=layout.model_def,
        model_state=layout.model_def.abstract_values()[1],
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32) if layout.uses_rng else None)


def build_layout(layout: StoredLayout) -> LogicalLayout:
    """The logical form of the state stored in `layout` (a step's `ZeroLayout`)."""
    plan, optimizer, mesh = layout.plan, layout.sharded_optimizer, layout.mesh
    leaves = {leaf.path: leaf for leaf in plan.leaves}

    def logical_tree(state: TrainState) -> dict[str, Any]:
        state = resident(layout, state)       # offloaded parts: converted on the device
        tree = {"step": state.step,
                "params": {p: storage_to_logical(leaf, state.params[p])
                           for p, leaf in leaves.items()},
                "opt_state": optimizer.to_logical(state.opt_state)}
        if state.loss_scale is not None:
            tree["loss_scale"] = state.loss_scale
        if state.model_state:
            tree["model_state"] = state.model_state
        if state.rng is not None:
            tree["rng"] = state.rng
        return tree

    def storage_state(tree: Mapping[str, Any]) -> TrainState:
        return TrainState(
            step=tree["step"],
            params={p: logical_to_storage(leaf, tree["params"][p]) for p, leaf in leaves.items()},
            opt_state=optimizer.to_storage(tree["opt_state"]),
            loss_scale=tree.get("loss_scale"), plan=plan, model_def=layout.model_def,
            model_state=dict(tree.get("model_state", {})), rng=tree.get("rng"))

    abstract_tree = jax.eval_shape(logical_tree, abstract_storage_state(layout))
    named = named_leaves(abstract_tree)
    is_plan = lambda x: x is None or isinstance(x, LeafPlan)   # noqa: E731
    plans = {**{f"params/{p}": leaf for p, leaf in leaves.items()},
             **{f"opt_state/{name}": leaf for name, leaf in named_leaves(
                 optimizer.param_leaves(), is_leaf=is_plan).items()}}
    abstract = {}
    for name, struct in named.items():
        leaf = plans.get(name)
        sharding = logical_sharding(mesh, struct.shape, stacked=getattr(leaf, "stacked", False),
                                    prefer=leaf.shard_dim if leaf is not None else None)
        abstract[name] = jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=sharding)
    treedef = jax.tree.structure(abstract_tree)
    names = tuple(named)
    shardings = {name: a.sharding for name, a in abstract.items()}
    return LogicalLayout(
        names=names, abstract=abstract, plans={name: plans.get(name) for name in names},
        to_logical=jax.jit(lambda state: named_leaves(logical_tree(state)),
                           out_shardings=shardings),
        to_storage=jax.jit(lambda arrays: storage_state(jax.tree.unflatten(treedef, arrays)),
                           out_shardings=layout.state_shardings))
