"""What every model config shares: positive sizes, head_dim, the maximum length rule, how the
blocks compute (the attention implementation, the tiled MLP), and `replace`."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .attention import check_implementation


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Base of the frozen model-config dataclasses (`GPTConfig`, `LlamaConfig`, ...).

    Subclasses list their size fields in `POSITIVE_FIELDS`; `check_sizes` names the first one that
    is not a positive integer, and that the heads divide d_model (unless the config gives an
    `explicit_head_dim`, as Qwen3 and Gemma 2 do), and checks the two execution fields below.

    Execution fields (keyword-only; they change how the blocks compute, never what):
    attention   `models.attention` implementation of the training / prefill path: "auto" (per
                platform: on a CUDA GPU cuDNN where it applies, else Pallas where it applies,
                else blockwise), "blockwise", "cudnn", "pallas", or "naive" (the [T, T]
                reference); "naive" also decodes naively.
    mlp_chunk   tokens per chunk of the blocks' per-token work (`models.tiled_mlp`, ALST's
                TiledMLP: the MLP; Llama's family also tiles its norms, projections and RoPE),
                or None: over the whole sequence at once.
    batch_invariant
                every matmul, norm, softmax and attention summed in a fixed order
                (`models.invariant`): a token's log-prob has the same bits at any row count,
                chunking or cache length; a family that has not built it
                (`BATCH_INVARIANT` False) refuses True by name.
    """

    attention: str = dataclasses.field(default="auto", kw_only=True)
    mlp_chunk: int | None = dataclasses.field(default=None, kw_only=True)
    batch_invariant: bool = dataclasses.field(default=False, kw_only=True)

    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = ()
    # Whether the family's blocks have the batch-invariant mode (`models.invariant`).
    BATCH_INVARIANT: ClassVar[bool] = False
    # Why the family stops at max_seq_len (its subclass says), shown in `check_seq_len`'s error.
    MAX_SEQ_LEN_REASON: ClassVar[str] = "the positions the model is built for"

    def check_sizes(self) -> None:
        name = type(self).__name__
        for field in self.POSITIVE_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field}={value!r} is invalid; accepted: an integer >= 1")
        if getattr(self, "explicit_head_dim", None) is None and self.d_model % self.num_heads:
            raise ValueError(f"{name}.d_model={self.d_model} is not divisible by "
                             f"num_heads={self.num_heads}")
        check_implementation(self.attention, f"{name}.attention")
        if self.mlp_chunk is not None and (not isinstance(self.mlp_chunk, int)
                                           or self.mlp_chunk < 1):
            raise ValueError(f"{name}.mlp_chunk={self.mlp_chunk!r} is invalid; accepted: None "
                             "or an integer >= 1 (tokens per chunk of the tiled MLP)")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"{name}.batch_invariant={self.batch_invariant!r} is invalid; "
                             "accepted: True or False")
        if self.batch_invariant and not self.BATCH_INVARIANT:
            raise ValueError(f"{name}.batch_invariant=True: the batch-invariant mode is not built "
                             f"for the {getattr(self, 'family', name)} family; accepted: "
                             "batch_invariant=False")

    def check_seq_len(self, length: int, what: str, accepted: str | None = None) -> None:
        """The maximum length rule, one for every family and every path (the forward, a KV
        cache, `zeroxla generate`, the Hybrid Engine): a sequence, prompt and new tokens
        together, holds at most `max_seq_len` positions. ValueError otherwise, naming `what`
        (the request, e.g. "sequence length"), its `length`, max_seq_len with the family's
        reason, and `accepted` (the fix the caller can make; by default 1..max_seq_len or a
        larger max_seq_len)."""
        if length > self.max_seq_len:
            accepted = accepted or (f"1..{self.max_seq_len} positions, or a model config with a "
                                    "larger max_seq_len")
            raise ValueError(f"{what} {length} exceeds {type(self).__name__}.max_seq_len="
                             f"{self.max_seq_len} ({self.MAX_SEQ_LEN_REASON}); accepted: "
                             f"{accepted}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes: Any):
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)
