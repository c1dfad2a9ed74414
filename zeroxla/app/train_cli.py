"""`zeroxla train` on the command line: its options, and the handler that turns them into a
`TrainJobConfig` (with `--resume`, the saved job's settings unless given again) and runs it.

As every subcommand (see `zeroxla.app.cli`): `add_train(subparsers)` declares the options and sets
`handler`; the handler sets the simulated device count (and starts `jax.distributed` in a
multi-process run) before importing anything that uses JAX.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from zeroxla.app.cli_args import set_host_device_count
from zeroxla.app.job import TrainJobConfig, resumed_fields  # no JAX use
from zeroxla.app.interrupt import exit_status, signal_name

# The exit status of a run stopped by a non-finite loss (a configuration error exits 2, a stop
# signal 128 + its number).
DIVERGED = 1
from zeroxla.app.train_options import add_options, describe_resume, explicit_fields


def add_train(subparsers: argparse._SubParsersAction) -> None:
    """Declares `zeroxla train` and sets its handler to `_run_train`. The options come in
    themes, in `--help` order: model and data, schedule, parallelism, the run."""
    p = subparsers.add_parser(
        "train", help="train a language model with ZeRO on a text file",
        description="Train a models/ preset, character- or byte-level, on a UTF-8 text file "
                    "(default: the bundled tiny-shakespeare) with zeroxla.make_step on a "
                    "(node, local) mesh. Writes metrics.jsonl, loss_curve.png, summary.json and "
                    "checkpoint/ to a run directory: a fresh runs/<model>-<YYYYmmdd-HHMMSS> "
                    "unless --out names one. Ctrl-C (SIGINT) or SIGTERM, at any moment, "
                    "finishes the running step, saves it and exits 130 or 143 (a second signal "
                    "stops at once); a non-finite loss stops the run, keeping its last finite "
                    "step as a checkpoint, and exits 1; --resume continues a run with its own "
                    "settings and tokenizer. Under `zeroxla launch` (or "
                    "ZEROXLA_DISTRIBUTED=auto) it runs as one process of a multi-process job.")
    add_options(p)
    p.set_defaults(handler=_run_train)


def _saved_job(resume: Any) -> dict:
    """The metadata `zeroxla train` stored in the checkpoint `--resume` names ({} if none).
    Reads JSON only: JAX is imported but no backend starts."""
    from zeroxla import checkpoint

    return checkpoint.read_metadata(resume.checkpoint_dir, resume.step)["metadata"]


def _set_device_count(mesh: tuple[int, int], env: Any, stages: int = 1) -> None:
    """Simulated CPU devices for this process: the mesh's, or its share of a multi-process mesh
    (unless XLA_FLAGS already has a count, as `zeroxla launch --devices-per-proc` sets it)."""
    from zeroxla.app.distributed import NUM_PROCESSES_ENV

    count = mesh[0] * mesh[1] * stages
    if env is not None and env.auto:
        return                  # a cluster: the devices are real, or the job script sets them
    if env is not None:
        if count % env.num_processes:
            raise ValueError(f"--mesh {mesh[0]}x{mesh[1]} has {count} devices, which the "
                             f"{env.num_processes} processes ({NUM_PROCESSES_ENV}) cannot share "
                             f"evenly; accepted: a mesh of a multiple of {env.num_processes} "
                             f"devices, e.g. {env.num_processes}x{mesh[1]}")
        count //= env.num_processes
    set_host_device_count(count)


def _run_train(args: argparse.Namespace) -> int:
    """Runs `zeroxla train`. Everything up to `distributed.initialize` only reads files: a bad
    option, a --out that holds another run or a --resume without checkpoints is refused before
    JAX starts a backend."""
    from zeroxla.app import distributed, rundir

    explicit = explicit_fields(args)
    if args.init_from is not None and args.model is not None:
        raise ValueError(f"--model {args.model} with --init-from {args.init_from}: the "
                         "checkpoint's config.json decides the model; give one of them")
    env = distributed.from_environ(os.environ)
    resume = rundir.locate_resume(args.resume) if args.resume else None
    if args.out_dir is not None:
        rundir.check_out_dir(args.out_dir, resuming=resume.run_dir if resume else None)
    saved = _saved_job(resume) if resume else {}
    job = TrainJobConfig(**resumed_fields(saved.get("job"), explicit))
    _set_device_count(job.mesh, env, job.pipeline_stages)
    if env is not None:
        distributed.initialize(env)
    import jax

    from zeroxla.app import train      # imports JAX: only after the flag is set

    primary = jax.process_index() == 0
    if resume and primary:
        print("\n".join(describe_resume(saved.get("settings"), explicit)), flush=True)
    try:
        summary = train.run(job)
    except train.TrainingInterrupted as stop:
        if primary:
            print(f"zeroxla train: interrupted ({signal_name(stop.signum)}) after step "
                  f"{stop.step}; saved checkpoint {stop.checkpoint_path}\nresume with: zeroxla "
                  f"train --resume {stop.run_dir}", file=sys.stderr, flush=True)
        return exit_status(stop.signum)
    except train.TrainingDiverged as err:
        if args.traceback:
            raise
        if primary:
            print(f"zeroxla train: error: {err}", file=sys.stderr, flush=True)
        return DIVERGED
    if primary:
        print(train.format_summary(summary), flush=True)
    return 0


__all__ = ["add_train"]
