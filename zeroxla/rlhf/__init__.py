"""RLHF with PPO, shaped like DeepSpeed-Chat's step 3, on zeroxla: actor and critic trained under
ZeRO-3 (`make_step` with PPO `loss_fn`s), a frozen reference, generation by the Hybrid Engine.

    config.py      PPOConfig: DeepSpeed-Chat's hyper-parameters, validated
    advantages.py  compute_rewards (KL penalty + clipped score), get_advantages_and_returns (GAE)
    losses.py      actor_loss_fn / critic_loss_fn (clipped), the make_step loss_fns
    critic.py      Critic: the actor's GPT with a scalar value head
    reward.py      the programmatic reward (vowel fraction of the answer text)
    rollout.py     Rollout: one iteration's experience as numpy arrays
    sft.py         a short supervised fine-tune to start from
    trainer.py     PPOTrainer (generate_experience, train_rlhf) and run_ppo
    plot.py        plot_records: the reward and KL curves
"""

from zeroxla.rlhf.advantages import compute_rewards, get_advantages_and_returns
from zeroxla.rlhf.config import PPOConfig
from zeroxla.rlhf.critic import Critic
from zeroxla.rlhf.losses import (actor_loss_fn, answer_logprobs, answer_values, critic_loss_fn,
                                 make_actor_loss, make_critic_loss)
from zeroxla.rlhf.plot import plot_records
from zeroxla.rlhf.reward import reward_scores, vowel_fraction
from zeroxla.rlhf.rollout import Rollout, pad_answers
from zeroxla.rlhf.sft import supervised_finetune
from zeroxla.rlhf.trainer import PPORun, PPOTrainer, run_ppo, time_split

__all__ = ["Critic", "PPOConfig", "PPORun", "PPOTrainer", "Rollout", "actor_loss_fn",
           "answer_logprobs", "answer_values", "compute_rewards", "critic_loss_fn",
           "get_advantages_and_returns", "make_actor_loss", "make_critic_loss", "pad_answers", "plot_records",
           "reward_scores", "run_ppo", "supervised_finetune", "time_split", "vowel_fraction"]
