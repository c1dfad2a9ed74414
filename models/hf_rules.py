"""The reshapes the families' tensor name maps are made of (`models.families.<family>.tensor_map`):
a row is `(hf name, our paths, (to_hf, from_hf))`, an HF name holding `{i}` is per layer, our
paths are relative (a per-layer one names the stacked `[L, ...]` leaf ending with it), and
`models.hf` resolves the rows into `Rule`s (below).

Conventions, checked against transformers 5.23.0 (`pytorch_utils.py`, each family's modeling
file; tests/models/test_hf.py also passes on 4.57):
- GPT-2's `Conv1D` stores weights [in, out] (`as_is`, `concat`); `nn.Linear` stores [out, in]
  (`linear`: ours transposed).
- A `*ForSequenceClassification` (`GenericForSequenceClassification`, GPT-2's own class) holds the
  same base tensors under the same names, no `lm_head.weight`, and `score.weight`
  [num_labels, D], an `nn.Linear` without bias: with one label, a reward model's `v_head` [D].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np


def as_is(a: np.ndarray) -> np.ndarray:
    """The identity: the HF tensor is ours as it is (`as_is_inv` is its inverse)."""
    return a


def as_is_inv(a: np.ndarray) -> tuple[np.ndarray, ...]:
    return (a,)


def concat(shapes: tuple[tuple[int, ...], ...], hf_shapes: tuple[tuple[int, ...], ...]):
    """Our arrays, each reshaped to its `hf_shapes` entry, concatenated on the last dim.

    GPT-2's Conv1D weights are [in, out] with `out` flattened head-major; c_attn fuses q|k|v.
    """
    cuts = np.cumsum([s[-1] for s in hf_shapes])[:-1]

    def to_hf(*ours):
        parts = [a.reshape(s) for a, s in zip(ours, hf_shapes)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    def from_hf(t):
        return tuple(p.reshape(s) for p, s in zip(np.split(t, cuts, axis=-1), shapes))

    return to_hf, from_hf


def linear(shape: tuple[int, ...], split: int):
    """Our weight [in..., out...] (in = dims [:split]) <-> nn.Linear's [out, in]."""
    rows, cols = math.prod(shape[:split]), math.prod(shape[split:])

    def to_hf(w):
        return w.reshape(rows, cols).T

    def from_hf(t):
        return (t.T.reshape(shape),)

    return to_hf, from_hf


LM_HEAD = "lm_head.weight"     # a causal LM's output projection (Llama's; GPT-2's is tied)
SCORE = "score.weight"         # a sequence classifier's head, nn.Linear(D, num_labels, bias=False)


def score_fns(d: int):
    """Our score vector [D] <-> `score.weight` [1, D] (one label); another shape is refused."""

    def to_hf(v):
        return v.reshape(1, d)

    def from_hf(t):
        if t.shape != (1, d):
            raise ValueError(f"{SCORE} must be [1, {d}] (num_labels=1), not {list(t.shape)}")
        return (t.reshape(d),)

    return to_hf, from_hf


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor and the parameter(s) of ours it is made of.

    `to_hf(*ours) -> hf` takes our arrays (one layer's slice for a per-layer rule) in the order of
    `ours`; `from_hf(hf) -> tuple of ours` is its inverse.
    """

    hf: str
    ours: tuple[str, ...]
    to_hf: Callable[..., np.ndarray]
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    # E for a per-expert rule (`{e}` in `hf`): its HF side is the E tensors stacked [E, ...].
    experts: int = 0
    # P for a rule naming `{unit[j]}` / `{tail[j]}`: HF layers per block (Qwen3.5's period).
    unit: int = 1
    # L for a per-layer rule: the layers of its stacked [L, ...] leaves.
    layers: int = 0
    # For a rule naming `{tail[j]}`: the HF layer of its layer 0's j = 0 (the blocks' P L).
    first: int = 0

    @property
    def per_layer(self) -> bool:
        return is_per_layer(self.hf)

    def name(self, layer: int | None, expert: int | None = None) -> str:
        """The HF tensor name of stacked `layer` (None for a global rule): `{i}` is the layer,
        `{pair[0]}` / `{pair[1]}` the HF layers 2i and 2i + 1 of a block that holds two
        (Gemma 2's sliding and global pair), `{unit[j]}` the HF layer P i + j of a block that
        holds P (`unit`: Qwen3.5's period), `{tail[j]}` the HF layer `first` + P i + j of a
        stack after the blocks (Gemma 3's trailing layers), `{e}` the expert."""
        if layer is None:
            return self.hf
        unit = range(self.unit * layer, self.unit * (layer + 1))
        return self.hf.format(i=layer, pair=(2 * layer, 2 * layer + 1), e=expert,
                              unit=tuple(unit), tail=tuple(self.first + j for j in unit))

    def read(self, get_tensor: Callable[[str], np.ndarray], layer: int | None) -> np.ndarray:
        """The HF side of `layer`: one tensor, or a per-expert rule's E tensors stacked."""
        if not self.experts:
            return np.asarray(get_tensor(self.name(layer)))
        return np.stack([np.asarray(get_tensor(self.name(layer, e)))
                         for e in range(self.experts)])

    def named(self, layer: int | None, hf: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """(name, tensor) of the HF side `hf` of `layer` (a per-expert rule's, one per
        expert)."""
        if not self.experts:
            yield self.name(layer), np.ascontiguousarray(hf)
            return
        for e in range(self.experts):
            yield self.name(layer, e), np.ascontiguousarray(hf[e])


def is_per_layer(hf_name: str) -> bool:
    """Whether a rule's HF name is a per-layer template (`{i}`, `{pair[...]}`, `{unit[...]}`,
    `{tail[...]}`)."""
    return "{i}" in hf_name or any(f"{{{k}[" in hf_name for k in ("pair", "unit", "tail"))


__all__ = ["LM_HEAD", "SCORE", "Rule", "as_is", "as_is_inv", "concat", "is_per_layer", "linear",
           "score_fns"]
