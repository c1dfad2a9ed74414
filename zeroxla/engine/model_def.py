"""Between Flax NNX modules and the flat `{path: array}` dicts the engine works on.

The training state holds parameters as a flat dict keyed by '/'-joined nnx paths
('blocks/layers/wq'): printable, checkpoint-friendly, and the keys of the sharding plan.
`ModelDef` remembers how to put such a dict back into an `nnx.State` and a module, and how to
present a subset of it to an optimizer as the same nested `nnx.State` a single-device user's
optax sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
from flax import nnx


def path_str(path: tuple[Any, ...]) -> str:
    """('blocks', 'layers', 'wq') -> 'blocks/layers/wq'."""
    return "/".join(str(p) for p in path)


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

    @classmethod
    def of(cls, model: nnx.Module) -> tuple["ModelDef", dict[str, jax.Array]]:
        """Splits `model` (concrete or abstract) into its ModelDef and `{path: value}`.

        Raises a ValueError if the model carries non-parameter state (batch statistics, RNG
        streams...): the engine trains `nnx.Param` leaves and would otherwise drop such updates.
        """
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        extra = [path_str(p) for p, _ in nnx.to_flat_state(rest)]
        if extra:
            raise ValueError(
                f"model has non-Param state {extra[:5]}; zeroxla trains nnx.Param leaves only "
                "(remove stored RNG streams / batch statistics, or keep them outside the model)")
        flat = nnx.to_flat_state(params)
        key_paths = tuple(tuple(p) for p, _ in flat)
        paths = tuple(path_str(p) for p in key_paths)
        leaves, treedef = jax.tree.flatten(params)
        if len(leaves) != len(paths):
            raise ValueError("parameter tree and flat state disagree; nested Variables are "
                             "not supported")
        values = {p: leaf for p, leaf in zip(paths, leaves)}
        axes = tuple(v.get_metadata().get("logical_axes") for _, v in flat)
        return cls(graphdef, treedef, paths, key_paths, tuple(tuple(x.shape) for x in leaves),
                   tuple(str(x.dtype) for x in leaves), axes), values

    def state(self, values: Mapping[str, jax.Array]) -> nnx.State:
        """`{path: array}` -> nnx.State of parameters (Variables, as `nnx.split` gives)."""
        return jax.tree.unflatten(self.treedef, [values[p] for p in self.paths])

    def module(self, values: Mapping[str, jax.Array]) -> nnx.Module:
        """`{path: array}` -> a module with these parameter values."""
        return nnx.merge(self.graphdef, self.state(values))

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
