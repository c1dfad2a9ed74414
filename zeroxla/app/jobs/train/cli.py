"""`zeroxla train` on the command line: its `JobSpec` (`zeroxla.app.run.command`: the one
handler every job has) with the way its tree is made (`make_tree`: `zeroxla.app.jobs.train.resolve`;
with `--resume`, the saved run's tree with the options given over it, an older zeroxla's records
included). A `--config` JSON is read with the options, before any JAX backend starts: the keys
it ignores are printed as "warning: ..." lines.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from zeroxla.app.run.command import JobSpec
from zeroxla.app.run.resume import changed_fields, refuse_fixed
from zeroxla.app.jobs.train.job import TrainJob
from zeroxla.app.jobs.train.options import TABLE
from zeroxla.app.jobs.train.report import TrainSummary, format_summary
from zeroxla.app.jobs.train.resume import describe_resume, saved_job
from zeroxla.deepspeed.checks import DeepSpeedConfigWarning


def _resolve(saved: Mapping[str, Any], given: Mapping[str, Any]) -> tuple[Any, list[str]]:
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


def make_tree(given: Mapping[str, Any],
              metadata: Mapping[str, Any] | None) -> tuple[Any, list[str]]:
    """The job's tree: the options over the defaults (and a --config JSON read with them), or
    over the tree `--resume`'s checkpoint recorded (an older zeroxla's records too); the lines
    that warn and say what a resume kept and changed."""
    if given.get("init_from") is not None and given.get("model") is not None:
        raise ValueError(f"--model {given['model']} with --init-from {given['init_from']}: the "
                         "checkpoint's config.json decides the model; give one of them")
    job, lines = _resolve(metadata or {}, given)
    if metadata is not None:
        recorded, _ = _resolve(metadata, {"resume": given["resume"]})
        refuse_fixed(changed_fields(recorded, job), TABLE.fixed, TABLE.by_target,
                     given["resume"])
        lines += describe_resume(metadata.get("settings"), given)
    return job, lines


def _report(summary: Mapping[str, Any]) -> str:
    fields = {f.name for f in dataclasses.fields(TrainSummary)}
    return format_summary(TrainSummary(**{k: v for k, v in summary.items() if k in fields}))


SPEC = JobSpec(
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
                "ZEROXLA_DISTRIBUTED=auto) it runs as one process of a multi-process job.",
    table=TABLE, job=TrainJob, make_tree=make_tree, report=_report,
    devices=lambda tree: tree.sharding.mesh[0] * tree.sharding.mesh[1] * tree.pipeline.stages)

__all__ = ["SPEC", "make_tree"]
