"""Preference pairs (DPO's, a reward model's) as a packed batch: each pair's chosen and rejected sequences placed
whole into rows with segment ids, instead of two right-padded rows of `seq_len` per pair (TRL's
DPO `padding_free`, with the rows balanced over the data replicas).

DPO's loss is a function of each pair's four log-prob sums (`dpo.dpo_loss_terms`), so the two
sequences of a pair go to the same data replica (the loss_fn sees one replica's rows), and each
replica numbers its pairs 0, 1, ...; every slot carries its pair's number, and the sums are
segment sums over it (`dpo.pair_values`):

    pair             which pair of this replica the slot's sequence belongs to
    chosen_mask      1 on the chosen answer's target slots (the padded row's chosen_mask moved)
    rejected_mask    1 on the rejected answer's target slots
    ref_chosen, ref_rejected, weight
                     the pair's reference sums and weight, on one slot of the pair (the first of
                     its chosen sequence), 0 elsewhere: their segment sums are the values

A reward model's pairs (`pack_scored_pairs`) take the same layout with each sequence's last
token marked instead of its answer (`chosen_end`, `rejected_end`: where its score is read), so
its pairwise loss is a segment sum as well (`reward_model.pairwise_loss_terms`).

A DPO sequence of the padded layout (tokens 0 .. end, right-padded) takes `end` slots: inputs its
tokens but the last, targets its tokens but the first, positions from 0. Pairs are spread over
the replicas by their tokens (`bin_packing.balance_rows`), each replica's sequences packed
first-fit decreasing into rows of `row_len`, and every replica given the same number of rows
(`bin_packing.rows_per_replica`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from zeroxla.engine.bin_packing import (balance_rows, first_fit_decreasing, place_sequence,
                                        rows_per_replica)

SIDES = ("chosen", "rejected")
PAIR_VALUES = ("ref_chosen", "ref_rejected", "weight")


def sequence_slots(mask: np.ndarray) -> np.ndarray:
    """int[N]: the slots of each padded sequence, its last answer target's index + 1 (the
    answer runs to the row's last real token, `dpo.pair_batch`)."""
    mask = np.asarray(mask) > 0
    if not mask.any(axis=1).all():
        raise ValueError(f"pair rows {np.flatnonzero(~mask.any(axis=1))[:5].tolist()} have no "
                         "answer token to score; a packed pair needs one on each side")
    return mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)


def place_pairs(slots: dict[str, np.ndarray], row_len: int, data_size: int
                ) -> tuple[list[list[int]], list[list[list[tuple[int, str]]]], int, dict]:
    """Where each sequence of N pairs goes, from their slots {"chosen", "rejected": int[N]}:
    (the pairs of each replica, each replica's rows as lists of (pair, side), rows per
    replica, {"rows", "fill", "replica_imbalance"}). ValueError when a sequence is longer
    than `row_len`."""
    n = len(slots["chosen"])
    longest = int(max(s.max() for s in slots.values()))
    if longest > row_len:
        raise ValueError(f"packed row_len={row_len} is shorter than the longest sequence's "
                         f"{longest} slots; accepted: row_len >= {longest}")
    pair_tokens = (slots["chosen"] + slots["rejected"]).tolist()
    owners = balance_rows(pair_tokens, data_size, -(-n // data_size))   # pairs per replica
    rows = []                               # per replica: rows of (pair, side) sequences
    for pairs in owners:
        members = [(i, side) for i in pairs for side in SIDES]
        bins = first_fit_decreasing([int(slots[side][i]) for i, side in members], row_len)
        rows.append([[members[k] for k in row] for row in bins])
    per_replica = rows_per_replica(max(len(r) for r in rows), 2 * -(-n // data_size))
    loads = [sum(pair_tokens[i] for i in pairs) for pairs in owners]
    stats = {"rows": float(sum(len(r) for r in rows)),
             "fill": float(sum(pair_tokens) / (data_size * per_replica * row_len)),
             "replica_imbalance": float(max(loads) / max(min(loads), 1))}
    return owners, rows, per_replica, stats


def _fill(batch, slots, row_len, data_size, floats, write, source=False):
    """The packed arrays: tokens, positions, segment ids and pair numbers of every sequence
    (`place_pairs`), then `write(out, row, at, i, side)` for each one's own values; with
    `source`, "source" int32: i + 1 on every slot of pair i's two sequences, 0 elsewhere."""
    owners, rows, per_replica, stats = place_pairs(slots, row_len, data_size)
    shape = (data_size * per_replica, row_len)
    out = {key: np.zeros(shape, np.int32)
           for key in ("inputs", "targets", "positions", "segment_ids", "pair",
                       *(("source",) if source else ()))}
    out.update({key: np.zeros(shape, np.float32) for key in floats})
    for replica, (pairs, replica_rows) in enumerate(zip(owners, rows)):
        local = {i: k for k, i in enumerate(pairs)}                    # the replica's numbering
        for r, members in enumerate(replica_rows):
            row, start = replica * per_replica + r, 0
            for segment, (i, side) in enumerate(members, start=1):
                m = int(slots[side][i])
                at = place_sequence(out, row, start, np.asarray(batch[side][i]), m, segment)
                out["pair"][row, at] = local[i]
                if source:
                    out["source"][row, at] = i + 1
                write(out, row, at, i, side)
                start += m
    return out, stats


def pack_pairs(batch: dict[str, np.ndarray], *, row_len: int, data_size: int,
               source: bool = False) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The packed form of `dpo.pair_batch` rows with their reference sums (`batch`: "chosen",
    "rejected" int32[N, T], "chosen_mask", "rejected_mask" [N, T-1], "weight", "ref_chosen",
    "ref_rejected" [N]), and its statistics {"rows", "fill", "replica_imbalance"}.

    Returns {"inputs", "targets", "positions", "segment_ids", "pair"} int32[R, row_len] and
    {"chosen_mask", "rejected_mask", "ref_chosen", "ref_rejected", "weight"} float32[R,
    row_len] (module docstring), R = data_size * rows per replica; with `source`, "source"
    int32[R, row_len] (`_fill`: which of the N pairs each slot is of, + 1)."""
    slots = {side: sequence_slots(batch[f"{side}_mask"]) for side in SIDES}         # [N] each

    def write(out, row, at, i, side):
        out[f"{side}_mask"][row, at] = np.asarray(batch[f"{side}_mask"][i][:at.stop - at.start])
        if side == "chosen":
            for key in PAIR_VALUES:
                out[key][row, at.start] = batch[key][i]
    return _fill(batch, slots, row_len, data_size,
                 ("chosen_mask", "rejected_mask", *PAIR_VALUES), write, source)


def pack_scored_pairs(batch: dict[str, np.ndarray], *, row_len: int, data_size: int
                      ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """A reward model's pair batch (`reward_model.PairBatch`: "chosen", "rejected" int32[N, T],
    "chosen_end", "rejected_end" int[N], each row's last real token) packed: every sequence
    whole (its end + 1 tokens as inputs; "targets" unused), and "chosen_end", "rejected_end"
    float32[R, row_len] 1 on the slot of each sequence's last token, where its score is read
    (`reward_model.pairwise_loss_terms`)."""
    slots = {side: np.asarray(batch[f"{side}_end"], np.int64) + 1 for side in SIDES}

    def write(out, row, at, i, side):
        out[f"{side}_end"][row, at.stop - 1] = 1.0
    return _fill(batch, slots, row_len, data_size, ("chosen_end", "rejected_end"), write)


def pair_sums(pair: jax.Array, *values: jax.Array, sequence: Any = None
              ) -> tuple[jax.Array, ...]:
    """Each of `values` (float [R, S], this device's rows) summed per pair number `pair` (int
    [R, S]): [N] each, N the replica's slots (pair numbers past its pairs sum nothing). Under
    sequence parallelism (`sequence`, a `SequenceParallel`: the rows are this device's
    [R, S/P] slice) the sums are over all P devices of the rows (a psum), so every sequence
    device holds each pair's whole sums: a loss of them is then counted P times in the step's
    sum and P times in its count, and its mean (and gradient) is the pairs' own."""
    flat = pair.reshape(-1)
    n = flat.size * (1 if sequence is None else sequence.size)
    sums = tuple(jax.ops.segment_sum(v.reshape(-1), flat, num_segments=n) for v in values)
    return sums if sequence is None else tuple(lax.psum(x, sequence.axis) for x in sums)


def refuse_padded_pairs(sequence: Any, option: str) -> None:
    """ValueError for padded pair rows under sequence parallelism (`option` names the switch
    that packs them)."""
    if sequence is not None:
        raise ValueError(f"padded pair rows under sequence parallelism (size {sequence.size}): "
                         f"their per-pair arrays do not split along the sequence; accepted: "
                         f"{option} (every array per token), or a mesh without a sequence axis")


__all__ = ["PAIR_VALUES", "pack_pairs", "pack_scored_pairs", "pair_sums", "place_pairs",
           "refuse_padded_pairs", "sequence_slots"]
