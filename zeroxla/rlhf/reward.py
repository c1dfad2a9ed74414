"""The score of each generated answer, DeepSpeed-Chat's `reward_score` in `generate_experience`
(`dschat/rlhf/ppo_trainer.py`), from one of two sources:

- a learned `RewardModel` (step 2): `forward_value(seq, prompt_length)["chosen_end_scores"]`,
  the model's value of prompt + answer at the answer's last real token (`answer_end_scores`);
- a program on the answer text (`reward_fn`), here `vowel_fraction`: the share of vowels in the
  continuation. A character-level model controls this directly, token by token, so a tiny GPT
  can visibly raise it within a few PPO iterations, while the KL penalty keeps it from
  collapsing into "eeee..." at once.

`make_scorer` turns either into the one function the trainer calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zeroxla.rlhf.reward_model import RewardModel, end_scores

VOWELS = frozenset("aeiouAEIOU")

RewardFn = Callable[[str], float]
# (tokens int32[B, P + G], action_mask float32[B, G], answer texts) -> scores float32[B]
Scorer = Callable[[np.ndarray, np.ndarray, Sequence[str]], np.ndarray]


def vowel_fraction(text: str) -> float:
    """The fraction of the characters of `text` that are vowels (a, e, i, o, u, either case);
    0.0 for the empty string."""
    if not text:
        return 0.0
    return sum(c in VOWELS for c in text) / len(text)


def reward_scores(texts: Sequence[str], reward_fn: RewardFn = vowel_fraction) -> np.ndarray:
    """One score per continuation: float32[B]."""
    return np.asarray([reward_fn(t) for t in texts], dtype=np.float32)


def answer_end_scores(reward_model: RewardModel, tokens: jax.Array,
                      action_mask: jax.Array) -> jax.Array:
    """float32[B]: `reward_model`'s value of each row of `tokens` int32[B, P + G] at its last
    real answer token, P + (number of ones in `action_mask` [B, G]) - 1. The mask, not a pad
    id, marks the end: id 0 is a real character of the char tokenizer."""
    prompt_length = tokens.shape[1] - action_mask.shape[1]
    ends = prompt_length + jnp.sum(action_mask, axis=1).astype(jnp.int32) - 1      # [B]
    return end_scores(reward_model(tokens), ends)


@functools.partial(jax.jit, static_argnums=0)
def _answer_end_scores(graphdef: Any, params: Any, tokens: jax.Array,
                       action_mask: jax.Array) -> jax.Array:
    return answer_end_scores(nnx.merge(graphdef, params), tokens, action_mask)


def make_scorer(reward_fn: RewardFn | None = None,
                reward_model: RewardModel | None = None) -> Scorer:
    """The trainer's `score(tokens, action_mask, texts) -> float32[B]`: from `reward_model`
    (plain, gathered; a frozen copy is kept on one device, like the reference) or from
    `reward_fn` on the texts. At most one of the two; neither is `vowel_fraction`."""
    if reward_fn is not None and reward_model is not None:
        raise ValueError("reward_fn and reward_model are both given; accepted: exactly one "
                         "(reward_fn scores the answer text, reward_model the tokens)")
    if reward_model is None:
        fn = vowel_fraction if reward_fn is None else reward_fn
        return lambda tokens, action_mask, texts: reward_scores(texts, fn)
    if not isinstance(reward_model, RewardModel):
        raise TypeError(f"reward_model={type(reward_model).__name__}; accepted: a "
                        "zeroxla.rlhf.RewardModel (plain, e.g. zeroxla.gathered_model(state))")
    graphdef, params = nnx.split(nnx.clone(reward_model))
    params = jax.device_put(params, jax.local_devices()[0])

    def score(tokens, action_mask, texts):
        del texts
        return np.asarray(_answer_end_scores(graphdef, params, jnp.asarray(tokens),
                                             jnp.asarray(action_mask)), np.float32)
    return score
