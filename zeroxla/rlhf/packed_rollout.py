"""A GRPO (or PPO) rollout as a packed training batch: whole sequences per row with segment ids, the rows
balanced over the data replicas, instead of one right-padded row per answer (verl's
`use_remove_padding` with `balance_batch`).

A rollout's padded rows are `[prompt | answer | zeros]`, each `prompt_length +
max_completion_length` wide, so a batch of short answers spends most of its forward and
backward on padding. Packed, each answer's sequence (its prompt and its answer, `L_b + A_b`
tokens) takes `L_b + A_b - 1` slots of a row (inputs its tokens but the last, targets its
tokens but the first, positions from 0), several per row (`zeroxla.engine.bin_packing`):

    slot        s0 s1 s2 s3 s4 s5 | s6 s7 s8 ...     prompt p0 p1 p2, answer a0 a1 a2 a3
    inputs      p0 p1 p2 a0 a1 a2 | ...
    targets     p1 p2 a0 a1 a2 a3 | ...
    action_mask  0  0  1  1  1  1 | ...              1 where the target is an answer token

(slot L_b - 1 + t predicts answer token t). Every per-token array of the padded
batch (old log-probs, the reference's, the importance weights) moves to its answer token's
slot, and the per-answer values become per-token ones, so the loss is a plain sum over slots:

    advantages   the answer's advantage on each of its slots
    loss_weight  grpo: 1 / A_b on the answer's slots (its mean), dr_grpo and dapo: 1
    loss_count   on the sequence's last slot: grpo 1 (an answer), dr_grpo max_completion_length,
                 dapo A_b (its tokens)

so `sum(terms * action_mask * loss_weight) / sum(loss_count)` is `grpo.losses.grpo_loss_parts`'
aggregation of the padded batch, term for term (`make_grpo_loss` takes either layout). A
"loss_mask" [B, G] (rollout correction's kept tokens, within the answer) aggregates over its
tokens instead: weight 0 off it, A_b counted as its tokens.
Attention stays within a segment (each sequence sees only its own prompt and answer, at its
own positions), so each slot's log-prob is the padded row's.

The global batch is `[data_size * rows_per_replica, row_len]`, replica-major (the step's batch
sharding gives replica r the r-th block of rows); `rows_per_replica` is the next power of two
of what the fullest replica needs (at most the padded batch's rows per replica), so a run
compiles the step for a few shapes only.

A token budget (`pack_for_step`'s `token_budget`: verl's `ppo_max_token_len_per_gpu` with
`use_dynamic_bsz`) makes each row hold at most that many tokens per device (a row spans the
sequence devices) and each replica's rows its micro-batches: the step accumulates their
gradients (`ZeroStep(..., gradient_accumulation_steps=rows_per_replica)`), so its activations
are one row's whatever the rollout's size, and the update is the same mean over every token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zeroxla.engine.bin_packing import (balance_rows, first_fit_decreasing, place_sequence,
                                        rows_per_replica)
from zeroxla.engine.sequence import packed_row_length, sequence_chunks

PAD_SEGMENT = 0                     # the attention's padding id (`models.blockwise_attention`)
# Per-token arrays of the padded batch, [B, G] each, moved to their answer token's slot (GRPO's
# log-probs and importance weights; PPO's per-token advantages, its critic's values and returns).
ANSWER_TOKEN_KEYS = ("old_logprobs", "ref_logprobs", "is_weights", "advantages", "old_values",
                     "returns")
LOSS_COUNTS = ("grpo", "dr_grpo", "dapo")


def answer_lengths(action_mask: np.ndarray) -> np.ndarray:
    """A_b int[B]: each answer's tokens; ValueError unless every row's mask is a prefix of
    ones (the padded rollout's layout: its answer, then nothing)."""
    mask = np.asarray(action_mask) > 0
    lengths = mask.sum(axis=1)
    prefix = np.arange(mask.shape[1])[None, :] < lengths[:, None]
    if not np.array_equal(mask, prefix):
        rows = np.flatnonzero((mask != prefix).any(axis=1))
        raise ValueError(f"action_mask rows {rows[:5].tolist()} are not a prefix of ones; a "
                         "packed rollout needs each answer's tokens first, then padding")
    return lengths.astype(np.int64)


def pack_for_step(batch: dict[str, np.ndarray], layout: Any, *, loss_type: str, row_len: int,
                  token_budget: int | None, owner: str
                  ) -> tuple[dict[str, np.ndarray], dict[str, float], int | None]:
    """`batch` packed for the step of `layout` (a `ZeroLayout`): rows of `row_len` tokens
    (rounded up to a multiple of the chunks sequence parallelism cuts a row into), or with
    `token_budget` of at most `token_budget` tokens per sequence device (`_budget_row`), each
    replica's rows then its micro-batches.
    Returns (the packed batch, its statistics (with a budget, "micro_batches"), the step
    call's `gradient_accumulation_steps`: None without a budget). `owner` (e.g. "GRPOConfig")
    names the setting in errors."""
    if token_budget is None:
        length = packed_row_length(row_len, layout.sequence)
        named = f"{owner}.packed_row_len={row_len}"
    else:
        length = _budget_row(token_budget, layout)
        named = f"{owner}.ppo_max_token_len_per_gpu={token_budget}" + (
            f" (rows of {length} tokens over the sequence devices)" if layout.sequence else "")
    packed, stats = pack_rollout(batch, loss_type=loss_type, row_len=length,
                                 data_size=layout.data_size, named=named)
    if token_budget is None:
        return packed, stats, None
    micro = packed["inputs"].shape[0] // layout.data_size          # rows per replica
    return packed, {**stats, "micro_batches": float(micro)}, micro


def check_token_budget(token_budget: int | None, longest: int, layout: Any, owner: str) -> None:
    """ValueError naming `{owner}.ppo_max_token_len_per_gpu` unless a row of the budget (times
    the sequence devices of `layout`) holds the longest sequence's `longest` slots whole;
    checked when a trainer is built, before any rollout is generated."""
    parts = 1 if layout.sequence is None else layout.sequence.size
    if token_budget is not None and _budget_row(token_budget, layout) < longest:
        chunks = sequence_chunks(layout.sequence)
        raise ValueError(
            f"{owner}.ppo_max_token_len_per_gpu={token_budget} is invalid: a row holds "
            f"{_budget_row(token_budget, layout)} tokens ({token_budget} x {parts} sequence "
            f"device(s), a multiple of {chunks}), and the longest sequence (prompt + answer - "
            f"1) takes {longest}; accepted: at least "
            f"{packed_row_length(longest, layout.sequence) // parts}")


def _budget_row(token_budget: int, layout: Any) -> int:
    """The row length of a token budget: budget x the sequence devices, rounded down to a
    multiple of the chunks the sequence is cut into (2P for the zigzag strategies), so that no
    device holds more than the budget."""
    if layout.sequence is None:
        return token_budget
    chunks = sequence_chunks(layout.sequence)
    return token_budget * layout.sequence.size // chunks * chunks


def pack_rollout(batch: dict[str, np.ndarray], *, loss_type: str, row_len: int,
                 data_size: int, named: str | None = None, answer_index: bool = False
                 ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The packed form of a padded training batch `batch` ({"tokens" int32[B, P+G],
    "prompt_lengths" int[B] (absent: every prompt is P tokens, PPO's left-padded prompts, pads
    kept as the padded forward sees them), "action_mask" [B, G] (a prefix per row), and the
    `ANSWER_TOKEN_KEYS` it has, [B, G]; "advantages" [B] (GRPO: one per answer) or [B, G]
    (PPO)}), and its packing statistics.

    Returns ({"inputs", "targets", "positions", "segment_ids"} int32[R, row_len], "action_mask",
    "loss_weight", "loss_count" and the given `ANSWER_TOKEN_KEYS` float32[R, row_len]; R =
    data_size * rows_per_replica), {"rows", "fill" (share of slots holding a
    token), "replica_imbalance" (most over fewest tokens a replica holds)}. ValueError when a
    sequence does not fit `row_len` (naming `named`, the setting that chose it) or
    `loss_type` is unknown. `answer_index`: the result also holds "answer_index" int32
    [R, row_len], b * G + t + 1 on the slot of answer b's token t, 0 elsewhere
    (`unpack_answers` reads per-slot values back into [B, G] with it). A "routing" record
    int32 [B, P+G, L, k] (routing replay: routing[b, j] the experts each MoE layer chose for
    `tokens[b, j]`, -1: none recorded) comes back as "replay" int32 [R, row_len, L, k], each
    slot holding its input token's record (-1 on the slots of no sequence)."""
    if loss_type not in LOSS_COUNTS:
        raise ValueError(f"loss_type={loss_type!r} is invalid; accepted: "
                         + " | ".join(LOSS_COUNTS))
    tokens = np.asarray(batch["tokens"])
    b = tokens.shape[0]
    answer_width = np.shape(batch["action_mask"])[1]
    starts = (np.asarray(batch["prompt_lengths"], np.int64) if "prompt_lengths" in batch
              else np.full(b, tokens.shape[1] - answer_width, np.int64))        # L_b [B]
    answers = answer_lengths(batch["action_mask"])                              # A_b [B]
    slots = starts + answers - 1                                                # [B]
    if np.any(slots < 1):
        raise ValueError(f"rows {np.flatnonzero(slots < 1)[:5].tolist()} have fewer than two "
                         "tokens (prompt + answer): nothing to predict")
    try:
        rows = first_fit_decreasing(slots.tolist(), row_len)
    except ValueError as err:
        raise ValueError(f"{named or f'row_len={row_len}'}: {err}; accepted: rows of at "
                         f"least the longest sequence's {int(slots.max())} slots") from err
    per_replica = rows_per_replica(-(-len(rows) // data_size), -(-b // data_size))
    row_tokens = [int(sum(slots[i] for i in row)) for row in rows]
    placed = balance_rows(row_tokens, data_size, per_replica)
    out = _empty_rows(batch, (data_size * per_replica, row_len), answer_index)
    per_answer = {k for k in ("advantages",) if k in batch and np.ndim(batch[k]) == 1}
    routing = np.asarray(batch.get("routing", np.zeros((b, 0))), np.int32)  # [B, P+G, L, k]
    count = {"grpo": lambda a: 1.0, "dr_grpo": lambda a: float(answer_width),
             "dapo": lambda a: float(a)}[loss_type]
    for replica, members in enumerate(placed):
        for k, row_index in enumerate(members):
            row, start = replica * per_replica + k, 0
            for segment, i in enumerate(rows[row_index], start=1):
                n, p, a = int(slots[i]), int(starts[i]), int(answers[i])
                place_sequence(out, row, start, tokens[i], n, segment)
                if "routing" in batch:      # a slot's input is tokens[i, slot - start]
                    out["replay"][row, start:start + n] = routing[i, :n]
                answer = slice(start + p - 1, start + p - 1 + a)              # its A_b slots
                kept = (np.asarray(batch["loss_mask"], np.float32)[i, :a] if "loss_mask" in batch
                        else np.ones(a, np.float32))                          # [A_b]
                out["action_mask"][row, answer] = 1.0
                out["loss_weight"][row, answer] = kept * (
                    1.0 / max(kept.sum(), 1) if loss_type == "grpo" else 1.0)
                out["loss_count"][row, start + n - 1] = count(kept.sum())
                if answer_index:
                    out["answer_index"][row, answer] = i * answer_width + 1 + np.arange(a)
                for key in ANSWER_TOKEN_KEYS:
                    if key in per_answer:                 # one value per answer: each slot
                        out[key][row, answer] = batch[key][i]
                    elif key in batch:
                        out[key][row, answer] = np.asarray(batch[key])[i, :a]
                start += n
    loads = [sum(row_tokens[r] for r in members) for members in placed]
    stats = {"rows": float(len(rows)),
             "fill": float(slots.sum() / out["inputs"].size),
             "replica_imbalance": float(max(loads) / max(min(loads), 1))}
    return out, stats


def _empty_rows(batch: dict[str, np.ndarray], shape: tuple[int, int],
                answer_index: bool) -> dict[str, np.ndarray]:
    """`pack_rollout`'s arrays [R, row_len] before any sequence is placed: zeros, the replayed
    record [R, row_len, L, k] of a batch's "routing" -1 (no token recorded)."""
    out = {key: np.zeros(shape, np.int32)
           for key in ("inputs", "targets", "positions", "segment_ids")}
    floats = ("action_mask", "loss_weight", "loss_count",
              *(k for k in ANSWER_TOKEN_KEYS if k in batch))
    out.update({key: np.zeros(shape, np.float32) for key in floats})
    if "routing" in batch:
        out["replay"] = np.full(shape + np.shape(batch["routing"])[2:], -1, np.int32)
    if answer_index:
        out["answer_index"] = np.zeros(shape, np.int32)
    return out


def unpack_answers(values: np.ndarray, answer_index: np.ndarray,
                   shape: tuple[int, int]) -> np.ndarray:
    """Per-slot values [R, S] of a packed rollout back in the padded layout: float32 `shape`
    [B, G], answer b's token t from the slot `answer_index` marks b * G + t + 1; 0 where an
    answer has no token."""
    out = np.zeros(shape[0] * shape[1] + 1, np.float32)
    index = np.asarray(answer_index).reshape(-1)
    out[index] = np.asarray(values, np.float32).reshape(-1)
    return out[1:].reshape(shape)           # slot 0 collected every non-answer slot


__all__ = ["ANSWER_TOKEN_KEYS", "answer_lengths", "check_token_budget", "pack_for_step",
           "pack_rollout", "unpack_answers"]
