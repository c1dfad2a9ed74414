"""`zeroxla train`: the training job, from its options to its report.

A job is one typed config tree (`config.TrainJobConfig`); everything before it makes the tree,
everything after it reads the tree. Nothing here imports JAX at package import: the command sets
the simulated device count first (`cli`), so import the modules you need.

    the job's settings
    config.py          TrainJobConfig and its sections (model, data, schedule, sharding, zeropp,
                       numerics, offload, pipeline, run, lora), each checked; the tree's ZeroConfig
    lora.py            the lora section (DeepSpeed-Chat's --lora_dim, ...) as a LoRAConfig;
                       the base a run's adapters apply to (export --adapter-only)
    defaults.py        where the defaults come from: ZeroConfig's, and JOB_DEFAULTS, the few the
                       job sets otherwise and why (read by config, --help and docs)
    defaults_table.py  the API's, the CLI's and a DeepSpeed JSON's defaults side by side
    options.py         the option table: argparse, --help, the tree fields each option sets,
                       DeepSpeed overrides, the names in messages
    resolve.py         options over a base tree, a --config JSON read into it: the job's tree
    resume.py          the tree in checkpoints, --resume (and an older zeroxla's flat records)
    cli.py             the `zeroxla train` handler: options -> tree -> run

    the run
    recipe.py          the tree built into the ZeroConfig, optimizer and schedule the step takes
    data.py            what a job trains on: a text corpus or SFT pairs
    model.py           the model: a models/ preset or a Hugging Face checkpoint
    prepare.py         setting a job up before its run directory is made (data, step, restore)
    loop.py            run(job): set up, loop, checkpoints, end, report
    end.py             how a run ends early with its training kept: a stop signal, divergence
    report.py          what a run reports: settings, loss curve, sample, summary

    from zeroxla.app.train import loop, resolve
    summary = loop.run(resolve.resolve_job({"steps": 100, "zero_stage": 2}))
"""
