"""The critic of step 3: DeepSpeed-Chat's `create_critic_model`
(`dschat/utils/model/model_utils.py`) builds a `RewardModel` and loads the step-2 reward model's
weights into it, so the critic *is* a reward model: `critic(tokens int32[B, T]) -> values
float32[B, T]`, the value of each prefix, from `base.hidden` and a `[D]` head.

`Critic(base)` takes any base with `hidden` (`models.GPT`, `models.Llama`); with a fresh zero
head its values start at 0 (the PPO trainer's default: the actor's weights, since the
programmatic reward has no reward model to start from). `critic_from_reward_model(rm)` is the
DeepSpeed-Chat start: a copy of a (trained) reward model, which gives the same values.
"""

from __future__ import annotations

from flax import nnx

from zeroxla.rlhf.reward_model import RewardModel

Critic = RewardModel


def critic_from_reward_model(reward_model: RewardModel) -> RewardModel:
    """A critic starting from `reward_model`'s weights (base and head): an independent copy,
    so training the critic leaves the reward model as it was."""
    if not isinstance(reward_model, RewardModel):
        raise TypeError(f"critic_from_reward_model(reward_model={type(reward_model).__name__}); "
                        "accepted: a zeroxla.rlhf.RewardModel (e.g. zeroxla.gathered_model of a "
                        "reward-model training state)")
    return nnx.clone(reward_model)
