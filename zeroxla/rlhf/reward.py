"""The programmatic reward: a score per generated continuation, standing in for DeepSpeed-Chat's
reward model (`reward_model.forward_value(...)["chosen_end_scores"]`).

`vowel_fraction` scores the share of vowels in the continuation's text. A character-level model
controls this directly, token by token, so a tiny GPT can visibly raise it within a few PPO
iterations, while the KL penalty keeps it from collapsing into "eeee..." at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

VOWELS = frozenset("aeiouAEIOU")

RewardFn = Callable[[str], float]


def vowel_fraction(text: str) -> float:
    """The fraction of the characters of `text` that are vowels (a, e, i, o, u, either case);
    0.0 for the empty string."""
    if not text:
        return 0.0
    return sum(c in VOWELS for c in text) / len(text)


def reward_scores(texts: Sequence[str], reward_fn: RewardFn = vowel_fraction) -> np.ndarray:
    """One score per continuation: float32[B]."""
    return np.asarray([reward_fn(t) for t in texts], dtype=np.float32)
