"""A rollout's per-answer-token values (the policy's log-probs, the reference's, a critic's
values) computed in the model's own step layout: the one way an RL trainer reads them.

A trainer reads its models on the rollout before training on them (GRPO's and PPO's "old"
log-probs, the clipped fraction after a step, PPO's values, the reference's log-probs). On a
gathered copy that forward holds every weight and every token of the rollout on one device, and
under sequence parallelism it would be the one part of the job that is not split. Here it runs
through `engine.token_forward.TokenForward` in the step's layout (rows over the data replicas,
ZeRO-3's per-layer gathers, tokens over the sequence devices), with or without a sequence axis:

    packed   the padded rows [B, P + G] packed as the training step packs them
             (`packed_rollout.pack_rollout`, rows a multiple of the sequence's chunks, each
             answer token's slot marked) and read back into [B, G] (`unpack_answers`): the
             value of the slot whose target is answer token t, which is the padded forward's at
             t (attention stays within each sequence, at its own positions). Always under
             sequence parallelism.
    padded   the rows as they are, B padded up to a multiple of the data replicas
             (`answer_values.padded_logprobs` / `padded_values`), for a model that takes no
             packed batch (`packing=False`).

Under routing replay (`replayed`: an MoE actor, a rollout's record of the experts each layer
chose per token beside the rows) the packed forward sends every recorded token to its recorded
experts, the weights from the live router (`models.moe`), and counts the (token, layer) pairs
whose live choice is not the record: GRPO's `routing/mismatch`.

The frozen reference is read the same way (`reference_partitions`): a copy of the policy's
first stored partitions, 1/N of the model per device, read through the policy's
`AnswerForward`; never a whole model on one device. As int8 codes (`reference_int8`,
DeepSpeed-Chat's MixZ++) it is the same partitions quantized per device shard and read through
the engine's stored-codes path (`engine.frozen_codes.FrozenCodesView`: the policy's step with
every leaf frozen and stored as codes, gathered and dequantized per layer), by an
`AnswerForward` over that view (`AnswerForward.reading`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.engine.frozen_codes import FrozenCodesView
from zeroxla.engine.sequence import packed_row_length
from zeroxla.engine.token_forward import TokenForward, fill_rows
from zeroxla.rlhf.answer_values import (packed_logprobs, packed_replayed_logprobs,
                                        packed_values, padded_logprobs, padded_values)
from zeroxla.rlhf.packed_rollout import pack_rollout, unpack_answers

PACKED_INPUTS = ("inputs", "targets", "positions", "segment_ids")


class AnswerForward:
    """`forward(state, tokens, mask, prompt_lengths=None) -> float32 [B, G]` (0 where `mask`
    is): per answer token, the model's log-prob (`kind="logprobs"`, the softmax over the ids
    below `vocab_limit`) or a critic's value (`kind="values"`) of the padded rows `tokens`
    int32 [B, P + G] (right-padded answers: `mask` [B, G] a prefix of ones per row; answer b
    starts at `prompt_lengths[b]`, None: at P) under `step`'s model, in its layout; `state` a
    TrainState of `step` or its `FrozenPartitions`. `packed` (always under sequence
    parallelism): the rows packed first (module docstring), else run padded."""

    def __init__(self, step: Any, kind: str, vocab_limit: int | None = None,
                 packed: bool = True):
        if kind not in ("logprobs", "values"):
            raise ValueError(f"kind={kind!r} is invalid; accepted: 'logprobs' or 'values'")
        self.step, self.layout, self.kind = step, step.layout, kind
        self.packed = packed or self.layout.sequence is not None
        self.vocab_limit = vocab_limit
        self.forward = (TokenForward(step, packed_values if kind == "values" else
                                     functools.partial(packed_logprobs, vocab_limit=vocab_limit))
                        if self.packed else None)
        self._padded_forwards: dict[int, TokenForward] = {}      # per answer width G
        self._replayed: dict[bool, TokenForward] = {}            # per follow_record

    def __call__(self, state: Any, tokens: np.ndarray, mask: np.ndarray,
                 prompt_lengths: np.ndarray | None = None) -> np.ndarray:
        self._check_reads(state)
        forward, batch, answers = self._program(tokens, mask, prompt_lengths)
        return answers(np.asarray(forward(state, batch)))

    def lower(self, state: Any, tokens: np.ndarray, mask: np.ndarray,
              prompt_lengths: np.ndarray | None = None) -> jax.stages.Lowered:
        """The program `__call__` runs on these rows, lowered (`TokenForward.lower`)."""
        self._check_reads(state)
        forward, batch, _ = self._program(tokens, mask, prompt_lengths)
        return forward.lower(state, batch)

    def _program(self, tokens: np.ndarray, mask: np.ndarray,
                 prompt_lengths: np.ndarray | None) -> tuple[TokenForward, dict, Any]:
        """(the forward, its batch, its values [R, S] -> the answers' float32 [B, G]) of the
        padded rows (module docstring: packed, or padded)."""
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        rows = {"tokens": tokens, "action_mask": mask}
        if prompt_lengths is not None:
            rows["prompt_lengths"] = np.asarray(prompt_lengths, np.int32)
        if not self.packed:
            starts = rows.get("prompt_lengths", np.full(tokens.shape[:1],
                                                         tokens.shape[1] - mask.shape[1]))
            forward, batch = self._padded(tokens, mask, np.asarray(starts, np.int32))
            return forward, batch, lambda values: values[:len(tokens)] * mask
        layout = self.layout
        packed, _ = pack_rollout(rows, loss_type="dapo", data_size=layout.data_size,
                                 row_len=packed_row_length(tokens.shape[1] - 1, layout.sequence),
                                 answer_index=True)
        return (self.forward, {k: packed[k] for k in PACKED_INPUTS},
                lambda values: unpack_answers(values, packed["answer_index"], mask.shape) * mask)

    def replayed(self, state: Any, tokens: np.ndarray, mask: np.ndarray, routing: np.ndarray,
                 prompt_lengths: np.ndarray | None = None, follow_record: bool = True
                 ) -> tuple[np.ndarray, int, int]:
        """(`__call__`'s log-probs float32 [B, G] under routing replay, the (token, layer)
        pairs whose live choice is not the record, the pairs compared) for `routing` int32
        [B, P + G, L, k]: routing[b, j] the experts each MoE layer chose for `tokens[b, j]`
        (the token at position j, whose output predicts position j + 1: the rollout's record
        of answer token t's draw is at L_b - 1 + t), a negative first slot where none was
        recorded (routed live, not compared). `follow_record=False`: every token routed live,
        the record only compared (the log-probs `__call__`'s). Packed only (module docstring)."""
        if self.kind != "logprobs" or not self.packed:
            raise ValueError(f"AnswerForward(kind={self.kind!r}, packed={self.packed}) under "
                             "routing replay: the replayed forward is the packed log-probs' "
                             "(an MoE actor's); accepted: kind='logprobs', packed=True "
                             "(GRPOConfig.packing=True, PPOConfig.packing=True)")
        self._check_reads(state)
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        rows = {"tokens": tokens, "action_mask": mask, "routing": np.asarray(routing, np.int32)}
        if prompt_lengths is not None:
            rows["prompt_lengths"] = np.asarray(prompt_lengths, np.int32)
        if follow_record not in self._replayed:
            self._replayed[follow_record] = TokenForward(self.step, functools.partial(
                packed_replayed_logprobs, vocab_limit=self.vocab_limit,
                follow_record=follow_record))
        packed, _ = pack_rollout(rows, loss_type="dapo", data_size=self.layout.data_size,
                                 row_len=packed_row_length(tokens.shape[1] - 1,
                                                           self.layout.sequence),
                                 answer_index=True)
        values, mismatches = self._replayed[follow_record](
            state, {k: packed[k] for k in (*PACKED_INPUTS, "replay")})      # [R, S] each
        recorded = (packed["replay"][..., 0, 0] >= 0) & (packed["segment_ids"] > 0)
        compared = int(recorded.sum()) * packed["replay"].shape[2]
        logprobs = unpack_answers(np.asarray(values), packed["answer_index"], mask.shape) * mask
        return logprobs, int(np.asarray(mismatches).sum()), compared

    def routed(self, state: Any, tokens: np.ndarray, mask: np.ndarray,
               routing: np.ndarray | None, prompt_lengths: np.ndarray | None = None,
               follow_record: bool = True) -> tuple[np.ndarray, tuple[int, int]]:
        """(the answer log-probs [B, G], (the (token, layer) pairs whose live choice is not the
        record, the pairs compared)) of a rollout with or without its routing record: `routing`
        None reads `__call__`'s and (0, 0), else `replayed`'s (`follow_record`: the record
        replayed, else only compared). What GRPO and PPO read their actor's and reference's
        log-probs with under `routing_replay`."""
        if routing is None:
            return self(state, tokens, mask, prompt_lengths), (0, 0)
        logprobs, differ, compared = self.replayed(state, tokens, mask, routing, prompt_lengths,
                                                   follow_record)
        return logprobs, (differ, compared)

    def reading(self, reference: FrozenPartitions) -> AnswerForward:
        """The `AnswerForward` that reads `reference`: this one for a float copy of this
        step's partitions; for int8 codes one over their `FrozenCodesView`, of the same kind,
        vocabulary limit and packing (its programs compiled on first use)."""
        if reference.step is self.step:
            return self
        return AnswerForward(reference.step, self.kind, self.vocab_limit, self.packed)

    def _check_reads(self, state: Any) -> None:
        """Refuses frozen partitions stored for another step's layout (a reference's int8
        codes given to the policy's forward), by name."""
        if isinstance(state, FrozenPartitions) and state.step is not self.step:
            raise ValueError(
                f"AnswerForward: the frozen partitions given are stored for "
                f"{type(state.step).__name__}'s layout, not this forward's step "
                f"({type(self.step).__name__}); accepted: the forward "
                "`AnswerForward.reading(partitions)` returns")

    def _padded(self, tokens: np.ndarray, mask: np.ndarray,
                prompt_lengths: np.ndarray) -> tuple[TokenForward, dict[str, np.ndarray]]:
        """The padded rows' forward and batch, B padded with copies of the last row up to a
        multiple of the data replicas (their values dropped); one program per answer width G."""
        g = mask.shape[1]
        if g not in self._padded_forwards:
            fn = (functools.partial(padded_values, answer_length=g) if self.kind == "values"
                  else functools.partial(padded_logprobs, answer_length=g,
                                         vocab_limit=self.vocab_limit))
            self._padded_forwards[g] = TokenForward(self.step, fn)
        count = len(tokens) + (-len(tokens) % self.layout.data_size)
        batch = {"tokens": fill_rows(tokens, count),
                 "prompt_lengths": fill_rows(prompt_lengths, count)}
        return self._padded_forwards[g], batch


@dataclasses.dataclass(frozen=True)
class FrozenPartitions:
    """A frozen copy of a step's stored parameters and model state (what `AnswerForward` and
    `TokenForward` read of a state): an RL job's reference, in its policy's layout; `step` the
    step whose layout reads them (the policy's step for a float copy, its `FrozenCodesView`
    for int8 codes)."""

    params: dict[str, Any]
    model_state: dict[str, Any]
    step: Any


def reference_partitions(step: Any, state: Any, *, int8: bool, owner: str) -> FrozenPartitions:
    """The frozen reference as a copy of the policy's first `state`: its partitions, sharded
    as they are stored (ZeRO-3: 1/N of the model per device), read by the policy's
    `AnswerForward`. With LoRA the first state's adapters are B = 0: its forward is the base
    model's. `int8`: the same partitions as int8 codes of each device's shard (groups of
    `ZeroConfig.weight_quantization_group_size` elements at most, one float32 scale each),
    stored at stage 3 whatever the policy's stage and read through `FrozenCodesView(step)`
    (`AnswerForward.reading`); refusals name `{owner}.reference_int8`."""
    if int8:
        view = FrozenCodesView(step, owner=f"{owner}.reference_int8")
        params, model_state = view.codes_of(state)
        return FrozenPartitions(params, model_state, view)
    # A copy: the step donates the state it advances.
    params, model_state = jax.tree.map(jnp.copy, (state.params, state.model_state))
    return FrozenPartitions(params, model_state, step)


__all__ = ["AnswerForward", "FrozenPartitions", "PACKED_INPUTS", "reference_partitions"]
