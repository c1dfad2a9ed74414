"""Post-training on zeroxla: the GRPO family (GRPO, Dr.GRPO, DAPO, RLOO's baseline) on
verifiable rewards, with its bundled arithmetic task and the supervised fine-tuning before it;
DPO / IPO on preference pairs; a reward model on preference pairs and PPO with actor and critic
(DeepSpeed-Chat's steps 2 and 3). Each trains by a `make_step` with its own `loss_fn`; DPO,
PPO and GRPO against a frozen reference, PPO and GRPO generating by the Hybrid Engine. Each
algorithm has its folder (its config, losses and trainer, each guide listing its modules); what
two or more of them use lives here, and the roles they share are built once (roles.py).

    ppo/           PPO (DeepSpeed-Chat's step 3): config, advantages (rewards and GAE),
                   losses (actor and critic), trainer (PPOTrainer, run_ppo)
    grpo/          the GRPO family: config, group advantages, losses, reward functions and
                   verl's compute_score, the bundled task and its SFT, prompts, experience,
                   held-out accuracy, trainer (GRPOTrainer, run_grpo)
    dpo/           DPO / IPO: losses (DPOConfig, the losses over sequence log-prob sums),
                   trainer (DPOTrainer, run_dpo)
    roles.py       build_roles: the roles PPO, GRPO and DPO share (policy with LoRA adapters,
                   its ZeRO step, the Hybrid Engine); adapted, POLICY_ZERO
    reward_model.py RewardModel (base.hidden + a [D] value head), end_scores, the pairwise
                   loss_fn (pairwise_loss_terms) and validation (pair_metrics): step 2;
                   load_hf_reward_model (a HF *ForSequenceClassification, num_labels=1);
                   check_scoring_model (a reward model or critic start fits the actor)
    critic.py      Critic = RewardModel; critic_from_reward_model (DeepSpeed-Chat's start)
    reward.py      an answer's score: a RewardModel's end score (RewardScorer: read in a
                   frozen ZeRO-3 step's layout over the trainer's mesh) or a program
                   (vowel fraction)
    iterations.py  the iteration loop GRPO's and PPO's runs share (run_iterations) and the
                   iteration count's check
    rollout.py     Rollout: one iteration's experience as numpy arrays; DrawnAnswers: the
                   answers before the training group reads them; check_prompt_tokens (PPO's
                   and GRPO's rollouts both)
    plot.py        plot_records: the reward and KL curves (save_records_plot: to a file);
                   time_split: the records' seconds per phase
    packed_pairs.py preference pairs packed into rows with segment ids (a pair's two sequences
                   on one data replica; the sums are segment sums over its pair numbers): DPO's
                   and the reward model's
    rollout_correction.py the train/rollout log-prob gap (logprob_gap), truncated
                   importance sampling (tis_weights, TRL's vllm_importance_sampling_cap) and
                   verl's rollout-correction set (RolloutCorrection: IS per token, sequence or
                   geometric, IcePop's band, k1/k2/k3 rejection, bypass)
    packed_rollout.py a rollout as a packed batch (sequences whole in rows with segment ids,
                   rows balanced over the data replicas): the padded loss without the padding
    answer_values.py the answer log-prob / value functions every algorithm reads (padded rows,
                   ragged prompts, packed batches)
    answer_forward.py every per-token read of a trainer (old and reference log-probs, values) in
                   the step's layout (AnswerForward), the reference as the first partitions
                   (float, or int8 codes read through engine.frozen_codes)
    rollout_fields.py the rollout-side config fields GRPO and PPO share (routing_replay,
                   rollout_dtype, batch_invariant, rollout_devices, max_staleness) and their
                   one check
    async_rollouts.py the asynchronous pipeline GRPO and PPO share: the mesh split into
                   training and rollout groups (split_mesh) and the rollouts drawn ahead with
                   bounded staleness (AsyncRollouts: versions, syncs, the dispatch events)
    partial_rollout.py a rollout drawn in passes (verl's partial rollout): PartialAnswers
                   (each token's engine log-prob and version), continue_answers (unfinished
                   answers continued from their tokens)
"""

from zeroxla.rlhf.ppo.advantages import compute_rewards, get_advantages_and_returns
from zeroxla.rlhf.ppo.config import PPOConfig
from zeroxla.rlhf.grpo.config import GRPOConfig
from zeroxla.rlhf.grpo.group_advantages import group_advantages
from zeroxla.rlhf.grpo.losses import (clip_fractions, grpo_loss, grpo_loss_parts, grpo_loss_terms,
                                      make_grpo_loss)
from zeroxla.rlhf.grpo.run import GRPORun, run_grpo
from zeroxla.rlhf.grpo.trainer import GRPORollout, GRPOTrainer
from zeroxla.rlhf.grpo.eval import exact_accuracy
from zeroxla.rlhf.rollout_correction import logprob_gap, tis_weights
from zeroxla.rlhf.grpo.reward_funcs import (RewardFunctionError, RewardFunctions, accuracy_reward,
                                            extract_answer, format_reward, load_reward_func)
from zeroxla.rlhf.grpo.task_sft import supervised_finetune_rows
from zeroxla.rlhf.critic import Critic, critic_from_reward_model
from zeroxla.rlhf.dpo.losses import DPOConfig, dpo_loss_terms, dpo_metrics, make_dpo_loss
from zeroxla.rlhf.dpo.trainer import DPORun, DPOTrainer, run_dpo
from zeroxla.rlhf.ppo.losses import (actor_loss_fn, answer_logprobs, answer_values,
                                     critic_loss_fn, make_actor_loss, make_critic_loss)
from zeroxla.rlhf.reward import answer_end_scores, make_scorer, reward_scores, vowel_fraction
from zeroxla.rlhf.reward_model import (RewardModel, end_scores, load_hf_reward_model, pair_metrics,
                                       pair_scores, pairwise_loss_terms, with_vocab_size,
                                       without_lm_head)
from zeroxla.rlhf.rollout import Rollout, pad_answers
from zeroxla.rlhf.plot import plot_records, time_split
from zeroxla.rlhf.ppo.run import PPORun, run_ppo
from zeroxla.rlhf.ppo.trainer import PPOTrainer

__all__ = ["DPOConfig", "DPORun", "DPOTrainer", "dpo_loss_terms", "dpo_metrics", "make_dpo_loss",
           "run_dpo",
           "Critic", "GRPOConfig", "GRPORollout", "GRPORun",
           "GRPOTrainer", "RewardFunctionError", "RewardFunctions", "accuracy_reward",
           "exact_accuracy", "extract_answer", "format_reward", "load_reward_func", "run_grpo",
           "supervised_finetune_rows", "PPOConfig", "PPORun", "PPOTrainer", "RewardModel", "Rollout",
           "actor_loss_fn", "answer_end_scores", "clip_fractions", "answer_logprobs", "answer_values",
           "compute_rewards", "critic_from_reward_model", "critic_loss_fn", "end_scores",
           "get_advantages_and_returns", "group_advantages", "grpo_loss", "logprob_gap",
           "grpo_loss_parts", "grpo_loss_terms", "make_grpo_loss", "load_hf_reward_model", "make_actor_loss",
           "make_critic_loss", "make_scorer",
           "pad_answers", "pair_metrics", "pair_scores", "pairwise_loss_terms", "plot_records",
           "reward_scores", "run_ppo", "time_split", "tis_weights", "vowel_fraction",
           "with_vocab_size", "without_lm_head"]
