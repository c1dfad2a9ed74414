"""The training application: `zeroxla train`, `export`, `launch`, and their data, tokenizers and
sampling.

Nothing in the library imports this package; `import zeroxla` does not load it.

    cli.py           the `zeroxla` command
    train_cli.py     `zeroxla train`: its options, and the handler that runs the job
    train.py         the training job (run: set up, loop, checkpoints, report)
    train_setup.py   setting a job up before its run directory is made (data, step, restore)
    train_report.py  what a run reports: settings, loss curve, sample, summary
    job.py           TrainJobConfig, and what --resume restores from a checkpoint
    recipe.py        the ZeRO config, optimizer, schedule and batch of a job
    rundir.py        run directories: fresh names, no overwriting, what --resume accepts
    interrupt.py     Ctrl-C as a request to stop between steps
    distributed.py   the multi-process environment (ZEROXLA_*) and jax.distributed start-up
    launch.py        `zeroxla launch`: N local processes, supervised
    data.py          corpora and per-device batches
    tokenizer.py     character and byte tokenizers
    hf_tokenizer.py  the same as Hugging Face tokenizer files, for export
    sampling.py      text sampling from a trained model
"""
