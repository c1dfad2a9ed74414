"""Packed batches: several token sequences per row, told apart by segment ids.

A padded batch gives every example its own row of `seq_len` tokens, so a length-skewed set
(most examples far shorter than the longest) spends most of each step on padding. Packing fills
each row with whole examples instead (first-fit decreasing: the longest first, each into the
first row with room), and marks which tokens belong together:

    inputs       [a0 a1 a2 b0 b1 c0 c1 c2 c3 p  p ]     a, b, c: three examples; p: padding
    segment_ids  [1  1  1  2  2  3  3  3  3  0  0 ]     0 = padding (attends to nothing)
    positions    [0  1  2  0  1  0  1  2  3  0  0 ]     each example from position 0

The model attends within a segment only (`models.attention`, `segment_ids`), and each example's
targets are its own next tokens, so no loss term crosses a boundary: the loss of a packed batch
is the padded batch's, token for token (the loss is a token mean, `zeroxla.engine.loss`), in
fewer rows. This is TRL's `padding_free` packing and verl's `use_remove_padding`, with rows of a
fixed `seq_len` so the step compiles once. An example never spans two rows (nothing is
truncated or split: its tokens would lose their context).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zeroxla.engine.bin_packing import first_fit_decreasing, place_sequence

# Segment id of padding (the attention's convention, `models.blockwise_attention.PAD_SEGMENT`).
PAD_SEGMENT = 0
PACKED_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def pack(sequences: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int,
         pad_id: int) -> dict[str, np.ndarray]:
    """Packed rows of `sequences`, each `(tokens int[L], learned bool[L])` (`learned[t]`: the
    loss predicts token t; L <= seq_len + 1). An example takes L - 1 slots: inputs tokens[:-1],
    targets tokens[1:], loss_mask learned[1:], positions 0..L-2, its segment id.

    Returns {"inputs", "targets", "positions", "segment_ids"} int32[R, seq_len] and
    "loss_mask" float32[R, seq_len] (0 on padding), R the rows first-fit decreasing needs."""
    lengths = [max(len(tokens) - 1, 0) for tokens, _ in sequences]
    rows = first_fit_decreasing(lengths, seq_len)
    r = len(rows)
    out = {"inputs": np.full((r, seq_len), pad_id, np.int32),
           "targets": np.full((r, seq_len), pad_id, np.int32),
           "loss_mask": np.zeros((r, seq_len), np.float32),
           "positions": np.zeros((r, seq_len), np.int32),
           "segment_ids": np.full((r, seq_len), PAD_SEGMENT, np.int32)}
    for row, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, start=1):
            tokens, learned = sequences[i]
            n = lengths[i]
            at = place_sequence(out, row, start, tokens, n, segment)
            out["loss_mask"][row, at] = np.asarray(learned[1:], np.float32)
            start += n
    return out


__all__ = ["PACKED_KEYS", "PAD_SEGMENT", "first_fit_decreasing", "pack"]
