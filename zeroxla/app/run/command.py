"""A job on the command line: its subcommand from its rows, and the one handler every job has.

    add_job(subparsers, DPO_SPEC)       # `zeroxla dpo`, its --help generated from the rows

The handler reads the options, makes the job's tree (a fresh one from the defaults, or with
`--resume` the run's recorded tree with the given options over it: `run.resume`), sets the
simulated device count (and starts `jax.distributed` in a multi-process run) before anything
starts a JAX backend, builds the job (everything that can fail on an option, a file or a model
fails here, before any directory exists) and runs it under the runner. Exit status: 0, 1 after
a divergence, 2 for a configuration error (`zeroxla.app.cli`), 128 + the signal after a stop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from zeroxla.app.cli_args import set_host_device_count
from zeroxla.app.run.options import OptionTable
from zeroxla.app.run.trackers import check_installed

DIVERGED = 1          # the exit status of a run stopped by a non-finite loss


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job as the command line sees it.

    table: its rows over its tree type. job: the `Job` class, built from a tree (importing it
    starts no JAX backend; building it does). devices: the devices a tree's mesh needs.
    report: the lines printed from the summary at the end (default: the summary as JSON, its
    settings left out). required: the tree's own fields a fresh run must be given, with what
    they accept. make_tree: (given options, the resumed checkpoint's metadata or None) -> (tree,
    lines), for a job whose tree is made otherwise than from its rows alone (`zeroxla train`: a
    DeepSpeed JSON read with the options, an older zeroxla's checkpoint records).
    """

    name: str
    help: str
    description: str
    table: OptionTable
    job: type
    required: Mapping[str, str] = dataclasses.field(default_factory=dict)
    devices: Callable[[Any], int] = lambda tree: tree.sharding.mesh[0] * tree.sharding.mesh[1]
    report: Callable[[dict[str, Any]], str] | None = None
    make_tree: Callable[[Mapping[str, Any], Mapping[str, Any] | None],
                        tuple[Any, list[str]]] | None = None


def add_job(subparsers: argparse._SubParsersAction, spec: JobSpec) -> None:
    """Declares `zeroxla <spec.name>` from its rows and sets the handler."""
    parser = subparsers.add_parser(spec.name, help=spec.help, description=spec.description)
    spec.table.add_to(parser)
    parser.set_defaults(handler=lambda args: run_command(spec, args))


def resolve(spec: JobSpec, given: Mapping[str, Any]) -> tuple[Any, Any, list[str]]:
    """(the tree, the resume point or None, lines to print) of the given options; reads files
    only (no JAX backend starts)."""
    from zeroxla import checkpoint
    from zeroxla.app.run import rundir
    from zeroxla.app.run.resume import RECORD_KEY, check_data, data_paths, resumed_tree

    table = spec.table
    point = rundir.locate_resume(given["resume"]) if given.get("resume") is not None else None
    if given.get("out_dir") is not None:
        rundir.check_out_dir(given["out_dir"], resuming=point.run_dir if point else None)
    metadata = None
    if point is not None:                 # a job of several parts: its first part's record
        first = spec.job.PARTS[0] if point.run_dir is not None else None
        directory = point.checkpoint_dir if first is None else point.checkpoint_dir / first
        metadata = checkpoint.read_metadata(directory, point.step)["metadata"]
    if spec.make_tree is not None:
        tree, lines = spec.make_tree(given, metadata)
    elif point is None:
        rows = {field: table.row(field) for field in spec.required}
        missing = [f"{row.flag} is required ({spec.required[field]}), unless --resume RUN "
                   "continues a run" for field, row in rows.items() if row.dest not in given]
        if missing:
            raise ValueError("; ".join(missing))
        tree = table.build(given, **{field: row.tree_value(given[row.dest])
                                     for field, row in rows.items()})
        lines = []
    else:
        tree, line = resumed_tree(spec.name, metadata.get(RECORD_KEY), table.tree,
                                  lambda before: table.apply(before, given), table.by_target,
                                  given["resume"], table.fixed)
        lines = [line]
    if metadata is not None and RECORD_KEY in metadata:
        check_data(metadata[RECORD_KEY]["data"], data_paths(tree, spec.job.DATA))
    return tree, point, lines


def _set_device_count(count: int, env: Any) -> None:
    """This process's simulated CPU devices: the mesh's, or its share of a multi-process mesh
    (unless XLA_FLAGS has a count already, as `zeroxla launch --devices-per-proc` sets it)."""
    from zeroxla.app.distributed import NUM_PROCESSES_ENV

    if env is not None and env.auto:
        return                  # a cluster: the devices are real, or the job script sets them
    if env is not None:
        if count % env.num_processes:
            raise ValueError(f"--mesh has {count} devices, which the {env.num_processes} "
                             f"processes ({NUM_PROCESSES_ENV}) cannot share evenly; accepted: "
                             f"a mesh of a multiple of {env.num_processes} devices")
        count //= env.num_processes
    set_host_device_count(count)


def run_command(spec: JobSpec, args: argparse.Namespace) -> int:
    """Runs `zeroxla <spec.name>` as the options say; its exit status."""
    from zeroxla.app import distributed
    from zeroxla.app.interrupt import exit_status

    tree, point, lines = resolve(spec, spec.table.given(args))
    check_installed(tree.run.report_to)      # before the job loads its model
    env = distributed.from_environ(os.environ)
    _set_device_count(spec.devices(tree), env)
    if env is not None:
        distributed.initialize(env)
    from zeroxla.app import data_files
    from zeroxla.app.run.resume import data_paths

    data_files.check_installed(data_paths(tree, spec.job.DATA).values())   # Parquet, datasets
    import jax

    from zeroxla.app.run import runner        # imports JAX: only after the flag is set

    primary = jax.process_index() == 0
    say = (lambda text: print(text, flush=True)) if primary else (lambda text: None)
    for line in lines:
        say(line)
    job = spec.job(tree)
    try:
        summary = runner.run(job, resume=point)
    except runner.RunInterrupted as stop:
        if primary:
            print(f"zeroxla {spec.name}: {stop}", file=sys.stderr, flush=True)
        return exit_status(stop.signum)
    except runner.RunDiverged as err:
        if args.traceback:
            raise
        if primary:
            print(f"zeroxla {spec.name}: error: {err}", file=sys.stderr, flush=True)
        return DIVERGED
    except runner.NothingLeft as done:
        if primary:
            print(f"zeroxla {spec.name}: {done}", file=sys.stderr, flush=True)
        return 0
    say(spec.report(summary) if spec.report else json.dumps(
        {k: v for k, v in runner.finite(summary).items() if k != "settings"}, indent=2))
    return 0


__all__ = ["DIVERGED", "JobSpec", "add_job", "resolve", "run_command"]
