"""A PPO run: `iterations` iterations of `PPOTrainer` (`trainer.py`, one iteration's rollout and
actor and critic updates), each iteration's record and rollout kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from zeroxla.lora import LoRAConfig
from zeroxla.rlhf.ppo.config import PPOConfig
from zeroxla.rlhf.ppo.trainer import PPOTrainer
from zeroxla.rlhf.reward import RewardFn
from zeroxla.rlhf.reward_model import RewardModel
from zeroxla.rlhf.rollout import Rollout


@dataclasses.dataclass
class PPORun:
    """What `run_ppo` returns: one record and one rollout per iteration, and the trainer (its
    `actor_state`, `critic_state`, `engine`)."""

    records: list[dict[str, float]]
    rollouts: list[Rollout]
    trainer: PPOTrainer


def run_ppo(config: PPOConfig, iterations: int, actor: nnx.Module, *, mesh: Any, tokenizer: Any,
            prompt_tokens: np.ndarray, reward_fn: RewardFn | None = None,
            reward_model: RewardModel | None = None, critic_init: RewardModel | None = None,
            inference_tp_size: int = 2, eos_id: int | None = None, seed: int = 0,
            on_iteration: Callable[[dict[str, float]], None] | None = None,
            lora: LoRAConfig | None = None) -> PPORun:
    """`iterations` PPO iterations from `actor` (see `PPOTrainer`, which also says what
    `reward_fn`, `reward_model` and `critic_init` choose), each `PPOTrainer.iteration`'s
    record and rollout. Iteration 0's times include compilation."""
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} is invalid; accepted: an integer >= 1")
    trainer = PPOTrainer(config, actor, mesh=mesh, tokenizer=tokenizer,
                         prompt_tokens=prompt_tokens, reward_fn=reward_fn,
                         reward_model=reward_model, critic_init=critic_init,
                         inference_tp_size=inference_tp_size, eos_id=eos_id, seed=seed,
                         lora=lora)
    records, rollouts = [], []
    for it in range(iterations):
        record, rollout = trainer.iteration(it)
        records.append(record)
        rollouts.append(rollout)
        if on_iteration is not None:
            on_iteration(record)
    return PPORun(records, rollouts, trainer)


__all__ = ["PPORun", "run_ppo"]
