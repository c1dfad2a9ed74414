"""The jobs, each its algorithm alone: its config tree, its option rows, and the `Job` the
runner drives (`zeroxla.app.run`). No job imports another.

    loading.py   the models jobs start from: trained runs, Hugging Face directories, reward
                 models, adapters (shared by every job)
    train/       `zeroxla train`: a language model on a text file or prompt/response pairs
                 (its own guide lists its modules)
    reward.py    `zeroxla reward`: DeepSpeed-Chat's step 2, a reward model on preference pairs
    ppo.py       `zeroxla ppo`: DeepSpeed-Chat's step 3, PPO from the SFT and reward runs
    dpo.py       `zeroxla dpo`: DPO / IPO of a causal LM on preference pairs
    grpo.py      `zeroxla grpo`: the GRPO family with verifiable rewards (default: the
                 bundled arithmetic task)
    generate.py  `zeroxla generate`: a trained run continued from a prompt (no run directory)
    plan.py      `zeroxla plan`: what fits a device, by compile only (no run directory)
"""
