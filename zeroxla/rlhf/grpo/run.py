"""A GRPO run: iterations of `GRPOTrainer` (`trainer.py`, one iteration's rollout and update)
from a start to an end or a stop request, each iteration's record and rollout kept; what the
`zeroxla grpo` job and the notebook call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from zeroxla.lora import LoRAConfig
from zeroxla.rlhf.grpo.config import GRPOConfig
from zeroxla.rlhf.grpo.experience import GRPORollout
from zeroxla.rlhf.grpo.reward_funcs import RewardFunctions
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from zeroxla.rlhf.iterations import check_iterations, run_iterations


@dataclasses.dataclass
class GRPORun:
    """What `run_grpo` returns: one record and one rollout per iteration, and the trainer."""

    records: list[dict[str, Any]]
    rollouts: list[GRPORollout]
    trainer: GRPOTrainer


def run_grpo(config: GRPOConfig, iterations: int, actor: nnx.Module, *, mesh: Any,
             tokenizer: Any, prompts: Sequence[dict[str, Any]],
             reward_funcs: RewardFunctions | Sequence[Callable] = (), reward_model: Any = None,
             reward_model_weight: float = 1.0, inference_tp_size: int = 2,
             eos_id: int | None = None, seed: int = 0, trainer: GRPOTrainer | None = None,
             start_iteration: int = 0, should_stop: Callable[[], bool] = lambda: False,
             on_iteration: Callable[[dict[str, Any]], None] | None = None,
             lora: LoRAConfig | None = None) -> GRPORun:
    """Iterations `start_iteration` .. `iterations - 1` of the GRPO family from `actor` (see
    `GRPOTrainer` for the arguments; `trainer` continues an existing one, e.g. restored).
    `should_stop()` is read before each iteration (a stop request: the run returns early).
    Each record (`iteration_record`) holds the seconds spent in `generation_s` (Hybrid
    Engine), `scoring_s` and `training_s` (the first's including compilation), and the
    engine's tokens/s, prefill and KV pages (`rollout.generation_stats`)."""
    check_iterations(iterations)
    if trainer is None:
        trainer = GRPOTrainer(config, actor, mesh=mesh, tokenizer=tokenizer, prompts=prompts,
                              reward_funcs=reward_funcs, reward_model=reward_model,
                              reward_model_weight=reward_model_weight,
                              inference_tp_size=inference_tp_size, eos_id=eos_id, seed=seed,
                              lora=lora)
    records, rollouts = run_iterations(trainer, start_iteration, iterations, should_stop,
                                       on_iteration)
    return GRPORun(records, rollouts, trainer)


__all__ = ["GRPORun", "run_grpo"]
