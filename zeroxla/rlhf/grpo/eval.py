"""Held-out accuracy of a GRPO actor on the bundled task's problems: greedy answers through a
Hybrid Engine, scored by the accuracy reward (the number after `####` equal to the row's
`answer`): the trainer's own engine on its training state (`greedy_accuracy`), or a fresh step
and engine of a plain model (`exact_accuracy`, the notebook's before / after figures)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla.rlhf.grpo.config import GRPOConfig
from zeroxla.rlhf.grpo.prompts import prompt_rows
from zeroxla.rlhf.grpo.reward_funcs import accuracy_reward


def greedy_accuracy(engine: Any, state: Any, problems: Sequence[dict[str, Any]],
                    tokenizer: Any, config: GRPOConfig, eos_id: int | None) -> float:
    """The share of `problems` whose greedy answer (the Hybrid Engine `engine` generating from
    the training state `state`) states the row's `answer`."""
    ids = prompt_rows(problems, tokenizer, config.prompt_length).ids
    outputs = engine.generate(state, list(ids), max_new_tokens=config.max_completion_length,
                              temperature=0.0, eos_id=eos_id,
                              vocab_limit=getattr(tokenizer, "vocab_size", None))
    texts = [tokenizer.decode(row[prompt.size:]) for row, prompt in zip(outputs, ids)]
    return float(np.mean(accuracy_reward([], texts, answer=[p["answer"] for p in problems])))


def exact_accuracy(model: nnx.Module, problems: Sequence[dict[str, Any]], tokenizer: Any,
                   config: GRPOConfig, *, mesh: Any, eos_id: int | None,
                   inference_tp_size: int = 1) -> float:
    """`greedy_accuracy` of a plain `model` (held-out evaluation, through a Hybrid Engine on a
    fresh step of it)."""
    step = zeroxla.make_step(model, mesh, optimizer=optax.sgd(0.0),
                             config=zeroxla.ZeroConfig(stage=3))
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=inference_tp_size,
        max_out_tokens=config.prompt_length + config.max_completion_length))
    return greedy_accuracy(engine, step.init(0), problems, tokenizer, config, eos_id)


__all__ = ["exact_accuracy", "greedy_accuracy"]
