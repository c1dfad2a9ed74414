"""Post-training on zeroxla: the GRPO family (GRPO, Dr.GRPO, DAPO, RLOO's baseline) on
verifiable rewards, with its bundled arithmetic task and the supervised fine-tuning before it;
DPO / IPO on preference pairs; a reward model on preference pairs and PPO with actor and critic
(DeepSpeed-Chat's steps 2 and 3). Each trains by a `make_step` with its own `loss_fn`; DPO,
PPO and GRPO against a frozen reference, PPO and GRPO generating by the Hybrid Engine. Each
algorithm's trainer, config and losses carry its prefix (ppo_, grpo, dpo);
the roles they share are built once (roles.py).

    roles.py       build_roles: the roles PPO, GRPO and DPO share (policy with LoRA adapters,
                   its ZeRO step, the Hybrid Engine); adapted, POLICY_ZERO
    ppo_config.py  PPOConfig: DeepSpeed-Chat's hyper-parameters, validated
    advantages.py  compute_rewards (KL penalty + clipped score), get_advantages_and_returns (GAE),
                   rewards_and_advantages (both, one program)
    ppo_losses.py  actor_loss_fn / critic_loss_fn (clipped), the make_step loss_fns
    reward_model.py RewardModel (base.hidden + a [D] value head), end_scores, the pairwise
                   loss_fn (pairwise_loss_terms) and validation (pair_metrics): step 2;
                   load_hf_reward_model (a HF *ForSequenceClassification, num_labels=1);
                   check_scoring_model (a reward model or critic start fits the actor)
    critic.py      Critic = RewardModel; critic_from_reward_model (DeepSpeed-Chat's start)
    reward.py      an answer's score: a RewardModel's end score or a program (vowel fraction)
    rollout.py     Rollout: one iteration's experience as numpy arrays; DrawnAnswers: the
                   answers before the training group reads them; check_prompt_tokens
    ppo_trainer.py PPOTrainer (start / finish: its rollout side; experience, train_rlhf) and
                   run_ppo
    plot.py        plot_records: the reward and KL curves (save_records_plot: to a file);
                   time_split: the records' seconds per phase
    dpo.py         DPOConfig, the DPO / IPO losses over per-sequence log-prob sums, their
                   metrics (accuracy, margins) and the make_step loss_fn
    packed_pairs.py DPO's pairs packed into rows with segment ids (a pair's two sequences on
                   one data replica; the sums are segment sums over its pair numbers)
    dpo_trainer.py DPOTrainer (the policy's ZeRO step, reference sums computed once) and run_dpo
    grpo_config.py GRPOConfig: the GRPO family's knobs (TRL's GRPOConfig names), validated
    group_advantages.py group_advantages: group-relative (or RLOO) advantages, scaled by std
    grpo_losses.py the clipped surrogate with clip-higher, k3 KL, grpo|dr_grpo|dapo aggregation
    reward_funcs.py reward functions (prompts, completions, **fields) -> rewards: the built-in
                   accuracy and format checks, weighted sums, failures named
    verl_score.py  verl's compute_score(data_source, solution_str, ground_truth, extra_info)
                   called as verl calls it, once per answer
    arithmetic_task.py the bundled task: arithmetic word problems with `####` answers, by seed
    task_sft.py    supervised fine-tuning on prompt/completion rows (loss on the completion)
    grpo_prompts.py prompts tokenized up to the cap (a longer one keeps its last tokens, the
                   cut counted) and the text the reward functions see
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
    grpo_eval.py   held-out greedy accuracy through a Hybrid Engine: exact_accuracy
    grpo_experience.py an iteration's experience as data: DrawnRollout (the rollout side),
                   GRPORollout (with the training group's log-probs), iteration_record
    async_rollouts.py the asynchronous pipeline GRPO and PPO share: the mesh split into
                   training and rollout groups (split_mesh) and the rollouts drawn ahead with
                   bounded staleness (AsyncRollouts: versions, syncs, the dispatch events)
    partial_rollout.py a rollout drawn in passes (verl's partial rollout): PartialAnswers
                   (each token's engine log-prob and version), continue_answers (unfinished
                   answers continued from their tokens), finish_rollout (scored: DrawnRollout)
    grpo.py        GRPOTrainer (generate_experience, train_grpo), run_grpo
"""

from zeroxla.rlhf.advantages import compute_rewards, get_advantages_and_returns
from zeroxla.rlhf.ppo_config import PPOConfig
from zeroxla.rlhf.grpo_config import GRPOConfig
from zeroxla.rlhf.group_advantages import group_advantages
from zeroxla.rlhf.grpo_losses import (clip_fractions, grpo_loss, grpo_loss_parts, grpo_loss_terms,
                                      make_grpo_loss)
from zeroxla.rlhf.grpo import GRPORollout, GRPORun, GRPOTrainer, run_grpo
from zeroxla.rlhf.grpo_eval import exact_accuracy
from zeroxla.rlhf.rollout_correction import logprob_gap, tis_weights
from zeroxla.rlhf.reward_funcs import (RewardFunctionError, RewardFunctions, accuracy_reward,
                                       extract_answer, format_reward, load_reward_func)
from zeroxla.rlhf.task_sft import supervised_finetune_rows
from zeroxla.rlhf.critic import Critic, critic_from_reward_model
from zeroxla.rlhf.dpo import DPOConfig, dpo_loss_terms, dpo_metrics, make_dpo_loss
from zeroxla.rlhf.dpo_trainer import DPORun, DPOTrainer, run_dpo
from zeroxla.rlhf.ppo_losses import (actor_loss_fn, answer_logprobs, answer_values,
                                     critic_loss_fn, make_actor_loss, make_critic_loss)
from zeroxla.rlhf.reward import answer_end_scores, make_scorer, reward_scores, vowel_fraction
from zeroxla.rlhf.reward_model import (RewardModel, end_scores, load_hf_reward_model, pair_metrics,
                                       pair_scores, pairwise_loss_terms, with_vocab_size,
                                       without_lm_head)
from zeroxla.rlhf.rollout import Rollout, pad_answers
from zeroxla.rlhf.plot import plot_records, time_split
from zeroxla.rlhf.ppo_trainer import PPORun, PPOTrainer, run_ppo

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
