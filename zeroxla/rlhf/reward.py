"""The score of each generated answer, DeepSpeed-Chat's `reward_score` in `generate_experience`
(`dschat/rlhf/ppo_trainer.py`), from one of two sources:

- a learned `RewardModel` (step 2): `forward_value(seq, prompt_length)["chosen_end_scores"]`,
  the model's value of prompt + answer at the answer's last real token (`answer_end_scores`,
  the plain one-program form and the reference of `RewardScorer`);
- a program on the answer text (`reward_fn`), here `vowel_fraction`: the share of vowels in the
  continuation. A character-level model controls this directly, token by token, so a tiny GPT
  can visibly raise it within a few PPO iterations, while the KL penalty keeps it from
  collapsing into "eeee..." at once.

`make_scorer` turns either into the one function the trainer calls. A reward model is scored
by `RewardScorer`, in the layout the trainer's steps train in: a frozen ZeRO-3 step of it over
the trainer's mesh (1/N of the model per device, gathered per layer), read through
`engine.token_forward.TokenForward` (rows over the data replicas, each row's tokens over the
sequence devices under sequence parallelism), the end scores picked on the host. A whole copy on
one device would sit beside that device's ZeRO-3 shares of actor, critic and reference: the
largest single allocation of the job at scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeroxla
from zeroxla.engine.sequence import sequence_chunks
from zeroxla.engine.token_forward import TokenForward, fill_rows
from zeroxla.rlhf.reward_model import RewardModel, end_scores, pairwise_loss_terms
from zeroxla.rlhf.roles import POLICY_ZERO

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


def answer_ends(tokens_width: int, action_mask: Any) -> Any:
    """int32[B]: each row's last real answer token, P + (number of ones in `action_mask`
    [B, G]) - 1, P = `tokens_width` - G; numpy for a numpy mask (the scorer's host pick), jax
    for a jax one (inside a program). The mask, not a pad id, marks the end: id 0 is a real
    character of the char tokenizer."""
    xp = jnp if isinstance(action_mask, jax.Array) else np
    prompt_length = tokens_width - action_mask.shape[1]
    return prompt_length + xp.sum(action_mask, axis=1).astype(xp.int32) - 1


def answer_end_scores(reward_model: RewardModel, tokens: jax.Array,
                      action_mask: jax.Array) -> jax.Array:
    """float32[B]: `reward_model`'s value of each row of `tokens` int32[B, P + G] at its last
    real answer token (`answer_ends`), from the plain model in one forward."""
    return end_scores(reward_model(tokens), answer_ends(tokens.shape[1], action_mask))


def reward_values(model: RewardModel, batch: dict[str, jax.Array], *,
                  sequence: Any = None) -> jax.Array:
    """The `TokenForward` form of a reward model: its value of every token [B, T] of
    batch["tokens"] (under sequence parallelism this device's slice of each row, the model
    told so by `sequence`)."""
    return model(batch["tokens"], sequence=sequence)


class RewardScorer:
    """`score(tokens, action_mask, texts=()) -> float32[B]`: `answer_end_scores` of
    `reward_model` computed in a frozen ZeRO-3 step of it over `mesh` (module docstring):
    `step`, its `state` (the model's weights, partitioned as `zero_config` stores them;
    never trained: the optimizer sets every update to zero) and the `TokenForward` reading it.
    A dense reward model only: one whose experts the mesh splits is refused by name, as is
    any other model and a `mesh` of None."""

    def __init__(self, reward_model: RewardModel, mesh: Any,
                 zero_config: zeroxla.ZeroConfig = POLICY_ZERO):
        if not isinstance(reward_model, RewardModel):
            raise TypeError(f"reward_model={type(reward_model).__name__}; accepted: a "
                            "zeroxla.rlhf.RewardModel (plain, e.g. "
                            "zeroxla.gathered_model(state))")
        if mesh is None:
            raise ValueError("make_scorer(reward_model=...) without `mesh`: the reward "
                             "model is scored in a ZeRO-3 step's layout over it, never whole "
                             "on one device; accepted: mesh= the trainer's mesh "
                             "(zeroxla.make_mesh(...))")
        self.step = zeroxla.make_step(reward_model, mesh, optimizer=optax.set_to_zero(),
                                      config=zero_config, loss_fn=pairwise_loss_terms)
        self.layout = self.step.layout
        if self.layout.experts is not None:
            raise ValueError(
                f"make_scorer(reward_model=...): the mesh splits the reward model's experts "
                f"over {self.layout.experts.size} devices; accepted: a dense RewardModel (a "
                "base without MoE layers), or a mesh without an expert axis")
        self.state = self.step.init(0)
        self.forward = TokenForward(self.step, reward_values)

    def __call__(self, tokens: np.ndarray, action_mask: np.ndarray,
                 texts: Sequence[str] = ()) -> np.ndarray:
        del texts
        tokens, action_mask = np.asarray(tokens), np.asarray(action_mask)
        values = np.asarray(self.forward(self.state, self.batch(tokens)))    # [B', T']
        ends = answer_ends(tokens.shape[1], action_mask)                     # [B]
        return values[np.arange(len(tokens)), ends].astype(np.float32)

    def lower(self, tokens: np.ndarray) -> jax.stages.Lowered:
        """The program `__call__` runs on rows `tokens`, lowered (`TokenForward.lower`)."""
        return self.forward.lower(self.state, self.batch(np.asarray(tokens)))

    def batch(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """{"tokens": int32[B', T']}: `tokens` [B, T] with B padded by copies of the last row up
        to a multiple of the data replicas (their scores dropped) and T padded by id 0 up to a
        multiple of the chunks sequence parallelism cuts a row into (after every answer's end:
        under a causal model no end value sees them)."""
        rows = fill_rows(tokens, len(tokens) + (-len(tokens) % self.layout.data_size))
        extra_tokens = -tokens.shape[1] % sequence_chunks(self.layout.sequence)
        return {"tokens": np.pad(rows, ((0, 0), (0, extra_tokens))).astype(np.int32)}


def make_scorer(reward_fn: RewardFn | None = None, reward_model: RewardModel | None = None, *,
                mesh: Any = None, zero_config: zeroxla.ZeroConfig = POLICY_ZERO) -> Scorer:
    """The trainer's `score(tokens, action_mask, texts) -> float32[B]`: from `reward_model`
    (plain, e.g. `zeroxla.gathered_model(state)`), a `RewardScorer` over `mesh` (the
    trainer's) stored as `zero_config` stores it (by default as the policy's,
    `roles.POLICY_ZERO`); or from `reward_fn` on the texts. At most one of the two; neither
    is `vowel_fraction`."""
    if reward_fn is not None and reward_model is not None:
        raise ValueError("reward_fn and reward_model are both given; accepted: exactly one "
                         "(reward_fn scores the answer text, reward_model the tokens)")
    if reward_model is None:
        fn = vowel_fraction if reward_fn is None else reward_fn
        return lambda tokens, action_mask, texts: reward_scores(texts, fn)
    return RewardScorer(reward_model, mesh, zero_config)


__all__ = ["RewardScorer", "answer_end_scores", "answer_ends", "make_scorer",
           "reward_scores", "reward_values", "vowel_fraction"]
