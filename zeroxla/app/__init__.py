"""The command-line application: `zeroxla train`, `reward`, `ppo`, `dpo`, `grpo`, `export`,
`generate`, `launch`, and their data and tokenizers; the jobs as TRL's trainers from Python.

Nothing in the library imports this package; `import zeroxla` does not load it.

    cli.py           the `zeroxla` command: every job's subcommand from its JobSpec, and
                     export, generate, launch
    cli_args.py      argparse value types, checks between options (a batch the --mesh
                     divides) and the simulated-device flag of every subcommand
    run/             the one runner every job runs under: the Job interface, the run
                     directory, checkpoints, signals, divergence, resume, the option rows
                     every job shares, the one command handler (its guide lists its modules)
    jobs/            each job's algorithm (train/, reward, ppo, dpo, grpo), the model loading
                     they share, and `zeroxla generate`; no job imports another
    trainers.py      the jobs from Python as TRL's trainers (SFTTrainer, RewardTrainer,
                     DPOTrainer, GRPOTrainer): a tree, the same job, the same runner
    trainer_args.py  the trainers' args (SFTConfig, ...): TRL's names onto each job's tree
    tokenizers/      character and byte tokenizers, Hugging Face tokenizer files, and
                     tokenizers as JSON records stored in checkpoints
    data.py          corpora, JSON data files (.jsonl, .json arrays), per-device batches, and
                     a job's examples: the validation split, per-epoch rows
    data_files.py    a data file as rows, the one reader of every --data / --prompts: JSON,
                     Parquet (streamed by record batch), a `datasets` directory and its split
    example_rows.py  a data file's rows as SFT examples, preference pairs, prompts
    prompt_files.py  GRPO's and PPO's prompt rows: chat prompts rendered, verl's ground_truth
    chat_data.py     DeepSpeed-Chat's data: SFT examples, preference pairs, PPO prompts
    learnable.py     pairs whose answers are the same tokens and rows with no loss token:
                     counted, reported, refused when nothing is left
    packing.py       packed rows: whole examples per row with segment ids and positions
                     (first-fit decreasing), the padded rows' loss in fewer rows
    chat_messages.py conversations (`messages`, TRL's conversational pairs) as rows and tokens
    chat_template.py a checkpoint's chat template, rendered with Jinja2, and the assistant's
                     tokens (the SFT loss mask)
    char_sft.py      the SFT warm-up of the character-level PPO demo
    interrupt.py     Ctrl-C and SIGTERM as requests to stop between steps
    distributed.py   the multi-process environment (ZEROXLA_*), jax.distributed start-up and
                     a job's --mesh on the devices
    launch.py        `zeroxla launch`: N local processes, supervised
    tiny_checkpoints.py   tiny random Hugging Face checkpoints for the tests and the demos
    sampling.py      text sampling from a trained model
"""
