"""The training application: `zeroxla train`, `export`, `launch`, and their data, tokenizers and
sampling.

Nothing in the library imports this package; `import zeroxla` does not load it.

    cli.py           the `zeroxla` command
    cli_args.py      argparse value types, checks between options (a batch the --mesh
                     divides) and the simulated-device flag of every subcommand
    train_options.py `zeroxla train`'s option table: argparse, --resume, names, DeepSpeed
                     overrides, all generated from it
    train_cli.py     `zeroxla train`: the handler that turns the options into a job and runs it
    train.py         the training job (run: set up, loop, checkpoints, report)
    train_setup.py   setting a job up before its run directory is made (data, step, restore)
    train_data.py    what a job trains on: a text corpus or SFT pairs
    train_report.py  what a run reports: settings, loss curve, sample, summary
    train_end.py     how a run ends early with its training kept: a stop signal, divergence
    job.py           TrainJobConfig, and what --resume restores from a checkpoint
    job_model.py     the model a job trains: a models/ preset or a Hugging Face checkpoint
    recipe.py        the ZeRO config, optimizer, schedule and batch of a job (a --config JSON
                     read once, the job's options applied to it as typed overrides)
    chat_cli.py      `zeroxla reward` and `zeroxla ppo` on the command line
    chat_data.py     DeepSpeed-Chat's data: SFT examples, preference pairs, PPO prompts
    reward_job.py    `zeroxla reward`: DeepSpeed-Chat's step 2
    ppo_job.py       `zeroxla ppo`: DeepSpeed-Chat's step 3
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
