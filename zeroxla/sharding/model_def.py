"""Between Flax NNX modules and the flat `{path: array}` dicts the engine works on.

The training state holds parameters as a flat dict keyed by '/'-joined nnx paths
('blocks/layers/wq'): printable, checkpoint-friendly, and the keys of the sharding plan.
`ModelDef` remembers how to put such a dict back into an `nnx.State` and a module, and how to
present a subset of it to an optimizer as the same nested `nnx.State` a single-device user's
optax sees.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def path_str(path: tuple[Any, ...]) -> str:
    """('blocks', 'layers', 'wq') -> 'blocks/layers/wq'."""
    return "/".join(str(p) for p in path)


Filter = Any          # anything `nnx.filterlib.to_predicate` accepts


def frozen_paths(model: nnx.Module, trainable: Filter | None) -> frozenset[str]:
    """Paths of the parameters of `model` (concrete or abstract) that the nnx filter
    `trainable` does not select; none when `trainable` is None (everything trains)."""
    if trainable is None:
        return frozenset()
    selects = nnx.filterlib.to_predicate(trainable)
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return frozenset(path_str(path) for path, variable in params if not selects(path, variable))


def variable_paths(model: nnx.Module) -> dict[int, str]:
    """`{id(Variable): path}` with each Variable's canonical path: the first one, which
    `nnx.split` keys it by (a shared Variable is reachable from further paths, its aliases)."""
    return {id(node): path_str(path) for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Variable)}


def direct_variables(module: nnx.Module) -> list[nnx.Variable]:
    """The Variables a module holds as its own attributes (not its descendants')."""
    return [v for v in vars(module).values() if isinstance(v, nnx.Variable)]


def has_descendant_params(module: nnx.Module) -> bool:
    """Whether parameters sit below `module` besides its own (in submodules: their own gather
    units under ZeRO-3); descendants holding only model state or RNG streams do not count."""
    direct = {id(v) for v in direct_variables(module)}
    return any(isinstance(node, nnx.Param) and id(node) not in direct
               for _, node in nnx.iter_graph(module))


def shared_paths(model: nnx.Module) -> tuple[tuple[str, str], ...]:
    """(alias, canonical) for every path to a Variable beyond the first (the one `nnx.split`
    keys it by), walking attributes, `nnx.List` and plain lists, tuples and dicts."""
    canonical = variable_paths(model)
    seen: dict[int, list[str]] = {}

    def walk(node: Any, path: tuple[Any, ...], ancestors: frozenset[int]) -> None:
        if isinstance(node, nnx.Variable):
            seen.setdefault(id(node), []).append(path_str(path))
        elif isinstance(node, nnx.Module) and id(node) not in ancestors:
            for name, child in vars(node).items():
                if not name.startswith("_pytree__"):
                    walk(child, (*path, name), ancestors | {id(node)})
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                walk(child, (*path, i), ancestors)
        elif isinstance(node, dict):
            for key, child in node.items():
                walk(child, (*path, key), ancestors)

    walk(model, (), frozenset())
    return tuple((alias, canonical[key]) for key, found in seen.items() if key in canonical
                 for alias in found if alias != canonical[key])


def owned_by_parents(model: nnx.Module) -> tuple[str, ...]:
    """Paths of the Variables owned directly by a module that also has descendants holding
    parameters (`ModelDef.gathered_alone`)."""
    canonical = variable_paths(model)
    found: list[str] = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and has_descendant_params(node):
            found.extend(canonical[id(v)] for v in direct_variables(node)
                         if canonical[id(v)] not in found)
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of a model: graph structure and parameter paths, shapes, logical axes."""

    graphdef: Any                      # nnx.GraphDef (hashable)
    treedef: Any                       # PyTreeDef of the nnx.State of parameters
    paths: tuple[str, ...]             # in treedef leaf order
    key_paths: tuple[tuple[Any, ...], ...]   # the same paths as nnx key tuples
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    logical_axes: tuple[tuple[str, ...] | None, ...]
    # Shared weights: (alias path, canonical path) for every further path that reaches a
    # parameter (a tied embedding used as the output head, one submodule used twice).
    aliases: tuple[tuple[str, str], ...] = ()
    # Parameters owned directly by a module that also has children (a root-owned table): ZeRO-3
    # gathers these alone, once per step, instead of around the module's calls.
    gathered_alone: tuple[str, ...] = ()
    # The model's other Variables (`nnx.BatchNorm`'s batch statistics, counters): the *model
    # state*, kept replicated in `TrainState.model_state` and updated by the forward pass.
    state_treedef: Any = None
    state_paths: tuple[str, ...] = ()
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    # RNG streams held in the model: (path, is the key (else the counter), shape) per leaf.
    rng_treedef: Any = None
    rng_leaves: tuple[tuple[str, bool, tuple[int, ...]], ...] = ()

    @classmethod
    def of(cls, model: nnx.Module) -> tuple["ModelDef", dict[str, jax.Array]]:
        """Splits `model` (concrete or abstract) into its ModelDef and `{path: value}` of its
        parameters; its other Variables (batch statistics...) are `model_state_of(model)`.

        RNG streams the model holds (`nnx.Rngs` given to `nnx.Dropout`) are neither: the step
        re-keys them every step, per device and micro-batch (`zeroxla.engine.randomness`).
        """
        graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        flat = nnx.to_flat_state(params)
        key_paths = tuple(tuple(p) for p, _ in flat)
        paths = tuple(path_str(p) for p in key_paths)
        leaves, treedef = jax.tree.flatten(params)
        if len(leaves) != len(paths):
            raise ValueError("parameter tree and flat state disagree; nested Variables are "
                             "not supported")
        values = {p: leaf for p, leaf in zip(paths, leaves)}
        axes = tuple(v.get_metadata().get("logical_axes") for _, v in flat)
        state_flat = nnx.to_flat_state(rest)
        state_leaves, state_treedef = jax.tree.flatten(rest)
        if len(state_leaves) != len(state_flat):
            raise ValueError("model state tree and flat state disagree; nested Variables are "
                             "not supported")
        return cls(graphdef, treedef, paths, key_paths, tuple(tuple(x.shape) for x in leaves),
                   tuple(str(x.dtype) for x in leaves), axes, shared_paths(model),
                   owned_by_parents(model), state_treedef,
                   tuple(path_str(p) for p, _ in state_flat),
                   tuple(tuple(x.shape) for x in state_leaves),
                   tuple(str(x.dtype) for x in state_leaves), jax.tree.structure(rngs),
                   tuple((path_str(p), isinstance(v, nnx.RngKey), tuple(v.get_value().shape))
                         for p, v in nnx.to_flat_state(rngs))), values

    @staticmethod
    def model_state_of(model: nnx.Module) -> dict[str, jax.Array]:
        """`{path: value}` of the model's non-Param Variables (batch statistics, counters)."""
        _, _, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        return {path_str(p): v.get_value() for p, v in nnx.to_flat_state(rest)}

    def state(self, values: Mapping[str, jax.Array]) -> nnx.State:
        """`{path: array}` -> nnx.State of parameters (Variables, as `nnx.split` gives)."""
        return jax.tree.unflatten(self.treedef, [values[p] for p in self.paths])

    def module(self, values: Mapping[str, jax.Array],
               model_state: Mapping[str, jax.Array] | None = None,
               key: jax.Array | None = None) -> nnx.Module:
        """`{path: array}` of parameters (and of the model state, when it has one) -> a module
        with these values. Its RNG streams are keyed from `key` (each stream folds in its path;
        counters start at 0); without a key, from `jax.random.key(0)`."""
        if model_state is None and self.state_paths:
            raise ValueError(f"this model has state {list(self.state_paths[:4])} besides its "
                             "parameters; pass its values (TrainState.model_state)")
        rest = jax.tree.unflatten(self.state_treedef,
                                  [model_state[p] for p in self.state_paths])
        return nnx.merge(self.graphdef, self.state(values), self.rng_state(key), rest)

    def abstract_values(self) -> tuple[dict[str, jax.ShapeDtypeStruct],
                                       dict[str, jax.ShapeDtypeStruct]]:
        """Shapes and dtypes of the parameters and of the model state (nothing allocated)."""
        return ({p: jax.ShapeDtypeStruct(s, d)
                 for p, s, d in zip(self.paths, self.shapes, self.dtypes)},
                {p: jax.ShapeDtypeStruct(s, d)
                 for p, s, d in zip(self.state_paths, self.state_shapes, self.state_dtypes)})

    def check_values(self, values: Mapping[str, Any], where: str) -> None:
        """Raises naming the first difference between `values` ({path: array}) and this
        model's parameters (paths, shapes); a model with state besides its parameters is
        refused, since `values` holds none of it."""
        expected, _ = self.abstract_values()
        if sorted(values) != sorted(expected):
            raise KeyError(f"{where}: values for {sorted(set(values) - set(expected))[:4]} are "
                           f"not parameters, {sorted(set(expected) - set(values))[:4]} missing")
        for path, struct in expected.items():
            if tuple(values[path].shape) != tuple(struct.shape):
                raise ValueError(f"{where}: {path} has shape {tuple(values[path].shape)}, "
                                 f"the model needs {tuple(struct.shape)}")
        if self.state_paths:
            raise ValueError(f"{where}: the model has state besides its parameters "
                             f"{list(self.state_paths[:4])}; build it with init()")

    def abstract_module(self) -> nnx.Module:
        """The module with abstract values (ShapeDtypeStructs, its RNG keys too: no key is
        made eagerly, so nothing compiles): its attributes, not its math."""
        values, model_state = self.abstract_values()
        rest = jax.tree.unflatten(self.state_treedef,
                                  [model_state[p] for p in self.state_paths])
        rngs = jax.eval_shape(lambda: self.rng_state(None))
        return nnx.merge(self.graphdef, self.state(values), rngs, rest)

    def rng_state(self, key: jax.Array | None) -> nnx.State:
        """The model's RNG streams keyed from `key`: stream keys fold in a hash of their path."""
        key = jax.random.key(0) if key is None else key
        leaves = [jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF) if is_key
                  else jnp.zeros(shape, jnp.uint32) for path, is_key, shape in self.rng_leaves]
        return jax.tree.unflatten(self.rng_treedef, leaves)

    def pure_state(self, values: Mapping[str, Any], paths: Iterable[str] | None = None) -> nnx.State:
        """`{path: array}` (all parameters, or those in `paths`) -> a nested nnx.State of plain
        arrays: the tree `nnx.pure(nnx.state(model, nnx.Param))` gives on one device."""
        wanted = self.paths if paths is None else tuple(paths)
        keys = dict(zip(self.paths, self.key_paths))
        return nnx.from_flat_state([(keys[p], values[p]) for p in wanted])

    def from_pure_state(self, state: Any) -> dict[str, Any]:
        """Inverse of `pure_state`: a nested state of arrays -> `{path: array}`."""
        return {path_str(p): v for p, v in nnx.to_flat_state(state)}

    def shape_dict(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self.paths, self.shapes))

    def axes_dict(self) -> dict[str, tuple[str, ...] | None]:
        return dict(zip(self.paths, self.logical_axes))

    def key_path_dict(self) -> dict[str, tuple[Any, ...]]:
        return dict(zip(self.paths, self.key_paths))


def placeable(value: Any) -> jax.Array:
    """`value` as an array `init` can lay out over any mesh: an array committed to particular
    devices (a `gathered_model`'s, `load_params`'s, both on one device) goes through the host,
    since jit cannot move a committed argument onto the mesh's other devices."""
    if isinstance(value, jax.Array) and value.committed:
        value = np.asarray(value)
    return jnp.asarray(value)


