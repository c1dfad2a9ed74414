"""RLHF shaped like DeepSpeed-Chat's steps 2 and 3, on zeroxla: a reward model trained on
preference pairs, then PPO with actor and critic trained under ZeRO-3 (`make_step` with PPO
`loss_fn`s), a frozen reference, generation by the Hybrid Engine.

    config.py      PPOConfig: DeepSpeed-Chat's hyper-parameters, validated
    advantages.py  compute_rewards (KL penalty + clipped score), get_advantages_and_returns (GAE)
    losses.py      actor_loss_fn / critic_loss_fn (clipped), the make_step loss_fns
    reward_model.py RewardModel (base.hidden + a [D] value head), end_scores, the pairwise
                   loss_fn (pairwise_loss_terms) and validation (pair_metrics): step 2;
                   load_hf_reward_model (a HF *ForSequenceClassification, num_labels=1)
    critic.py      Critic = RewardModel; critic_from_reward_model (DeepSpeed-Chat's start)
    reward.py      an answer's score: a RewardModel's end score or a program (vowel fraction)
    reference.py   FrozenReference: the frozen reference, optionally int8 codes (MixZ++)
    rollout.py     Rollout: one iteration's experience as numpy arrays
    trainer.py     PPOTrainer (generate_experience, train_rlhf) and run_ppo
    plot.py        plot_records: the reward and KL curves
"""

from zeroxla.rlhf.advantages import compute_rewards, get_advantages_and_returns
from zeroxla.rlhf.config import PPOConfig
from zeroxla.rlhf.critic import Critic, critic_from_reward_model
from zeroxla.rlhf.losses import (actor_loss_fn, answer_logprobs, answer_values, critic_loss_fn,
                                 make_actor_loss, make_critic_loss)
from zeroxla.rlhf.plot import plot_records
from zeroxla.rlhf.reference import FrozenReference
from zeroxla.rlhf.reward import answer_end_scores, make_scorer, reward_scores, vowel_fraction
from zeroxla.rlhf.reward_model import (RewardModel, end_scores, load_hf_reward_model, pair_metrics,
                                       pair_scores, pairwise_loss_terms, with_vocab_size,
                                       without_lm_head)
from zeroxla.rlhf.rollout import Rollout, pad_answers
from zeroxla.rlhf.trainer import PPORun, PPOTrainer, run_ppo, time_split

__all__ = ["Critic", "FrozenReference", "PPOConfig", "PPORun", "PPOTrainer", "RewardModel", "Rollout",
           "actor_loss_fn", "answer_end_scores", "answer_logprobs", "answer_values",
           "compute_rewards", "critic_from_reward_model", "critic_loss_fn", "end_scores",
           "get_advantages_and_returns", "load_hf_reward_model", "make_actor_loss",
           "make_critic_loss", "make_scorer",
           "pad_answers", "pair_metrics", "pair_scores", "pairwise_loss_terms", "plot_records",
           "reward_scores", "run_ppo", "time_split", "vowel_fraction",
           "with_vocab_size", "without_lm_head"]
