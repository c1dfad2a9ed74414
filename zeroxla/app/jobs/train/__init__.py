"""`zeroxla train`: the training job, from its options to its report.

A job is one typed config tree (`config.TrainJobConfig`); everything before it makes the tree,
everything after it reads the tree. Nothing here imports JAX at package import: the command sets
the simulated device count first (`cli`), so import the modules you need.

    the job's settings
    config.py          TrainJobConfig and its sections (model, data, schedule, sharding, zeropp,
                       numerics, offload, pipeline, run, lora), each checked; the tree's ZeroConfig
    lora.py            the lora section (DeepSpeed-Chat's --lora_dim, ...) as a LoRAConfig
    defaults.py        where the defaults come from: ZeroConfig's, and JOB_DEFAULTS, the few the
                       job sets otherwise and why (read by config, --help and docs)
    defaults_table.py  the API's, the CLI's and a DeepSpeed JSON's defaults side by side
    options.py         train's rows (with the rows every job shares, `zeroxla.app.run.options`):
                       the tree fields each option sets, DeepSpeed overrides, the names in
                       messages
    resolve.py         options over a base tree, a --config JSON read into it: the job's tree
    resume.py          the tree in checkpoints, --resume (and an older zeroxla's flat records)
    cli.py             train's JobSpec: its rows and how its tree is made (a --config JSON,
                       --resume of a run an older zeroxla wrote); the handler is the runner's

    the run
    recipe.py          the tree built into the ZeroConfig, optimizer and schedule the step takes
    data.py            what a job trains on: a text corpus or SFT pairs
    model.py           the model: a models/ preset or a Hugging Face checkpoint
    prepare.py         setting a job up before its run directory is made (tokenizer, step)
    job.py             TrainJob, the algorithm the runner drives (`zeroxla.app.run.runner`:
                       run directory, checkpoints, signals, divergence, resume), and run(tree)
    report.py          what a run reports: settings, loss curve, sample, summary

    from zeroxla.app.jobs.train import job, resolve
    summary = job.run(resolve.resolve_job({"steps": 100, "zero_stage": 2}))
"""
