"""`zeroxla train` on the command line: its options, and the handler that turns them into a
job's config tree (`zeroxla.app.train.resolve`; with `--resume`, the saved run's tree with the
options given over it) and runs it.

As every subcommand (see `zeroxla.app.cli`): `add_train(subparsers)` declares the options and sets
`handler`; the handler sets the simulated device count (and starts `jax.distributed` in a
multi-process run) before anything starts a JAX backend. A `--config` JSON is read with the
options, before that: the keys it ignores are printed as "warning: ..." lines.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

from zeroxla.app.cli_args import set_host_device_count
from zeroxla.app.interrupt import exit_status, signal_name
from zeroxla.app.train.options import add_options, given_options
from zeroxla.app.train.resume import describe_resume, saved_job
from zeroxla.deepspeed.checks import DeepSpeedConfigWarning

# The exit status of a run stopped by a non-finite loss (a configuration error exits 2, a stop
# signal 128 + its number).
DIVERGED = 1


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


def _saved_metadata(resume: Any) -> dict:
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


def _resolve(saved: dict, given: dict[str, Any]) -> tuple[Any, list[str]]:
    """(the job's tree, a line for each DeepSpeed key without effect in its --config JSON)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeepSpeedConfigWarning)
        job = saved_job(saved, given)
    lines = []
    for w in caught:          # DeepSpeed keys without effect: one plain line each
        if issubclass(w.category, DeepSpeedConfigWarning):
            lines.append(f"warning: {w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return job, lines


def _run_train(args: argparse.Namespace) -> int:
    """Runs `zeroxla train`. Everything up to `distributed.initialize` only reads files: a bad
    option, a --out that holds another run or a --resume without checkpoints is refused before
    JAX starts a backend."""
    from zeroxla.app import distributed, rundir

    given = given_options(args)
    if args.init_from is not None and args.model is not None:
        raise ValueError(f"--model {args.model} with --init-from {args.init_from}: the "
                         "checkpoint's config.json decides the model; give one of them")
    env = distributed.from_environ(os.environ)
    resume = rundir.locate_resume(args.resume) if args.resume else None
    if args.out_dir is not None:
        rundir.check_out_dir(args.out_dir, resuming=resume.run_dir if resume else None)
    saved = _saved_metadata(resume) if resume else {}
    job, warned = _resolve(saved, given)
    _set_device_count(job.sharding.mesh, env, job.pipeline.stages)
    if env is not None:
        distributed.initialize(env)
    import jax

    from zeroxla.app.train import loop      # imports JAX: only after the flag is set
    from zeroxla.app.train.report import format_summary

    primary = jax.process_index() == 0
    if primary and warned:
        print("\n".join(warned), flush=True)
    if resume and primary:
        print("\n".join(describe_resume(saved.get("settings"), given)), flush=True)
    try:
        summary = loop.run(job)
    except loop.TrainingInterrupted as stop:
        if primary:
            print(f"zeroxla train: interrupted ({signal_name(stop.signum)}) after step "
                  f"{stop.step}; saved checkpoint {stop.checkpoint_path}\nresume with: zeroxla "
                  f"train --resume {stop.run_dir}", file=sys.stderr, flush=True)
        return exit_status(stop.signum)
    except loop.TrainingDiverged as err:
        if args.traceback:
            raise
        if primary:
            print(f"zeroxla train: error: {err}", file=sys.stderr, flush=True)
        return DIVERGED
    if primary:
        print(format_summary(summary), flush=True)
    return 0


__all__ = ["add_train"]
