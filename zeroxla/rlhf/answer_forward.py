"""A rollout's per-answer-token values (the policy's log-probs, a critic's values) computed in
the policy's own step layout under sequence parallelism, instead of on a gathered copy.

A trainer reads its policy on the rollout before training on it (GRPO's and PPO's "old"
log-probs, the clipped fraction after a step, PPO's values). On one device with the gathered
model that forward holds every weight and every token of the rollout; under sequence
parallelism it is the part of the job that would not be split. Here the padded rows
[B, P + G] are packed as the training step packs them (`packed_rollout.pack_rollout`, rows a
multiple of the sequence's chunks, each answer token's slot marked), run by
`engine.token_forward.TokenForward` in the step's layout (rows over the data replicas, tokens
over the sequence devices, ZeRO-3's per-layer gathers), and read back into [B, G]
(`unpack_answers`): the value of the slot whose target is answer token t, which is the padded
forward's at t (attention stays within each sequence, at its own positions).

The frozen reference runs the same way (`reference_partitions`): a copy of the policy's initial
stored partitions, 1/N of the model per device, read through the policy's `AnswerForward`, in
place of the whole model on one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.engine.sequence import packed_row_length
from zeroxla.engine.token_forward import TokenForward
from zeroxla.rlhf.packed_rollout import pack_rollout, unpack_answers
from zeroxla.rlhf.ppo_losses import packed_logprobs, packed_values
from zeroxla.sharding.mesh import MeshAxes


class AnswerForward:
    """`forward(state, tokens, mask, prompt_lengths=None) -> float32 [B, G]` (0 where `mask`
    is): per answer token, the policy's log-prob (`kind="logprobs"`, the softmax over the ids
    below `vocab_limit`) or a critic's value (`kind="values"`) of the padded rows `tokens`
    int32 [B, P + G] (right-padded answers: `mask` [B, G] a prefix of ones per row; answer b
    starts at `prompt_lengths[b]`, None: at P) under `step`'s model, in its layout."""

    def __init__(self, step: Any, kind: str, vocab_limit: int | None = None):
        if kind not in ("logprobs", "values"):
            raise ValueError(f"kind={kind!r} is invalid; accepted: 'logprobs' or 'values'")

        self.layout = step.layout
        self.forward = TokenForward(step, packed_values if kind == "values" else
                                    functools.partial(packed_logprobs, vocab_limit=vocab_limit))

    def __call__(self, state: Any, tokens: np.ndarray, mask: np.ndarray,
                 prompt_lengths: np.ndarray | None = None) -> np.ndarray:
        layout = self.layout
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        rows = {"tokens": tokens, "action_mask": mask}
        if prompt_lengths is not None:
            rows["prompt_lengths"] = np.asarray(prompt_lengths)
        packed, _ = pack_rollout(rows, loss_type="dapo", data_size=layout.data_size,
                                 row_len=packed_row_length(tokens.shape[1] - 1, layout.sequence),
                                 answer_index=True)
        batch = {k: packed[k] for k in ("inputs", "targets", "positions", "segment_ids")}
        values = np.asarray(self.forward(state, batch))                  # [R, S]
        return unpack_answers(values, packed["answer_index"], mask.shape) * mask


@dataclasses.dataclass(frozen=True)
class FrozenPartitions:
    """A frozen copy of a step's stored parameters and model state (what `AnswerForward` and
    `TokenForward` read of a state): an RL job's reference, in its policy's layout."""

    params: dict[str, Any]
    model_state: dict[str, Any]


def one_device_reference(mesh: Any, int8: bool) -> bool | None:
    """`build_roles`' `reference_int8` for a policy on `mesh`: None (no one-device reference:
    `reference_partitions` takes its place) when the mesh splits sequences, else `int8`."""
    return None if MeshAxes.of(mesh).sequence_size > 1 else int8


def reference_partitions(step: Any, state: Any, *, int8: bool,
                         owner: str) -> FrozenPartitions | None:
    """Under sequence parallelism (`step`'s mesh splits sequences), the frozen reference as a
    copy of the policy's first `state` (its partitions, sharded as they are), else None (the
    one-device `FrozenReference`). A reference held as int8 codes (`int8`) is refused under it,
    naming `{owner}.reference_int8`: the partitions are the policy's stored floats. With LoRA
    the first state's adapters are B = 0: its forward is the base model's."""
    if step.layout.sequence is None:
        return None
    if int8:
        raise ValueError(f"{owner}.reference_int8=True with sequence parallelism (size "
                         f"{step.layout.sequence.size}): the reference runs in the policy's "
                         "layout from its stored float partitions; accepted: "
                         f"{owner}.reference_int8=False, or a mesh without a sequence axis")
    # A copy: the step donates the state it advances.
    params, model_state = jax.tree.map(jnp.copy, (state.params, state.model_state))
    return FrozenPartitions(params, model_state)


def answer_forward(step: Any, kind: str, vocab_limit: int | None = None
                   ) -> AnswerForward | None:
    """An `AnswerForward` when `step`'s mesh splits sequences (the gathered forward is then the
    one part not split), else None (the trainer's one-device forward)."""
    return None if step.layout.sequence is None else AnswerForward(step, kind, vocab_limit)


__all__ = ["AnswerForward", "FrozenPartitions", "answer_forward", "one_device_reference",
           "reference_partitions"]
