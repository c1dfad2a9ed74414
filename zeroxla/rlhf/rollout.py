"""A rollout (DeepSpeed-Chat's "experience"): the generated sequences and every per-token array
PPO trains on, as host numpy arrays, so that they can be inspected and checked.

    prompts int32[B, P] --Hybrid Engine--> tokens int32[B, P + G], action_mask [B, G]
    actor / reference / critic forwards  -> logprobs, ref_logprobs, values [B, G]
    reward function on the answer text   -> scores [B]
    compute_rewards, GAE                 -> rewards, advantages, returns [B, G]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One PPO iteration's experience (shapes in the field comments; G = answer length)."""

    prompt_length: int                   # P
    tokens: np.ndarray                   # int32[B, P + G], prompt then answer (0 after EOS)
    action_mask: np.ndarray              # float32[B, G], 1 on real answer tokens (a prefix)
    texts: tuple[str, ...]               # the answers, decoded
    scores: np.ndarray                   # float32[B], the reward function's score per answer
    logprobs: np.ndarray                 # float32[B, G], actor at rollout time (the "old" policy)
    ref_logprobs: np.ndarray             # float32[B, G], frozen reference
    values: np.ndarray                   # float32[B, G], critic at rollout time
    rewards: np.ndarray                  # float32[B, G], KL penalty + clipped score at the end
    advantages: np.ndarray               # float32[B, G], GAE
    returns: np.ndarray                  # float32[B, G], advantages + values
    rollout_logprobs: np.ndarray | None = None   # float32[B, G], as the engine drew them
    # routing replay (`PPOConfig.routing_replay`): the experts each MoE layer chose per token
    routing: np.ndarray | None = None            # int32[B, P + G, L, k], -1: none recorded
    routing_mismatch: np.ndarray | None = None   # int64[2]: (token, layer) pairs differing,
    #                                              pairs compared (`rollout.routing_metrics`)

    @property
    def answer_length(self) -> int:
        return self.action_mask.shape[1]

    def save(self, path: str | os.PathLike) -> Path:
        """Writes every field but an absent one (None) to the `.npz` file `path` (texts as a
        string array, no pickle); `Rollout.load` reads it back. Returns the path."""
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"Rollout.save({path}): accepted: a path ending in .npz")
        np.savez(path, **{f.name: np.asarray(getattr(self, f.name))
                          for f in dataclasses.fields(self) if getattr(self, f.name) is not None})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Rollout":
        """The rollout `save` wrote to `path`."""
        with np.load(path, allow_pickle=False) as stored:
            fields = {name: stored[name] for name in stored.files}
        return cls(prompt_length=int(fields.pop("prompt_length")),
                   texts=tuple(str(t) for t in fields.pop("texts")), **fields)

    def kl(self) -> float:
        """Mean over real answer tokens of logprobs - ref_logprobs (the sampled estimate of
        KL(actor || reference) per token)."""
        mask = self.action_mask
        return float(np.sum((self.logprobs - self.ref_logprobs) * mask) / np.sum(mask))


@dataclasses.dataclass(frozen=True)
class DrawnAnswers:
    """A PPO rollout before the training group reads it (`PPOTrainer.finish`): the answers
    as the Hybrid Engine drew them, and the policy version that drew them (the rollout group's,
    `zeroxla.rlhf.async_rollouts`; None: the actor's, colocated)."""

    tokens: np.ndarray                   # int32[B, P + G], prompt then answer (0 after EOS)
    action_mask: np.ndarray              # float32[B, G], 1 on real answer tokens (a prefix)
    rollout_logprobs: np.ndarray         # float32[B, G], as the engine drew them
    routing: np.ndarray | None           # int32[B, P + G, L, k] with routing replay
    generation_s: float
    version: int | None = None
    versions: np.ndarray | None = None   # int32[B, G], each token's version, -1 past


def check_prompt_tokens(prompt_tokens: np.ndarray, prompt_length: int) -> np.ndarray:
    """`prompt_tokens` as int32: a token stream longer than `prompt_length`, or prompt rows
    int32[N, prompt_length]; ValueError naming `PPOConfig.prompt_length` otherwise."""
    tokens = np.asarray(prompt_tokens, np.int32)
    if tokens.ndim == 2 and tokens.shape[1] != prompt_length:
        raise ValueError(f"prompt_tokens rows have {tokens.shape[1]} tokens; "
                         f"accepted: PPOConfig.prompt_length={prompt_length}")
    if tokens.ndim not in (1, 2) or (tokens.ndim == 1 and tokens.size <= prompt_length):
        raise ValueError(f"prompt_tokens of shape {tokens.shape} is invalid; accepted: a token "
                         f"stream longer than PPOConfig.prompt_length={prompt_length}, or "
                         "prompts int32[N, prompt_length]")
    return tokens


def pad_logprobs(logprobs: Sequence[np.ndarray], mask: np.ndarray) -> np.ndarray:
    """The engine's per-output log-probs -> float32 [B, T], 0 past each answer."""
    out = np.zeros(mask.shape, np.float32)
    for b, row in enumerate(logprobs):
        out[b, :row.size] = row[:mask.shape[1]]
    return out * mask


def pad_routing(records: Sequence[np.ndarray], width: int) -> np.ndarray:
    """The engine's per-output routing records [len(output), L, k] (`generate(...,
    return_routing=True)`) -> int32 [B, width, L, k] aligned with `pad_answers`' rows (row b's
    token j's record at j), -1 past each output's tokens."""
    out = np.full((len(records), width) + records[0].shape[1:], -1, np.int32)
    for b, record in enumerate(records):
        out[b, :min(len(record), width)] = record[:width]
    return out


def routing_metrics(mismatch: Sequence[int]) -> dict[str, float]:
    """An iteration's record of routing replay's (pairs differing, pairs compared)
    (`AnswerForward.routed`): `routing/mismatch`, the (token, layer) pairs whose live routing
    in the training forward is not the rollout's record, and `routing/mismatch_fraction`."""
    differ, compared = (int(n) for n in mismatch)
    return {"routing/mismatch": differ, "routing/mismatch_fraction": differ / max(compared, 1)}


def pad_answers(outputs: Sequence[np.ndarray], prompt_length: int, answer_length: int,
                prompt_lengths: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The Hybrid Engine's rows (prompt + up to G new tokens, cut after EOS) -> tokens
    int32[B, P + G] (zero-padded) and action_mask float32[B, G]. Every prompt is P tokens,
    or with `prompt_lengths` [B] row b's is that many (<= P): its answer follows at once and
    the row is right-padded (`zeroxla.rlhf.grpo.prompts`)."""
    tokens = np.zeros((len(outputs), prompt_length + answer_length), np.int32)
    mask = np.zeros((len(outputs), answer_length), np.float32)
    starts = [prompt_length] * len(outputs) if prompt_lengths is None else prompt_lengths
    for b, (row, start) in enumerate(zip(outputs, starts, strict=True)):
        if not 0 < start <= prompt_length or row.size - start > answer_length:
            raise ValueError(f"row {b}: a prompt of {start} and an answer of {row.size - start}"
                             f" tokens; accepted: 1 to {prompt_length} and at most "
                             f"{answer_length}")
        tokens[b, :row.size] = row
        mask[b, :row.size - start] = 1.0
    if not np.all(mask[:, 0]):
        raise ValueError("a generated answer is empty; every row needs at least one new token")
    return tokens, mask


def generation_stats(engine: object) -> dict[str, float]:
    """What the Hybrid Engine's last generation did, for an iteration's record, when it ran
    continuous batching (`HybridEngine.stats`; {} under static batching): new tokens per second
    of the engine's loop (`generation/tokens_per_s`), its steps, the prompt tokens it prefilled
    (a GRPO group's prompt once), the KV pages in use per data group (mean over the steps and
    peak) and the preemptions."""
    stats = getattr(engine, "stats", None) or {}
    if not stats:
        return {}
    return {"generation/tokens_per_s": stats["generated_tokens"] / max(stats["seconds"], 1e-9),
            "generation/steps": float(stats["steps"]),
            "generation/prefill_tokens": float(stats["prefill_tokens"]),
            "generation/kv_pages_mean": float(stats["mean_pages_in_use"]),
            "generation/kv_pages_peak": float(stats["peak_pages_in_use"]),
            "generation/preemptions": float(stats["preemptions"])}
