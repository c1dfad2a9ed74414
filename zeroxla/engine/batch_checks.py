"""Validating a global batch before it is sent: errors name the key, the shape, the range and
what is accepted, instead of a shape error deep in XLA (or, for token ids outside the
vocabulary, no error at all: XLA clamps an out-of-range gather index silently)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.engine.loss import BATCH_KEYS, MASK_KEY


def check_accumulation(requested: Any, *, pipelined: bool) -> int | None:
    """A step call's own micro-batch count (`ZeroStep.__call__(gradient_accumulation_steps=)`),
    checked: an integer >= 1, or None (the config's). A pipelined step's count is its
    schedule's (`PipelineConfig.micro_batches`), fixed when it is built."""
    if requested is None:
        return None
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"gradient_accumulation_steps={requested!r} is invalid; "
                         "accepted: an integer >= 1, or None (ZeroConfig's)")
    if pipelined:
        raise ValueError(
            f"gradient_accumulation_steps={requested} per call with pipeline=: the schedule's "
            "micro-batches are PipelineConfig.micro_batches, fixed when the step is built; "
            "accepted: None")
    return requested


def check_batch(batch: Any, *, next_token: bool, data_size: int, accumulation: int,
                vocab_size: Callable[[], int]) -> dict[str, Any]:
    """The validated global batch as a dict.

    With the default loss (`next_token`) the batch is `{"inputs": int32[B, T], "targets":
    int32[B, T]}` and optionally `"loss_mask": [B, T]`, token ids in `[0, vocab_size())` (checked
    for host arrays, before they are sent); with a custom `loss_fn` any dict of arrays sharing
    the leading batch dim B. B must be a multiple of `data_size * accumulation`.
    """
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(f"batch must be a non-empty dict of arrays, got {type(batch).__name__}")
    if next_token:
        _check_token_batch(batch, vocab_size)
    leading = {key: (np.shape(value)[:1] or (None,))[0] for key, value in batch.items()}
    if len(set(leading.values())) != 1 or None in leading.values():
        raise ValueError(f"every batch array needs the same leading batch dim B; got {leading}")
    multiple = data_size * accumulation
    b = next(iter(leading.values()))
    if b % multiple:
        raise ValueError(
            f"batch size B={b} is not divisible by data-parallel size {data_size} x "
            f"gradient_accumulation_steps {accumulation} = {multiple}; accepted: multiples of "
            f"{multiple}")
    return dict(batch)


# A packed batch's keys (`zeroxla.app.packing`): each token's position in its own sequence and
# its sequence's number in the row (0: padding), both int [B, T]; the model gets both.
PACKED_KEYS = ("positions", "segment_ids")


def _check_token_batch(batch: Mapping[str, Any], vocab_size: Callable[[], int]) -> None:
    optional = (MASK_KEY, *PACKED_KEYS)
    if not set(BATCH_KEYS) <= set(batch) or set(batch) - {*BATCH_KEYS, *optional}:
        raise ValueError(f"batch must have the keys {list(BATCH_KEYS)} (and optionally "
                         f"{', '.join(map(repr, optional))}), got {sorted(batch)}")
    for key in (k for k in PACKED_KEYS if k in batch):
        value = batch[key]
        dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"batch[{key!r}] has dtype {dtype}; expected int32[B, T]")
        host = not isinstance(value, (jax.Array, jax.ShapeDtypeStruct))
        if host and np.size(value) and int(np.min(value)) < 0:
            raise ValueError(f"batch[{key!r}] has values below 0; accepted: positions from 0, "
                             "segment ids from 1 (0 marks padding)")
    if "segment_ids" in batch and not isinstance(batch["segment_ids"],
                                                 (jax.Array, jax.ShapeDtypeStruct)):
        _check_segment_runs(np.asarray(batch["segment_ids"]))
    for key in BATCH_KEYS:
        shape = np.shape(batch[key])
        dtype = batch[key].dtype if hasattr(batch[key], "dtype") else np.asarray(batch[key]).dtype
        if len(shape) != 2:
            raise ValueError(f"batch[{key!r}] has shape {shape}; expected int32[B, T]")
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"batch[{key!r}] has dtype {dtype}; expected int32[B, T]")
    for key in BATCH_KEYS:
        if not isinstance(batch[key], (jax.Array, jax.ShapeDtypeStruct)):  # host data: checked
            _check_token_range(key, np.asarray(batch[key]), vocab_size())
    for key in (k for k in (*BATCH_KEYS[1:], *optional) if k in batch):
        if np.shape(batch[key]) != np.shape(batch["inputs"]):
            raise ValueError(f"batch['inputs'] {np.shape(batch['inputs'])} and "
                             f"batch[{key!r}] {np.shape(batch[key])} differ in shape")


def _check_segment_runs(segment_ids: np.ndarray) -> None:
    """The models match segments by equality (a token sees the earlier tokens of its id), so a
    row's ids 1, 2, 1 would join the third run to the first: each id > 0 must fill one
    contiguous run of its row, as the packers write them (`zeroxla.engine.bin_packing`).
    Padding (0) may sit anywhere; the ids' order is free."""
    if segment_ids.ndim != 2 or not segment_ids.size:
        return
    starts = np.ones(segment_ids.shape, bool)                          # [B, T]: a run begins
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    ordered = np.sort(segment_ids, axis=1)                              # [B, T]: ids distinct
    distinct = np.ones(ordered.shape, bool)                             # where they change
    distinct[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    runs = ((segment_ids > 0) & starts).sum(axis=1)                     # [B]
    for row in np.flatnonzero(runs != ((ordered > 0) & distinct).sum(axis=1)):
        ids, counts = np.unique(segment_ids[row][starts[row] & (segment_ids[row] > 0)],
                                return_counts=True)
        raise ValueError(
            f"batch['segment_ids'] row {row} has segment id {ids[np.argmax(counts)]} in "
            f"{counts.max()} separate "
            f"runs ({segment_ids[row].tolist()}): tokens of one id attend to each other as one "
            "sequence; accepted: each id > 0 in one contiguous run of its row (0, padding, "
            "anywhere), as the packers write them")


def _check_token_range(key: str, tokens: np.ndarray, vocab: int) -> None:
    if not tokens.size:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"batch[{key!r}] has token ids in [{low}, {high}]; accepted: "
                         f"[0, {vocab}) (the model's vocabulary, its logits' last dim)")
