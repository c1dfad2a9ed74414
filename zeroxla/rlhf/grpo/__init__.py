"""The GRPO family (GRPO, Dr.GRPO, DAPO, RLOO's baseline) on verifiable rewards: groups of
answers per prompt drawn by the Hybrid Engine, scored by reward functions, trained on the clipped
surrogate with group-relative advantages; with its bundled arithmetic task and the supervised
fine-tuning before it.

    config.py      GRPOConfig: the GRPO family's knobs (TRL's GRPOConfig names), validated
    group_advantages.py group_advantages: group-relative (or RLOO) advantages, scaled by std
    losses.py      the clipped surrogate with clip-higher, k3 KL, grpo|dr_grpo|dapo aggregation
    reward_funcs.py reward functions (prompts, completions, **fields) -> rewards: the built-in
                   accuracy and format checks, weighted sums, failures named
    verl_score.py  verl's compute_score(data_source, solution_str, ground_truth, extra_info)
                   called as verl calls it, once per answer
    arithmetic_task.py the bundled task: arithmetic word problems with `####` answers, by seed
    task_sft.py    supervised fine-tuning on prompt/completion rows (loss on the completion)
    prompts.py     prompts tokenized up to the cap (a longer one keeps its last tokens, the
                   cut counted) and the text the reward functions see
    eval.py        held-out greedy accuracy through a Hybrid Engine: exact_accuracy
    experience.py  an iteration's experience as data: DrawnRollout (the rollout side),
                   GRPORollout (with the training group's log-probs), finish_rollout (a
                   rollout drawn in passes, scored), iteration_record
    trainer.py     GRPOTrainer: one iteration (generate_experience, train_grpo)
    run.py         run_grpo: iterations of a GRPOTrainer to an end or a stop request
"""
