"""ZB-H1's W on a stage's blocks: weight-only where their kept vjp splits, decided once per trace.

Under remat "none" / a checkpoint policy, B and W apply the blocks' kept vjp split at the jaxpr
level (`zeroxla.engine.weight_split`): B writes the per-op cotangents W reads into the stash
buffer, W reads them back. The B and W branches (and the probe that sizes the buffer) trace the
split separately, so `WeightSplitChoice` holds them to one decision: the first trace (the
probe) splits or falls back, with a warning naming the equation the split could not place;
every later trace must split to the same stash or fall back too, else it raises (a B that wrote
one stash and a W that read another would give wrong gradients, never a loud error). Falling
back means W re-applies the whole kept vjp to d_y: exact, about a backward's FLOPs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax

from zeroxla.engine.weight_split import UnsupportedSplit, WeightSplit, split_pullback


@dataclasses.dataclass
class WeightSplitChoice:
    """The stage's split, decided by the first `split` call of a trace (static across the
    branches of that trace): the stash's shapes, or why it fell back."""

    stash_shapes: list[jax.ShapeDtypeStruct] | None = None
    fallback: str | None = None

    def split(self, pullback: Callable[..., tuple[Any, Any]], *args: Any
              ) -> WeightSplit | None:
        """`split_pullback(pullback, *args)`, or None where the decision is to fall back."""
        if self.fallback is not None:
            return None
        decided = self.stash_shapes is not None
        try:
            split = split_pullback(pullback, *args)
        except UnsupportedSplit as error:
            if decided:
                raise AssertionError("the blocks' weight split failed in one trace of the "
                                     f"stage only: {error}") from error
            self.fallback = str(error)
            warnings.warn("zero-bubble W pass falls back to re-applying the blocks' whole vjp "
                          f"(about a backward's FLOPs, not a weight pass's): {error}",
                          stacklevel=3)
            return None
        if decided and split.stash_shapes != self.stash_shapes:
            raise AssertionError("the blocks' weight stash differs between traces of the stage: "
                                 f"{split.stash_shapes} != {self.stash_shapes}")
        self.stash_shapes = split.stash_shapes
        return split
