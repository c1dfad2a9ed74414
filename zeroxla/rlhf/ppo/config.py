"""`PPOConfig`: the knobs of DeepSpeed-Chat's step 3 (`training/step3_rlhf_finetuning`) as one
frozen dataclass. Field names are DeepSpeed-Chat's (`ppo_trainer.py`, `main.py` arguments):

  kl_ctl              weight of the per-token KL penalty against the frozen reference
  clip_reward_value   the reward model's score is clipped to [-clip_reward_value, +...]
  cliprange           PPO ratio clip epsilon (policy loss)
  cliprange_value     value clip around the rollout's values (value loss)
  gamma, lam          GAE discount and trace decay
  ppo_epochs          passes over each rollout batch
  actor_lr, critic_lr learning rates (AdamW, as DeepSpeed-Chat's FusedAdam)
  generation_batch_numbers -> here `prompts_per_iteration`, rows per rollout
  prompt_length, max_answer_seq_len -> `prompt_length`, `answer_length` (tokens)

The rollout samples at temperature 1 from the actor's own distribution, so the log-probabilities
of the behaviour policy are the actor's (no temperature enters the PPO ratio). `rollout_corr` is
verl's rollout correction of the train/rollout log-prob gap, as GRPO's
(`zeroxla.rlhf.rollout_correction.RolloutCorrection`): importance weights on the policy term,
rejected tokens out of the loss and its count, or the rollout's log-probs as pi_old (bypass).
`routing_replay` is GRPO's routing replay (R3, `GRPOConfig.routing_replay`) for an MoE actor:
"measure" records the experts each layer chose for every token of the rollout (either
batching) and logs `routing/mismatch`, the (token, layer) pairs the actor's forward routes
otherwise; "on" also replays the record in the actor's old, the reference's and the trained
log-probs; "off" records nothing; "auto" (the default) is GRPO's: "on" for an MoE actor, "off"
for a dense one or, with a warning naming why, where "on" cannot run (resolved by the trainer,
`roles.resolve_routing_replay`). "measure" and "on" need `packing`. `rollout_dtype` is GRPO's
(`GRPOConfig.rollout_dtype`): "bfloat16" rolls out in bf16 against the float32 masters.
`batch_invariant` is GRPO's (`GRPOConfig.batch_invariant`, a Llama or MoE Llama actor): the actor,
and so the reference read through its forward, is rebuilt in the batch-invariant mode, so at
inference_tp_size=1 the rollout's log-probs equal the actor's training forward's exactly. The
critic stays in the default mode: its values are never compared with the rollout's.
`rollout_devices` and `max_staleness` are GRPO's (`GRPOConfig.rollout_devices`,
`zeroxla.rlhf.async_rollouts`): the last N devices a rollout group drawing iteration i's
answers from the actor of iteration >= i - k while the first ones train actor and critic; the
old log-probs, values, rewards and GAE are the training group's, of the actor at i.
`rollout_corr=RolloutCorrection.decoupled(cap)` is AReaL's decoupled objective for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroxla.rlhf.rollout_fields import check_async_fields, check_rollout_fields
from zeroxla.rlhf.rollout_correction import RolloutCorrection


def _check(name: str, value: Any, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"PPOConfig.{name}={value!r} is invalid; accepted: {accepted}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """DeepSpeed-Chat's PPO hyper-parameters (defaults are its own where it has one) plus the
    rollout shape. Every field is validated; a bad value is a ValueError naming it."""

    kl_ctl: float = 0.1
    clip_reward_value: float = 5.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 1
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    prompts_per_iteration: int = 32
    prompt_length: int = 16
    answer_length: int = 32
    # The frozen reference as int8 codes (ZeRO++'s MixZ++) of the actor's first partitions,
    # 1/N per device, dequantized per layer (`answer_forward.reference_partitions`).
    reference_int8: bool = False
    # Actor and critic train on the rollout packed into rows with segment ids, balanced over the
    # data replicas (`zeroxla.rlhf.packed_rollout`): the same token means without the padding.
    packing: bool = True
    # verl's token budget (`use_dynamic_bsz`): packed rows of this many tokens per device, each
    # replica's rows its micro-batches, gradients accumulated (`packed_rollout.pack_for_step`).
    ppo_max_token_len_per_gpu: int | None = None
    # verl's rollout correction (the module docstring); the default corrects nothing.
    rollout_corr: RolloutCorrection = RolloutCorrection()
    # routing replay (R3) of an MoE actor: "auto" | "off" | "measure" | "on" (the docstring).
    routing_replay: str = "auto"
    # the rollout engine's dtype: "float32" | "bfloat16" (`HybridEngineConfig.rollout_dtype`).
    rollout_dtype: str = "float32"
    # the actor in the batch-invariant mode (`roles.batch_invariant_policy`; the docstring).
    batch_invariant: bool = False
    # asynchronous PPO: the rollout group's devices and the rollouts' lag (the docstring).
    rollout_devices: int = 0
    max_staleness: int = 0

    def __post_init__(self) -> None:
        for name in ("kl_ctl", "clip_reward_value", "cliprange", "cliprange_value"):
            value = getattr(self, name)
            ok = _is_number(value) and value >= 0 and (name == "kl_ctl" or value > 0)
            _check(name, value, ok, "a number >= 0" if name == "kl_ctl" else "a number > 0")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            _check(name, value, _is_number(value) and 0 <= value <= 1, "a number in [0, 1]")
        for name in ("actor_lr", "critic_lr"):
            value = getattr(self, name)
            _check(name, value, _is_number(value) and value > 0, "a number > 0")
        for name in ("reference_int8", "packing"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool),
                   "True or False")
        for name in ("ppo_epochs", "prompts_per_iteration", "prompt_length", "answer_length"):
            value = getattr(self, name)
            _check(name, value, _is_int(value) and value >= 1, "an integer >= 1")
        budget = self.ppo_max_token_len_per_gpu
        _check("ppo_max_token_len_per_gpu", budget, budget is None or (
            _is_int(budget) and budget >= 1 and self.packing),
            "None or an integer >= 1 with packing=True (the packed rows' length per device)")
        _check("rollout_corr", self.rollout_corr, isinstance(
            self.rollout_corr, RolloutCorrection) and not self.rollout_corr.kl_weighted,
            "a RolloutCorrection with kl_weighted=False (PPO's KL is in the rewards, not a "
            "term of the loss to weight)")
        check_rollout_fields(self, _check)
        check_async_fields(self, _check)

    @classmethod
    def vowels_demo(cls) -> "PPOConfig":
        """The example's and notebook's settings: a tiny GPT raising the vowel reward in ~15
        iterations. The score is a fraction in [0, 1], so the KL weight is 0.01 (DeepSpeed-Chat's
        0.1 is sized for reward-model scores of order 1 per answer and here outweighs it); four
        PPO epochs per rollout at 3e-3 make each rollout count."""
        return cls(kl_ctl=0.01, actor_lr=3e-3, critic_lr=3e-3, ppo_epochs=4,
                   prompts_per_iteration=64, prompt_length=16, answer_length=32)

    def replace(self, **changes: Any) -> "PPOConfig":
        return dataclasses.replace(self, **changes)
