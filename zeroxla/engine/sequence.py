"""Sequence parallelism in the ZeRO step: how the batch is split, what the model is told, and
what is refused.

With a "sequence" mesh axis of P devices (`make_mesh(sequence=P)`) every batch array [B, T, ...]
is split over the data replicas along B and over the sequence devices along T
(`batch_spec`): each device holds T / P tokens of its rows (consecutive under "ulysses"; two
zigzag chunks under "allgather", "ring" and "usp", the batch reordered first:
`in_sequence_layout`), labels already shifted (the batch's `targets` are next tokens of the
unsplit sequence). The model gets a `SequenceParallel` (`models.sequence_parallel`) and
computes attention over whole sequences by its strategy; every other part of it is per token.
The loss is a sum and a count over each device's own tokens, summed over data x sequence:
packed and masked batches average exactly over the global batch's real tokens, however they
fall on the shards. Gradients are reduced over data x sequence (ZeRO's group, `MeshAxes.data`).

A loss_fn other than the default sees only its device's slice of each sequence: it must declare
a `sequence` parameter (the step passes the `SequenceParallel`, for `model_token_logprobs`), or
it is refused, by name, before anything is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroxla.engine.loss import declares, next_token_loss
from zeroxla.models.sequence_parallel import SequenceParallel, zigzag_order
from zeroxla.sharding.mesh import MeshAxes

SEQUENCE_KEYWORD = "sequence"


def sequence_parallel(axes: MeshAxes, strategy: str = "ulysses") -> SequenceParallel | None:
    """The `SequenceParallel` of a mesh with a sequence axis of more than one device, by
    `strategy` (`ZeroConfig.sequence_parallel_strategy`), else None."""
    if axes.sequence is None or axes.sequence_size == 1:
        return None
    return SequenceParallel(axes.sequence, axes.sequence_size, strategy)


def batch_spec(axes: MeshAxes) -> P:
    """The layout of every batch array: rows over the data replicas, and under sequence
    parallelism the sequence dim (dim 1) over the sequence devices."""
    if sequence_parallel(axes) is None:
        return P(axes.batch)
    return P(axes.batch, axes.sequence)


def in_sequence_layout(batch: dict[str, Any], sequence: SequenceParallel | None
                       ) -> dict[str, Any]:
    """The global batch with its sequence dim in the order the devices hold it: unchanged, or
    for "allgather", "ring" and "usp" the 2P chunks in zigzag order
    (`models.sequence_parallel.zigzag_order`: device r's slice is chunks r and 2P - 1 - r).
    Every loss term is per token, so the order changes no sum; positions and segment ids move
    with their tokens."""
    if sequence is None or not sequence.zigzag:
        return batch

    def permuted(x):
        t = x.shape[1]
        order = zigzag_order(sequence.size)                                  # [2P]
        tokens = (order[:, None] * (t // len(order)) + np.arange(t // len(order))).reshape(-1)
        return jnp.take(x, jnp.asarray(tokens, jnp.int32), axis=1)
    return {key: permuted(value) for key, value in batch.items()}


def out_of_sequence_layout(x: jax.Array, sequence: SequenceParallel | None) -> jax.Array:
    """The inverse of `in_sequence_layout` for one array [B, T, ...] (per-token values the
    step computed in the devices' order): back in the sequence's own order."""
    if sequence is None or not sequence.zigzag:
        return x
    t = x.shape[1]
    order = zigzag_order(sequence.size)                                      # [2P]
    tokens = (order[:, None] * (t // len(order)) + np.arange(t // len(order))).reshape(-1)
    return jnp.take(x, jnp.asarray(np.argsort(tokens), jnp.int32), axis=1)


def sequence_chunks(sequence: SequenceParallel | None) -> int:
    """The chunks sequence parallelism cuts a row into (P, or 2P for the zigzag strategies);
    1 without it."""
    return 1 if sequence is None else sequence.chunks


def packed_row_length(tokens: int, sequence: SequenceParallel | None) -> int:
    """The length of a packed row holding `tokens` slots: rounded up to a multiple of
    `sequence_chunks`, so that the row splits over the sequence devices."""
    chunks = sequence_chunks(sequence)
    return -(-tokens // chunks) * chunks


def takes_sequence(fn: Callable) -> bool:
    """Whether `fn` declares a `sequence` parameter (the step then passes its
    `SequenceParallel`)."""
    return declares(fn, SEQUENCE_KEYWORD)


def check_sequence_parallel(axes: MeshAxes, loss_fn: Callable) -> None:
    """ValueError for what sequence parallelism cannot run exactly: a pipeline mesh, or a
    custom `loss_fn` that does not declare `sequence`."""
    if sequence_parallel(axes) is None:
        return
    if axes.num_stages > 1:
        raise ValueError(f"the mesh has a 'sequence' axis of {axes.sequence_size} and a 'stage' "
                         f"axis of {axes.num_stages}: pipeline parallelism with sequence "
                         "parallelism is not built; accepted: make_mesh(..., stages=1) with "
                         "sequence=, or sequence=1 with stages=")
    if loss_fn is not next_token_loss and not takes_sequence(loss_fn):
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise ValueError(
            f"the mesh has a 'sequence' axis of {axes.sequence_size}, so each device holds "
            f"1/{axes.sequence_size} of every sequence, but loss_fn {name} takes no `sequence` "
            "argument: it would run the model on a slice as if it were whole sequences. "
            "Accepted: a loss_fn(model, batch, *, sequence) that passes `sequence` to the model "
            "(zeroxla.engine.loss.model_token_logprobs(..., sequence=sequence)) and returns a "
            "(sum, count) over its tokens; or a mesh without a sequence axis")


def check_sequence_batch(batch: dict[str, Any], sequence: SequenceParallel) -> None:
    """ValueError unless every batch array is [B, T, ...] with T a multiple of the chunks the
    sequence is cut into (P, or 2P for the zigzag of "allgather", "ring" and "usp")."""
    chunks = sequence.chunks
    for key, value in batch.items():
        shape = np.shape(value)
        if len(shape) < 2 or shape[1] % chunks:
            raise ValueError(
                f"batch[{key!r}] has shape {shape}, but under sequence parallel size "
                f"{sequence.size} ({sequence.strategy}) every batch array is [B, T, ...] with T "
                f"a multiple of {chunks} (its dim 1 is cut into {chunks} chunks over the "
                f"sequence devices); accepted: pad T to a multiple of {chunks}, or give "
                "per-row values per token")


__all__ = ["batch_spec", "check_sequence_batch", "check_sequence_parallel",
           "in_sequence_layout", "out_of_sequence_layout", "packed_row_length",
           "sequence_chunks", "sequence_parallel", "takes_sequence"]
