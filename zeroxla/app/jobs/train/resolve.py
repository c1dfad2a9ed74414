"""What a job's settings add up to: options over a base tree, a `--config` JSON filling it.

`resolve_job(given, base) -> TrainJobConfig`. `base` is the defaults (`TrainJobConfig()`) or a
resumed run's recorded tree; `given` the options a command line gives (argparse dest -> value,
`zeroxla.app.jobs.train.options.given_options`). In order:

  1. each section of `base` the options touch is `dataclasses.replace`d with their values;
  2. with `--config` (`deepspeed_config`), the JSON is read once (`zeroxla.deepspeed`) on that
     mesh, with the options that are DeepSpeed settings as typed `Overrides`: they take part in
     its cross-key checks and batch arithmetic, and one that contradicts a key of the JSON is an
     error naming both. The JSON then fills the tree: the sharding, zeropp, numerics and offload
     sections hold its ZeroConfig (DeepSpeed's defaults where it is silent; a `JobDefault` with
     `with_config` where it does not set that key), the schedule its batch and its optimizer and
     scheduler sections;
  3. the tree is built once, so it is checked as a whole (`TrainJobConfig.__post_init__`).

A batch the mesh does not divide is refused naming the options (`--batch-size`, `--mesh`,
`--grad-accum`, `--sequence-parallel-size`), so are a `--sequence-parallel-size` that does not
divide the mesh's LOCAL devices and a `--seq-len` it does not divide, and `--lr` beside a JSON
optimizer or scheduler (which set the learning rate) is refused, not ignored. A JSON's batch
arithmetic runs over DeepSpeed's dp = world / sp: the mesh's NODES x LOCAL devices over the
sequence-parallel degree (the option's, else the JSON's `sequence_parallel_size`). No device is
used.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from zeroxla.app.cli_args import check_batch, check_sequence_length
from zeroxla.app.distributed import check_sequence_parallel
from zeroxla.app.jobs.train.config import DeepSpeedSection, TrainJobConfig, engine_sections
from zeroxla.app.jobs.train.defaults import JOB_DEFAULTS
from zeroxla.app.jobs.train.options import deepspeed_overrides, section_changes
from zeroxla.deepspeed import config as ds_config


def _filled(job: TrainJobConfig, sections: dict[str, Any], source: Any,
            given: Mapping[str, Any]) -> dict[str, Any]:
    """`sections` (the changes so far) with the DeepSpeed JSON `source` (a path, or a dict)
    filling the engine sections and the schedule."""
    sharding = sections.get("sharding", job.sharding)
    schedule = sections.get("schedule", job.schedule)
    nodes, local = sharding.mesh
    overrides = deepspeed_overrides(given)
    # DeepSpeed's dp world for the batch arithmetic: world_size / sequence_parallel_size.
    ds = ds_config.load_deepspeed_config(source, world_size=nodes * local,
                                         mesh_local_size=local, overrides=overrides,
                                         default_train_batch_size=schedule.batch_size)
    if ds.hybrid_engine is not None:
        warnings.warn(f"{ds.source}: the hybrid_engine section configures zeroxla.HybridEngine "
                      "(RLHF generation); zeroxla train's end-of-run sample does not read it",
                      ds_config.DeepSpeedConfigWarning, stacklevel=3)
    zero, given_beside = ds.zero, overrides.given()
    for row in JOB_DEFAULTS:           # the job's defaults that hold over a JSON's silence
        if row.with_config and row.field not in given_beside and not ds.sets(row.field):
            zero = dataclasses.replace(zero, **{row.field: row.value})
    optimizer = (DeepSpeedSection(ds.optimizer_name, ds.optimizer_params)
                 if ds.optimizer_name is not None else None)
    scheduler = (DeepSpeedSection(ds.scheduler_name, ds.scheduler_params)
                 if ds.scheduler_name is not None else None)
    return {**sections, **engine_sections(zero, sharding.mesh),
            "schedule": dataclasses.replace(schedule, batch_size=ds.train_batch_size,
                                            optimizer=optimizer, scheduler=scheduler),
            "deepspeed_config": ds.source}


def resolve_job(given: Mapping[str, Any],
                base: TrainJobConfig = TrainJobConfig()) -> TrainJobConfig:
    """The tree of `given` options over `base`, a --config JSON among them read into it (see the
    module docstring). Raises ValueError (a DeepSpeedConfigError for the JSON) naming what is
    wrong; DeepSpeed keys without effect warn (`DeepSpeedConfigWarning`)."""
    # In the options' words before the sections check it in the tree's.
    check_sequence_parallel(given.get("mesh", base.sharding.mesh),
                            given.get("sequence_parallel_size",
                                      base.sharding.sequence_parallel_size))
    sections = section_changes(base, given)
    source = given.get("deepspeed_config")
    if source is not None:
        sections = _filled(base, sections, source, given)
    sharding = sections.get("sharding", base.sharding)
    sequence = sharding.sequence_parallel_size
    from_json = source is not None and "sequence_parallel_size" not in given and sequence > 1
    check_sequence_length(sections.get("data", base.data).seq_len, "--seq-len", sequence,
                          f"sequence_parallel_size={sequence} in {sections.get('deepspeed_config')}"
                          if from_json else None)
    if source is None:
        check_batch(sections.get("schedule", base.schedule).batch_size, "--batch-size",
                    sharding.mesh, sharding.gradient_accumulation_steps, sequence)
    job = dataclasses.replace(base, **sections)
    if sequence > 1 and job.pipeline.stages > 1:
        raise ValueError(f"--sequence-parallel-size {sequence} with --pipeline-stages "
                         f"{job.pipeline.stages}: pipeline parallelism with sequence parallelism "
                         "is not built; accepted: one of them (the other 1)")
    if "lr" in given and (job.schedule.optimizer is not None
                          or job.schedule.scheduler is not None):
        raise ValueError(f"--lr {given['lr']} conflicts with the optimizer/scheduler sections of "
                         f"{job.deepspeed_config}, which set the learning rate; give one")
    return job


__all__ = ["resolve_job"]
