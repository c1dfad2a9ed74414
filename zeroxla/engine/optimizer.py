"""The optimizer on whole parameters: any optax transformation, exactly as on one device.

optax transformations may compute per-tensor statistics (global norms, LAMB's trust ratios,
Adafactor's factored second moments, Muon's orthogonalisation) and users mask them by shape or
path. Run on flat, padded local partitions (DeepSpeed's layout) those statistics are computed per
shard and silently wrong. Here the optimizer runs under `jit`, outside the `shard_map`, on
globally shaped arrays: every parameter, gradient and param-shaped optimizer leaf has its logical
shape (padding cut off), and XLA's partitioner inserts the few reductions a non-elementwise
transformation needs; an elementwise one (SGD, Adam, AdamW, Lion) stays local to each shard and
moves no bytes. The optimizer sees the same nested `nnx.State` of plain arrays a single-device
nnx user's optax sees, so masks and labels written against the model's tree work unchanged.

Storage: an optimizer-state leaf that has the shape of the parameter it belongs to (found by
its path ending in that parameter's path) is stored like the parameter's optimizer partition
(`LeafPlan.optimizer_spec`, padded); any other leaf (counts, scalars, Adafactor's factored row
and column statistics) is stored replicated, as the optimizer made it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.sharding.plan import ShardingPlan


def _key(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _describe(optimizer: Any) -> str:
    name = getattr(optimizer, "__qualname__", None) or type(optimizer).__name__
    return f"optimizer {name}"


_OPTAX_DIR = "/optax/"
# optax's adapters and combinators around transformations' updates: where one raises, it is
# calling the transformation that failed (a missing argument), not failing itself.
_OPTAX_ADAPTERS = ("with_extra_args_support.", "chain.", "named_chain.")


def optax_transformation(codes: Sequence[types.CodeType]) -> str | None:
    """The optax transformation whose update is innermost in `codes` (a traceback's code
    objects, outermost first), as the user wrote it: `optax.clip_by_global_norm` inside
    `chain`, or a wrapper's own (`optax.MultiSteps`, `optax.apply_if_finite`) when it raised
    itself; None when no optax update is among them."""
    updates = [c for c in codes if _OPTAX_DIR in c.co_filename
               and c.co_name in ("update_fn", "update")
               and not c.co_qualname.startswith(_OPTAX_ADAPTERS)]
    if not updates:
        return None
    # "<transformation>.<locals>.update_fn", "apply_if_finite.<locals>.update",
    # "MultiSteps.update"
    name = updates[-1].co_qualname.split(".<locals>")[0].removesuffix(".update")
    return f"optax.{name}"


def _traceback_codes(err: BaseException) -> list[types.CodeType]:
    codes, tb = [], err.__traceback__
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return codes


class OptimizerError(ValueError):
    """An optax transformation that cannot run in a ZeRO step (named, with the reason)."""


@dataclasses.dataclass(frozen=True)
class ShardedOptimizer:
    """An optax `GradientTransformation` applied to the trainable leaves of a plan.

    `init(params)`, `update(grads, opt_state, params)` take `{path: logical array}` dicts and keep
    the optimizer state in its storage layout (`to_logical` / `to_storage` convert it, e.g. for
    checkpoints). `abstract_state()` and `state_specs()` give its shapes and shardings.
    """

    optimizer: optax.GradientTransformation
    plan: ShardingPlan
    model_def: ModelDef

    @property
    def trainable(self) -> tuple[LeafPlan, ...]:
        return self.plan.trainable_leaves

    def state_tree(self, values: Mapping[str, Any]) -> Any:
        """`{path: array}` of the trainable leaves -> the nested nnx.State optax sees."""
        return self.model_def.pure_state(values, [leaf.path for leaf in self.trainable])

    def _logical_structs(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {leaf.path: jax.ShapeDtypeStruct(leaf.shape, leaf.master_dtype)
                for leaf in self.trainable}

    def logical_abstract_state(self) -> Any:
        """The optimizer state as optax makes it for the logical parameters (shapes only)."""
        return jax.eval_shape(self.optimizer.init, self.state_tree(self._logical_structs()))

    def param_leaves(self) -> Any:
        """The optimizer state's tree with, at each leaf, the `LeafPlan` of the parameter it
        mirrors (same shape, path ending in the parameter's path), or None."""
        by_key = {tuple(self.model_def.key_path_dict()[leaf.path]): leaf
                  for leaf in self.trainable}
        abstract = self.logical_abstract_state()
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        found = []
        for path, struct in flat:
            keys = tuple(_key(k) for k in path)
            match = None
            for start in range(len(keys)):
                leaf = by_key.get(keys[start:])
                if leaf is not None:
                    match = leaf if tuple(struct.shape) == leaf.shape else None
                    break
            found.append(match)
        return jax.tree.unflatten(treedef, found)

    def _map(self, fn_param, fn_other, state: Any) -> Any:
        leaves, treedef = jax.tree.flatten(state)
        plans = jax.tree.leaves(self.param_leaves(), is_leaf=lambda x: x is None or
                                isinstance(x, LeafPlan))
        if len(plans) != len(leaves):
            raise OptimizerError(f"{_describe(self.optimizer)}: its state has {len(leaves)} "
                                 f"leaves, but its init makes {len(plans)}")
        return jax.tree.unflatten(treedef, [fn_other(x) if p is None else fn_param(x, p)
                                            for x, p in zip(leaves, plans)])

    def to_storage(self, state: Any) -> Any:
        """Logical optimizer state -> storage (param-shaped leaves padded like their partition)."""
        return self._map(lambda x, leaf: leaf.pad(x) if leaf.optimizer_partitioned
                         else leaf.stage_pad(x),
                         lambda x: x, state)

    def to_logical(self, state: Any) -> Any:
        """Storage optimizer state -> logical (padding cut off)."""
        return self._map(lambda x, leaf: leaf.unpad(x) if leaf.optimizer_partitioned
                         else leaf.stage_unpad(x),
                         lambda x: x, state)

    def abstract_state(self) -> Any:
        """Shapes and dtypes of the stored optimizer state."""
        return self._map(
            lambda x, leaf: jax.ShapeDtypeStruct(leaf.optimizer_shape, x.dtype),
            lambda x: x, self.logical_abstract_state())

    def state_specs(self) -> Any:
        """PartitionSpecs of the stored optimizer state."""
        return self._map(lambda x, leaf: leaf.optimizer_spec, lambda x: P(),
                         self.logical_abstract_state())

    def state_shardings(self, mesh: Any) -> Any:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs(),
                            is_leaf=lambda x: isinstance(x, P))

    def init(self, params: Mapping[str, jax.Array]) -> Any:
        """Optimizer state for the logical trainable parameters, in storage layout."""
        return self.to_storage(self.optimizer.init(self.state_tree(params)))

    def update(self, grads: Mapping[str, jax.Array], opt_state: Any,
               params: Mapping[str, jax.Array]) -> tuple[dict[str, jax.Array], Any]:
        """One optimizer step on logical `grads` and `params` (`{path: array}` of the trainable
        leaves); returns the new logical parameters and the new stored optimizer state."""
        p, g = self.state_tree(params), self.state_tree(grads)
        updates, new_state = self.optimizer.update(g, self.to_logical(opt_state), p)
        new_params = self.model_def.from_pure_state(optax.apply_updates(p, updates))
        return new_params, self.to_storage(new_state)

    def check(self) -> None:
        """Raises `OptimizerError` naming the transformation when its `update` cannot run on
        the logical parameters with `(grads, state, params)` alone (e.g. a line search that
        needs the loss function), instead of failing deep inside optax at the first step."""
        structs = self._logical_structs()
        try:
            jax.eval_shape(lambda g, p: self.optimizer.update(
                self.state_tree(g), self.optimizer.init(self.state_tree(p)),
                self.state_tree(p)), structs, structs)
        except Exception as err:   # noqa: BLE001 - re-raised with the transformation named
            inner = optax_transformation(_traceback_codes(err))
            where = f" ({inner} in it)" if inner else ""
            raise OptimizerError(
                f"{_describe(self.optimizer)}{where} cannot run in a ZeRO step: its "
                f"update(grads, state, params) fails on the model's parameters with "
                f"{type(err).__name__}: {err}. A ZeRO step calls update with the reduced "
                "gradients, the optimizer state and the model's parameters only; "
                "transformations that need more (the loss value or a function to re-evaluate "
                "it, as optax.lbfgs's line search does) or parameters of their own structure "
                "(optax.lookahead's LookaheadParams(fast, slow)) are not supported") from err


def default_optimizer() -> optax.GradientTransformation:
    """AdamW with DeepSpeed's default betas and eps."""
    return optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
