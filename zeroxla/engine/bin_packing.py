"""Sequences into rows, rows onto data replicas: the bin packing behind packed batches.

A packed batch (`zeroxla.app.packing` for SFT, `zeroxla.rlhf.packed_rollout` for RL rollouts)
holds several whole sequences per row of a fixed length, told apart by segment ids. Two
choices make one:

    first_fit_decreasing   which sequences share a row: the longest first, each into the first
                           row with room (at most 11/9 OPT + 1 rows)
    balance_rows           which data replica runs each row: rows from the fullest down, each to
                           the replica holding the fewest tokens so far (LPT scheduling), every
                           replica the same number of rows, so no device waits on a longer one
                           (verl's `balance_batch`)
    place_sequence         one sequence's inputs, targets, positions and segment id in its row

Both are deterministic (ties keep the input order), so a resumed run packs as the
uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity` (first-fit decreasing:
    at most 11/9 OPT + 1 bins). Ties keep the input order, so the packing is deterministic.
    A length of 0 occupies no bin. ValueError for a length over `capacity`."""
    over = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    if over:
        i, n = over[0]
        raise ValueError(f"sequence {i} has {n} tokens but a packed row holds {capacity} "
                         f"(seq_len); {len(over)} sequence(s) do not fit: raise seq_len")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n == 0:
            continue                       # nothing to predict: it occupies no slot
        at = next((b for b, r in enumerate(room) if r >= n), None)
        if at is None:
            bins.append([i])
            room.append(capacity - n)
        else:
            bins[at].append(i)
            room[at] -= n
    return bins


def balance_rows(row_tokens: Sequence[int], replicas: int, rows_per_replica: int
                 ) -> list[list[int]]:
    """Row indices per replica (`replicas` lists of at most `rows_per_replica`): the rows from
    the most tokens down, each to the replica with the fewest tokens so far among those with
    room (LPT: the fullest replica holds at most 4/3 of the optimum). ValueError when the rows
    do not fit `replicas * rows_per_replica`."""
    if replicas < 1 or rows_per_replica < 1:
        raise ValueError(f"replicas={replicas}, rows_per_replica={rows_per_replica}; "
                         "accepted: integers >= 1")
    if len(row_tokens) > replicas * rows_per_replica:
        raise ValueError(f"{len(row_tokens)} rows do not fit {replicas} replicas x "
                         f"{rows_per_replica} rows")
    assigned: list[list[int]] = [[] for _ in range(replicas)]
    load = [0] * replicas
    for row in sorted(range(len(row_tokens)), key=lambda r: -row_tokens[r]):
        to = min((r for r in range(replicas) if len(assigned[r]) < rows_per_replica),
                 key=lambda r: (load[r], r))
        assigned[to].append(row)
        load[to] += row_tokens[row]
    return assigned


def rows_per_replica(needed: int, padded: int) -> int:
    """Rows each replica gets: the next power of two of `needed` (what the fullest replica
    needs), at most `padded` (the padded batch's rows per replica) unless more are needed, so
    a run compiles its step for a few shapes only."""
    return min(1 << max(needed - 1, 0).bit_length(), max(padded, needed))


def place_sequence(out: dict[str, np.ndarray], row: int, start: int, tokens: np.ndarray,
                   n: int, segment: int) -> slice:
    """Writes one sequence into the `n` slots of `row` from `start` of a packed batch `out`:
    "inputs" its tokens[:n], "targets" tokens[1:n + 1] (those there are: a sequence read for
    its hidden states, not its next tokens, has one fewer), "positions" 0..n-1 and its
    "segment_ids" `segment`. Returns the slots' slice."""
    at = slice(start, start + n)
    following = np.asarray(tokens[1:n + 1])
    out["inputs"][row, at] = tokens[:n]
    out["targets"][row, start:start + following.size] = following
    out["positions"][row, at] = np.arange(n)
    out["segment_ids"][row, at] = segment
    return at


__all__ = ["balance_rows", "first_fit_decreasing", "place_sequence", "rows_per_replica"]
