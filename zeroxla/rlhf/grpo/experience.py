"""One GRPO iteration's experience as data: `DrawnRollout`, what the rollout side produces
(answers, rewards, advantages, the engine's log-probs and the policy version drawn from), and
`GRPORollout`, that with the training group's log-probs of the answers (the actor's, the "old"
policy of the ratio, and the frozen reference's), what an update trains on; a rollout drawn
in passes scored into a `DrawnRollout` (`finish_rollout`); and an iteration's record of them
(`iteration_record`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from zeroxla.rlhf.grpo.group_advantages import group_advantages
from zeroxla.rlhf.partial_rollout import PartialAnswers
from zeroxla.rlhf.rollout import pad_routing, routing_metrics
from zeroxla.rlhf.rollout_correction import logprob_gap


@dataclasses.dataclass(frozen=True)
class DrawnRollout:
    """A rollout before the training group reads it: answers, rewards and advantages
    (B = prompts * G rows; T = max_completion_length), and the version it was drawn from (the
    oldest of its tokens': a partial rollout's carried answers hold two or more)."""

    tokens: np.ndarray                   # int32[B, P + T]: prompt, answer, zeros
    action_mask: np.ndarray              # float32[B, T], 1 on real answer tokens
    prompt_lengths: np.ndarray           # int32[B], answer starts
    completions: tuple[str, ...]
    rewards: np.ndarray                  # float64[B]
    reward_parts: dict[str, np.ndarray]
    advantages: np.ndarray               # float32[B]
    rollout_logprobs: np.ndarray         # float32[B, T], as the engine drew them
    routing: np.ndarray | None           # int32[B, P + T, L, k] with routing replay
    generation_s: float
    scoring_s: float
    version: int | None = None           # the policy version (None: the actor's, colocated)
    versions: np.ndarray | None = None   # int32[B, T], the version that drew each token, -1 past


@dataclasses.dataclass(frozen=True)
class GRPORollout:
    """One iteration's experience (B = prompts * G rows; T = max_completion_length)."""

    tokens: np.ndarray                   # int32[B, P + T]: prompt, answer, zeros
    action_mask: np.ndarray              # float32[B, T], 1 on real answer tokens (a prefix)
    completions: tuple[str, ...]         # the answers, decoded
    rewards: np.ndarray                  # float64[B], the weighted reward per answer
    reward_parts: dict[str, np.ndarray]  # each reward function's (and the reward model's) [B]
    advantages: np.ndarray               # float32[B]
    logprobs: np.ndarray                 # float32[B, T], the actor at rollout time
    ref_logprobs: np.ndarray             # float32[B, T], the frozen reference
    rollout_logprobs: np.ndarray | None = None   # float32[B, T], as the engine drew them
    prompt_lengths: np.ndarray | None = None     # int32[B], answer starts (None: P each)
    routing: np.ndarray | None = None     # int32[B, P + T, L, k], the rollout's experts per token
    routing_mismatch: tuple[int, int] = (0, 0)   # (token, layer) pairs differing, compared
    versions: np.ndarray | None = None    # int32[B, T], the version that drew each token

    def answer_starts(self) -> np.ndarray:
        """int32[B]: the column of each row's first answer token (its prompt's length)."""
        if self.prompt_lengths is not None:
            return np.asarray(self.prompt_lengths, np.int32)
        width = self.tokens.shape[1] - self.action_mask.shape[1]
        return np.full(self.tokens.shape[:1], width, np.int32)

    def kl(self) -> float:
        """Mean over real tokens of the k3 estimator of KL(actor || reference)."""
        delta = (self.ref_logprobs - self.logprobs)[self.action_mask > 0].astype(np.float64)
        return float(np.mean(np.exp(delta) - delta - 1.0))


def iteration_record(iteration: int, rollout: GRPORollout, train: dict[str, float],
                     times: dict[str, float]) -> dict[str, Any]:
    """One metrics.jsonl record: rewards (mean, per source, and `accuracy` when the
    `accuracy_reward` is one of them), KL, loss, clipped fractions, answer length, times, and
    the train/rollout log-prob gap (`gap/max`, `gap/mean_abs`, `gap/frac_over_1e-3`)."""
    record = {"iteration": iteration, "reward": float(np.mean(rollout.rewards)),
              "reward_std": float(np.std(rollout.rewards)),
              **{f"reward/{name}": float(np.mean(v)) for name, v in rollout.reward_parts.items()},
              "kl": rollout.kl(), **train,
              "completion_length": float(np.mean(rollout.action_mask.sum(1))), **times}
    if rollout.routing is not None:          # `GRPOConfig.routing_replay`
        record.update(routing_metrics(rollout.routing_mismatch))
    if rollout.rollout_logprobs is not None:
        record.update({f"gap/{k}": float(v) for k, v in logprob_gap(
            rollout.logprobs, rollout.rollout_logprobs, rollout.action_mask).items()})
    if "accuracy_reward" in rollout.reward_parts:
        record["accuracy"] = float(np.mean(rollout.reward_parts["accuracy_reward"]))
    return record


def finish_rollout(partial: PartialAnswers, config: Any, decode: Callable[[np.ndarray], str],
                   score: Callable[..., tuple[np.ndarray, dict[str, np.ndarray]]]
                   ) -> DrawnRollout:
    """`partial`'s finished answers as a `DrawnRollout` (`config` a `GRPOConfig`): padded,
    decoded with `decode`, scored with `score(picked, tokens, real, completions)`, with their
    group-relative advantages, the engine's log-probs [B, T] and, when every token was drawn
    by a pipeline version, the versions int32 [B, T] (-1 past each answer) and the oldest."""
    start = time.perf_counter()
    c = config
    tokens, mask, starts, logprobs = partial.padded(c.prompt_length)
    completions = tuple(decode(answer) for answer in partial.answers)
    ends = starts + np.asarray([a.size for a in partial.answers])                 # [B]
    real = np.arange(tokens.shape[1]) < ends[:, None]
    rewards, parts = score(partial.picked, tokens, real.astype(np.float32), completions)
    advantages = group_advantages(rewards, c.num_generations, scale_rewards=c.scale_rewards,
                                  advantage=c.advantage)
    versions, version = partial.tags(mask)
    return DrawnRollout(tokens, mask, starts, completions, rewards, parts,
                        np.asarray(advantages, np.float32), logprobs,
                        None if partial.routing is None
                        else pad_routing(partial.routing, tokens.shape[1]),
                        partial.generation_s, time.perf_counter() - start,
                        version=version, versions=versions)


__all__ = ["DrawnRollout", "GRPORollout", "finish_rollout", "iteration_record"]
