"""Examples with nothing to learn, counted or refused: an SFT row with no loss token (an empty
response and no EOS token), a preference pair whose chosen and rejected rows are the same
tokens (one score, or one log-ratio, for both: the pairwise loss is constant, its gradient
zero).

    same = same_pairs("--data pairs.jsonl", {"training": train, "validation": val}, why)
    write(f"... {len(train['chosen'])} train pairs{same_pairs_note(same)} ...")

The jobs keep such examples (they fill batch rows and add nothing to the loss), report how many
there are, and refuse a file, or a train or validation split, of nothing else
(`check_learnable`), since it would train on nothing and still exit 0. `zeroxla reward` and
`zeroxla dpo` count and report pairs with `same_pairs` and `same_pairs_note`, one wording.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from zeroxla.app.data import ChatDataError

SAME_TOKENS = "the same tokens for \"chosen\" and \"rejected\""


def rows_without_loss(arrays: dict[str, np.ndarray]) -> int:
    """How many SFT rows (`sft_arrays`) have no loss token: an empty response with no eos."""
    return int(np.sum(~arrays["loss_mask"].any(axis=-1)))


def pairs_without_preference(arrays: dict[str, np.ndarray]) -> int:
    """How many pairs (`pair_arrays`) have the same tokens for chosen and rejected: one score
    for both, so the pairwise loss is log 2 whatever the model and its gradient zero."""
    same = (np.all(arrays["chosen"] == arrays["rejected"], axis=-1)
            & (arrays["chosen_end"] == arrays["rejected_end"]))
    return int(same.sum())


def check_learnable(source: str, counts: dict[str, tuple[int, int]], lacking: str,
                    accepted: str) -> int:
    """Refuses data with nothing to learn. `counts` maps each split ("training", "validation")
    to (its examples, how many of them have `lacking`, e.g. "no loss token"). A ChatDataError
    names `source` when every example of the file, or of one split, has it; otherwise returns
    how many do in all (for the job to report)."""
    total = sum(n for n, _ in counts.values())
    lack = sum(k for _, k in counts.values())
    if lack == total:
        raise ChatDataError(f"{source}: every one of its {total} examples has {lacking}, so "
                            f"training would learn nothing; accepted: {accepted}")
    for split, (n, k) in counts.items():
        if k == n:
            raise ChatDataError(
                f"{source}: every one of the {n} examples of its {split} split has {lacking} "
                f"(the seeded shuffle into splits put none of the file's {total - lack} others "
                f"there); accepted: {accepted}, enough for both splits, or another --seed")
    return lack


def same_pairs(source: str, splits: Mapping[str, dict[str, np.ndarray]], why: str) -> int:
    """How many pairs of `splits` (split name -> `pair_arrays`) have the same tokens for chosen
    and rejected; a ChatDataError naming `source` when they are all of the file or of a split
    (`check_learnable`). `why` says what such a pair does to the job's loss."""
    counts = {name: (len(arrays["chosen"]), pairs_without_preference(arrays))
              for name, arrays in splits.items()}
    return check_learnable(source, counts, f"{SAME_TOKENS} ({why})",
                           "pairs whose \"chosen\" and \"rejected\" differ")


def same_pairs_note(same: int) -> str:
    """The clause a job's start line adds for `same` pairs without preference ('' for none)."""
    return (f"; {same} with the same tokens for chosen and rejected add nothing to the loss"
            if same else "")


__all__ = ["SAME_TOKENS", "check_learnable", "pairs_without_preference", "rows_without_loss",
           "same_pairs", "same_pairs_note"]
