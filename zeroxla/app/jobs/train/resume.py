"""A job in its checkpoints, and how `--resume` gets it back.

Every checkpoint of `zeroxla train` records the job's config tree (`job_record`, under
`RECORD_KEY`: each section as a JSON object, file paths absolute so a resume from another
working directory finds them, per-invocation fields left out) next to the settings actually used
(`settings`, summary.json's). `--resume` rebuilds the tree from it (`job_from_record`) and
applies the options given on the command line over it (`saved_job`: the command line wins), so a
resumed run keeps its model, data, batch, mesh, ZeRO stage and dtype unless told otherwise
(`describe_resume` says which came back and which changed).

Checkpoints of an older zeroxla hold the job as one flat record instead (`FLAT_RECORD_KEY`:
`{"model": "gpt-tiny", "zero_stage": 2, "dtype": "bf16", "deepspeed_config": ..., ...}`, None
where the DeepSpeed JSON or a default decided). Its fields are the options of the same names
(argparse's dests), so `saved_job` reads it as options given before the command line's, over
the defaults: the JSON it names is read again, as that zeroxla did. Nothing here uses a device.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from zeroxla.app.jobs.train.config import (SECTIONS, Data, DeepSpeedSection, Numerics,
                                           Schedule, TrainJobConfig)
from zeroxla.app.jobs.train.options import OPTION_NAMES
from zeroxla.app.run.job import PER_INVOCATION
from zeroxla.app.jobs.train.resolve import resolve_job

RECORD_KEY = "job_config"            # checkpoint metadata: the tree (`job_record`)
FLAT_RECORD_KEY = "job"              # an older zeroxla's flat record
# Flat-record fields that were no option then: the default recipe's constants, set on the base
# tree, never read as options (gradient_clipping, an option now, was the default recipe's then:
# a --config JSON's own clipping replaced it, and replaces it again when the JSON is re-read).
_FLAT_CONSTANTS = {"min_lr_ratio": (Schedule, "min_lr_ratio"),
                   "weight_decay": (Schedule, "weight_decay"),
                   "val_fraction": (Data, "val_fraction"),
                   "gradient_clipping": (Numerics, "gradient_clipping")}
_PATHS = (("model", "init_from"), ("data", "path"))


def _jsonable(value: Any) -> Any:
    if isinstance(value, DeepSpeedSection):
        return {"type": value.type, "params": _jsonable(dict(value.params))}
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def job_record(job: TrainJobConfig) -> dict[str, Any]:
    """The tree as JSON, for a checkpoint: {section: {field: value}, "deepspeed_config": path};
    file paths absolute; the per-invocation run fields left out."""
    record: dict[str, Any] = {
        name: {f.name: _jsonable(getattr(getattr(job, name), f.name))
               for f in dataclasses.fields(cls)
               if not (name == "run" and f.name in PER_INVOCATION)}
        for name, cls in SECTIONS.items()}
    for section, field in _PATHS:
        if record[section][field] is not None:
            record[section][field] = os.path.abspath(record[section][field])
    record["deepspeed_config"] = (os.path.abspath(job.deepspeed_config)
                                  if job.deepspeed_config is not None
                                  and os.path.exists(job.deepspeed_config)
                                  else job.deepspeed_config)
    return record


def _section(cls: type, values: Mapping[str, Any]) -> Any:
    """A section from its record: known fields only (a newer zeroxla's extra ones dropped)."""
    known = {f.name for f in dataclasses.fields(cls)} - (
        set(PER_INVOCATION) if cls.NAME == "run" else set())
    fields = {k: v for k, v in values.items() if k in known}
    if cls.NAME == "sharding" and "mesh" in fields:
        fields["mesh"] = tuple(fields["mesh"])
    if cls.NAME == "run" and "report_to" in fields:
        fields["report_to"] = tuple(fields["report_to"])
    for name in ("optimizer", "scheduler") if cls.NAME == "schedule" else ():
        if fields.get(name) is not None:
            fields[name] = DeepSpeedSection(fields[name]["type"], fields[name]["params"])
    return cls(**fields)


def job_from_record(record: Mapping[str, Any]) -> TrainJobConfig:
    """Inverse of `job_record` (per-invocation fields at their defaults)."""
    sections = {name: _section(cls, record.get(name, {})) for name, cls in SECTIONS.items()}
    return TrainJobConfig(**sections, deepspeed_config=record.get("deepspeed_config"))


def flat_record_options(flat: Mapping[str, Any]) -> tuple[TrainJobConfig, dict[str, Any]]:
    """An older zeroxla's flat record as (the base tree: the defaults with its recipe constants,
    the options it stands for: its fields that are options, but those it left None)."""
    changes: dict[str, dict[str, Any]] = {}
    for name, (cls, field) in _FLAT_CONSTANTS.items():
        if name in flat:
            changes.setdefault(cls.NAME, {})[field] = flat[name]
    base = TrainJobConfig()
    base = dataclasses.replace(base, **{name: dataclasses.replace(getattr(base, name), **fields)
                                        for name, fields in changes.items()})
    given = {k: v for k, v in flat.items() if k in OPTION_NAMES and v is not None
             and k not in PER_INVOCATION and k not in _FLAT_CONSTANTS}
    if "mesh" in given:
        given["mesh"] = tuple(given["mesh"])
    return base, given


def saved_job(metadata: Mapping[str, Any] | None, given: Mapping[str, Any]) -> TrainJobConfig:
    """The job a resumed run continues: the tree its checkpoint `metadata` records (or an older
    zeroxla's flat record of it), with the `given` options over it; the defaults with `given`
    where the checkpoint records no job."""
    metadata = metadata or {}
    if metadata.get(RECORD_KEY) is not None:
        return resolve_job(given, job_from_record(metadata[RECORD_KEY]))
    if metadata.get(FLAT_RECORD_KEY) is not None:
        base, recorded = flat_record_options(metadata[FLAT_RECORD_KEY])
        return resolve_job({**recorded, **given}, base)
    return resolve_job(given)


def _show(name: str, value: Any) -> str:
    if name == "mesh" and isinstance(value, (list, tuple)):
        return "x".join(map(str, value))
    return str(value)


def describe_resume(saved_settings: Mapping[str, Any] | None,
                    given: Mapping[str, Any]) -> list[str]:
    """Lines saying what a resume kept from the run and what the command line changed.

    `saved_settings` are the settings the run used (its summary's "settings", keyed by the
    options' names); `given` the options on the command line (per-invocation ones are not
    compared).
    """
    if not saved_settings:
        return ["resume: the checkpoint records no zeroxla train settings; using the command "
                "line and the defaults"]
    given = {k: v for k, v in given.items() if k not in PER_INVOCATION}
    kept = [f"{OPTION_NAMES[name]} {_show(name, saved_settings[name])}"
            for name in ("model", "mesh", "zero_stage", "dtype", "grad_accum", "batch_size",
                         "seq_len", "steps") if name not in given and name in saved_settings]
    changed = [f"{OPTION_NAMES.get(name, name)} {_show(name, saved_settings[name])} -> "
               f"{_show(name, value)}" for name, value in given.items()
               if name in saved_settings
               and _show(name, saved_settings[name]) != _show(name, value)]
    lines = [f"resume: kept from the run: {', '.join(kept) or 'nothing listed'} (and its other "
             "settings)"]
    lines.append(f"resume: changed on the command line: {', '.join(changed) or 'nothing'}")
    return lines


__all__ = ["FLAT_RECORD_KEY", "RECORD_KEY", "describe_resume", "flat_record_options",
           "job_from_record", "job_record", "saved_job"]
