"""The reshapes the families' tensor name maps are made of (`models.families.<family>.tensor_map`):
a row is `(hf name, our paths, (to_hf, from_hf))`, an HF name holding `{i}` is per layer, our
paths are relative (a per-layer one names the stacked `[L, ...]` leaf ending with it), and
`models.hf` resolves the rows into `Rule`s.

Conventions, checked against transformers 5.23.0 (`pytorch_utils.py`, each family's modeling
file; tests/models/test_hf.py also passes on 4.57):
- GPT-2's `Conv1D` stores weights [in, out] (`as_is`, `concat`); `nn.Linear` stores [out, in]
  (`linear`: ours transposed).
- A `*ForSequenceClassification` (`GenericForSequenceClassification`, GPT-2's own class) holds the
  same base tensors under the same names, no `lm_head.weight`, and `score.weight`
  [num_labels, D], an `nn.Linear` without bias: with one label, a reward model's `v_head` [D].
"""

from __future__ import annotations

import math

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


__all__ = ["LM_HEAD", "SCORE", "as_is", "as_is_inv", "concat", "linear", "score_fns"]
