"""PPO with actor and critic (DeepSpeed-Chat's step 3): the actor trained on the clipped
surrogate against a frozen reference, the critic on the clipped value loss, the rollouts drawn by
the Hybrid Engine and scored by a reward model or a program (zeroxla.rlhf's shared modules).

    config.py      PPOConfig: DeepSpeed-Chat's hyper-parameters, validated
    advantages.py  compute_rewards (KL penalty + clipped score), get_advantages_and_returns (GAE),
                   rewards_and_advantages (both, one program)
    losses.py      actor_loss_fn / critic_loss_fn (clipped), the make_step loss_fns
    trainer.py     PPOTrainer: one iteration (start / finish: its rollout side; experience,
                   train_rlhf)
    run.py         run_ppo: iterations of a PPOTrainer
"""
