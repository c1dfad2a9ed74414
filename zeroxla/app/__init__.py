"""The training application: `zeroxla train`, `export`, `launch`, and their data, tokenizers and
sampling.

Nothing in the library imports this package; `import zeroxla` does not load it.

    cli.py           the `zeroxla` command
    cli_args.py      argparse value types, checks between options (a batch the --mesh
                     divides) and the simulated-device flag of every subcommand
    train/           `zeroxla train`: the job's config tree, its options and defaults, the
                     recipe, data, model and run (its own guide lists its modules)
    chat_cli.py      `zeroxla reward` and `zeroxla ppo` on the command line
    chat_data.py     DeepSpeed-Chat's data: SFT examples, preference pairs, PPO prompts
    learnable.py     pairs whose answers are the same tokens and rows with no loss token:
                     counted, reported, refused when nothing is left
    chat_messages.py conversations (`messages`, TRL's conversational pairs) as rows and tokens
    chat_template.py a checkpoint's chat template, rendered with Jinja2, and the assistant's
                     tokens (the SFT loss mask)
    reward_job.py    `zeroxla reward`: DeepSpeed-Chat's step 2
    ppo_job.py       `zeroxla ppo`: DeepSpeed-Chat's step 3
    dpo_cli.py       `zeroxla dpo` on the command line
    dpo_job.py       `zeroxla dpo`: DPO (or IPO) of a causal LM on preference pairs
    grpo_cli.py      `zeroxla grpo` on the command line
    grpo_job.py      `zeroxla grpo`: the GRPO family with verifiable rewards (default: the
                     bundled arithmetic task), checkpoints, resume, export
    char_sft.py      the SFT warm-up of the character-level PPO demo
    rundir.py        run directories: fresh names, claimed under a lock, no overwriting, what
                     --resume accepts
    interrupt.py     Ctrl-C and SIGTERM as requests to stop between steps
    distributed.py   the multi-process environment (ZEROXLA_*), jax.distributed start-up and
                     a job's --mesh on the devices
    launch.py        `zeroxla launch`: N local processes, supervised
    data.py          corpora, JSON data files (.jsonl, .json arrays) and per-device batches
    tokenizer.py     character and byte tokenizers
    tokenizer_records.py  tokenizers as JSON records stored in checkpoints
    tiny_checkpoints.py   tiny random Hugging Face checkpoints for the tests and the demos
    hf_tokenizer.py  the same as Hugging Face tokenizer files, for export
    sampling.py      text sampling from a trained model
"""
