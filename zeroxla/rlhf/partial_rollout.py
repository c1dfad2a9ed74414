"""A rollout drawn in passes (verl's partial rollout, AReaL's interruptible generation):
`PartialAnswers`, its answers while they are drawn, and `continue_answers`, one pass over the
unfinished ones (GRPO scores the finished answers: `grpo.experience.finish_rollout`).

With `GRPOConfig.partial_rollout` N, a rollout drawn ahead (`async_rollouts`) draws at most N new
tokens per answer at each weight sync, and an answer unfinished at a sync (no EOS yet, fewer
than `max_completion_length` tokens) is carried to the next, where it is continued from its
tokens with the newer weights. A continuation is a new prompt, the original prompt followed by
the answer so far: the engine prefills it afresh (its KV recomputed under the new weights, as
verl's partial rollout does), draws with the answer's generation seed (each row's keys also
fold in its own token ids: `zeroxla.inference.sampling`), and the new tokens are appended. Each
token keeps the log-prob the engine drew it with and the version that drew it (int32): its
pi_behav in AReaL's decoupled objective (`GRPOConfig.rollout_correction="decoupled"`).

Rows are prompt-major (row b: answer b % G of prompt b // G); arrays are host numpy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zeroxla.rlhf.rollout import pad_answers, pad_logprobs

OUTSIDE = -1          # a token's version when drawn outside the pipeline (colocated)


@dataclasses.dataclass
class PartialAnswers:
    """One rollout's answers while they are drawn (see the module docstring)."""

    iteration: int
    picked: np.ndarray                  # int[prompts]: the prompt rows of this rollout
    prompts: list[np.ndarray]           # int32[P_b] per row b
    limit: int                          # max_completion_length
    eos_id: int | None
    answers: list[np.ndarray]           # int32[n_b]: row b's answer tokens so far
    logprobs: list[np.ndarray]          # float32[n_b]: as the engine drew them
    versions: list[np.ndarray]          # int32[n_b]: the version that drew each
    routing: list[np.ndarray] | None = None   # a one-pass rollout's routing records
    generation_s: float = 0.0

    @classmethod
    def empty(cls, iteration: int, picked: np.ndarray, prompts: Sequence[np.ndarray],
              limit: int, eos_id: int | None) -> "PartialAnswers":
        """No answer token drawn yet for `prompts` (one per row)."""
        rows = len(prompts)
        return cls(iteration, picked, list(prompts), limit, eos_id,
                   [np.zeros(0, np.int32)] * rows, [np.zeros(0, np.float32)] * rows,
                   [np.zeros(0, np.int32)] * rows)

    def finished(self, row: int) -> bool:
        answer = self.answers[row]
        return answer.size >= self.limit or (
            self.eos_id is not None and answer.size > 0 and answer[-1] == self.eos_id)

    def pending(self) -> list[int]:
        """The rows still to continue."""
        return [b for b in range(len(self.prompts)) if not self.finished(b)]

    def budgets(self, rows: Sequence[int], tokens: int | None) -> list[int]:
        """Each row's new tokens this pass: at most `tokens` (None: to the limit)."""
        return [min(self.limit - self.answers[b].size, tokens or self.limit) for b in rows]

    def continued(self, rows: Sequence[int]) -> list[np.ndarray]:
        """Each row's prompt followed by its answer so far (the continuation's prompt)."""
        return [np.concatenate([self.prompts[b], self.answers[b]]).astype(np.int32)
                for b in rows]

    def extend(self, rows: Sequence[int], outputs: Sequence[np.ndarray],
               logprobs: Sequence[np.ndarray], version: int | None) -> None:
        """Appends the new tokens of `outputs` (row `rows[i]`'s continued prompt and its new
        tokens, as the engine returns them) with their log-probs, tagged `version`."""
        for b, output, drawn in zip(rows, outputs, logprobs, strict=True):
            new = np.asarray(output[self.prompts[b].size + self.answers[b].size:], np.int32)
            self.answers[b] = np.concatenate([self.answers[b], new])
            self.logprobs[b] = np.concatenate([self.logprobs[b],
                                               np.asarray(drawn, np.float32)[:new.size]])
            tag = OUTSIDE if version is None else version
            self.versions[b] = np.concatenate([self.versions[b], np.full(new.size, tag,
                                                                         np.int32)])

    def padded(self, prompt_length: int) -> tuple[np.ndarray, ...]:
        """The finished answers padded (`rollout.pad_answers`): tokens int32[B, P + T],
        action_mask float32[B, T], answer starts int32[B] and the engine's log-probs
        float32[B, T] (T = `limit`)."""
        starts = np.asarray([p.size for p in self.prompts], np.int32)
        outputs = [np.concatenate([p, a]) for p, a in zip(self.prompts, self.answers)]
        tokens, mask = pad_answers(outputs, prompt_length, self.limit, starts)
        return tokens, mask, starts, pad_logprobs(self.logprobs, mask)

    def tags(self, mask: np.ndarray) -> tuple[np.ndarray | None, int | None]:
        """(each token's version int32[B, T], -1 past each answer; the oldest), when every
        token was drawn by a pipeline version, else (None, None); `mask` is `padded`'s."""
        if any(np.any(tags == OUTSIDE) for tags in self.versions):
            return None, None
        versions = np.full(mask.shape, OUTSIDE, np.int32)                         # [B, T]
        for b, tags in enumerate(self.versions):
            versions[b, :tags.size] = tags
        return versions, int(versions[mask > 0].min())


def continue_answers(generate: Callable[..., Any], partial: PartialAnswers,
                     seeds: Sequence[int], tokens: int | None, version: int | None) -> None:
    """One pass over `partial`'s pending rows: each continued by at most `tokens` new tokens
    (None: to its end), one `generate(prompts, seed=, max_new_tokens=)` call (the engine's,
    returning outputs and log-probs) per generation index g with its seed `seeds[g]`, so the
    answers of one prompt keep apart; the new tokens tagged `version`."""
    start = time.perf_counter()
    pending = partial.pending()
    for g, seed in enumerate(seeds):
        rows = [b for b in pending if b % len(seeds) == g]
        if rows:
            outputs, logprobs = generate(partial.continued(rows), seed=seed,
                                         max_new_tokens=partial.budgets(rows, tokens))
            partial.extend(rows, outputs, logprobs, version)
    partial.generation_s += time.perf_counter() - start


__all__ = ["OUTSIDE", "PartialAnswers", "continue_answers"]
