"""The run every job has: one runner, one resume contract, one option table.

A job (`zeroxla.app.jobs`) supplies its config tree, its option rows and its algorithm; what a
run does around the algorithm is here, the same for every job.

    job.py       the Job interface the runner drives, and the tree sections every job shares
                 (RunSettings: seed, cadence, --out, --resume; ShardingSettings: mesh, stage)
    runner.py    run(job): the run directory claimed, the loop, checkpoints and retention,
                 metrics.jsonl, the progress bar, stop signals, divergence, summary.json,
                 export; the failure rule (a directory that holds a checkpoint stays)
    resume.py    the job recorded in every checkpoint, and --resume: the recorded tree back,
                 the command line's changes said, an edited data file refused
    options.py   Option rows and OptionTable (argparse, --help, the tree of the given options);
                 the rows every job shares: the run's, --mesh / --zero-stage, LoRA's
    command.py   JobSpec, and the one handler: options -> tree -> devices -> job -> run
    trackers.py  --report-to: each metrics.jsonl record, the tree and the summary also to
                 TensorBoard, W&B, MLflow (their own clients, optional extras)
    rundir.py    run directories: fresh names, claimed under a lock, no overwriting, the
                 failure rule (a directory that holds a checkpoint stays), what --resume
                 accepts, metrics.jsonl
"""
