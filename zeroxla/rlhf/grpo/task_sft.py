"""Supervised fine-tuning on prompt/completion rows before GRPO (DeepSpeed-Chat's step 1 for
the bundled arithmetic task): next-token training under ZeRO-3 with the loss on the completion
tokens only, so the model learns to answer, not to write prompts.

Every row's prompt is its last `prompt_length` tokens and its completion is padded (after its
end token) to `completion_length`; the padding is masked out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla.engine.loss import model_token_logprobs


def sft_arrays(rows: Sequence[dict[str, str]], tokenizer: Any, prompt_length: int,
               completion_length: int) -> dict[str, np.ndarray]:
    """{"tokens": int32[N, P + C], "mask": float32[N, C]} of {"prompt", "completion"} rows."""
    tokens = np.zeros((len(rows), prompt_length + completion_length), np.int32)
    mask = np.zeros((len(rows), completion_length), np.float32)
    for i, row in enumerate(rows):
        prompt = np.asarray(tokenizer.encode(row["prompt"]), np.int32)
        answer = np.asarray(tokenizer.encode(row["completion"]), np.int32)
        if prompt.size < prompt_length or not 1 <= answer.size <= completion_length:
            raise ValueError(f"row {i}: prompt of {prompt.size} tokens and completion of "
                             f"{answer.size}; accepted: a prompt of >= {prompt_length} tokens "
                             f"and a completion of 1 to {completion_length}")
        tokens[i, :prompt_length] = prompt[-prompt_length:]
        tokens[i, prompt_length:prompt_length + answer.size] = answer
        mask[i, :answer.size] = 1.0
    return {"tokens": tokens, "mask": mask}


def completion_loss(model: nnx.Module, batch: dict[str, jax.Array], *, experts: Any = None):
    """`(sum, count)` of the completion tokens' negative log-likelihood (`experts`: an MoE
    model's `ExpertParallel`, which the step passes under expert parallelism)."""
    mask, tokens = batch["mask"], batch["tokens"]                          # [B, C], [B, P+C]
    logp = model_token_logprobs(model, tokens[:, :-1], tokens[:, 1:],
                                experts=experts)[:, -mask.shape[1]:]
    return -jnp.sum(logp * mask), jnp.sum(mask)


def supervised_finetune_rows(model: nnx.Module, rows: Sequence[dict[str, str]], tokenizer: Any,
                             *, mesh: Any, prompt_length: int, completion_length: int,
                             steps: int, batch_size: int = 32, lr: float = 3e-3,
                             seed: int = 0) -> tuple[nnx.Module, float]:
    """`steps` AdamW steps of `completion_loss` on batches drawn from `rows` (`seed`); returns
    the gathered model (plain, full weights) and its last training loss."""
    arrays = sft_arrays(rows, tokenizer, prompt_length, completion_length)
    step = zeroxla.make_step(model, mesh, optimizer=optax.adamw(lr),
                             config=zeroxla.ZeroConfig(stage=3), loss_fn=completion_loss)
    state, loss = step.init(seed), float("nan")
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        pick = rng.choice(len(rows), batch_size, replace=len(rows) < batch_size)
        state, metrics = step(state, {k: v[pick] for k, v in arrays.items()})
        loss = float(metrics["loss"])                  # one step in flight at a time
    return zeroxla.gathered_model(state), loss


__all__ = ["completion_loss", "sft_arrays", "supervised_finetune_rows"]
