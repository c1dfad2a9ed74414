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
from zeroxla.rlhf.iterations import check_iterations, run_iterations
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
    check_iterations(iterations)
    trainer = PPOTrainer(config, actor, mesh=mesh, tokenizer=tokenizer,
                         prompt_tokens=prompt_tokens, reward_fn=reward_fn,
                         reward_model=reward_model, critic_init=critic_init,
                         inference_tp_size=inference_tp_size, eos_id=eos_id, seed=seed,
                         lora=lora)
    records, rollouts = run_iterations(trainer, 0, iterations, on_iteration=on_iteration)
    return PPORun(records, rollouts, trainer)


__all__ = ["PPORun", "run_ppo"]
