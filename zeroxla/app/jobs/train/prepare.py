"""Setting up a `zeroxla train` job (`zeroxla.app.jobs.train.job.TrainJob` calls these before the
runner makes any file): the tokenizer a resumed run recorded, the step, and the line that says
what the run trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

import zeroxla
from zeroxla import checkpoint
from zeroxla.app.run import rundir
from zeroxla.app.jobs.train.config import TrainJobConfig
from zeroxla.app.jobs.train.data import SFTData, TextData
from zeroxla.app.jobs.train.model import model_factory
from zeroxla.app.jobs.train.recipe import TrainingSetup
from zeroxla.lora import lora_trainable


def recorded_tokenizer(resume: rundir.ResumePoint | None) -> dict | None:
    """The tokenizer record of the checkpoint `--resume` names (None for a fresh run). A
    checkpoint without one was not written by `zeroxla train` and is refused: the ids it was
    trained on are not known."""
    if resume is None:
        return None
    meta = checkpoint.read_metadata(resume.checkpoint_dir, resume.step)
    record = meta["metadata"].get("tokenizer")
    if record is None:
        raise rundir.RunDirError(
            f"--resume {resume.checkpoint_dir}: checkpoint step {meta['step']} records no "
            "tokenizer, so the token ids it was trained on are unknown; accepted: a checkpoint "
            "zeroxla train wrote (it records its tokenizer), or a fresh run (--init-from for a "
            "Hugging Face checkpoint)")
    return record


def make_train_step(job: TrainJobConfig, setup: TrainingSetup, config: Any, mesh: Any) -> Any:
    """The job's model under `setup`'s ZeRO config and optimizer on `mesh`; with several
    pipeline stages, pipelined over `--grad-accum` micro-batches; with `--only-optimize-lora`,
    the adapters alone trainable."""
    pipeline = (zeroxla.PipelineConfig(setup.zero.gradient_accumulation_steps)
                if job.pipeline.stages > 1 else None)
    return zeroxla.make_step(model_factory(job, config), mesh, optimizer=setup.optimizer,
                             config=setup.zero, pipeline=pipeline,
                             trainable=lora_trainable(job.lora.config()))


def describe_run(job: TrainJobConfig, setup: TrainingSetup, data: TextData | SFTData,
                 mesh: Any, settings: Mapping[str, Any]) -> str:
    """The line that says what the run trains, on what, on which mesh and how."""
    zero = setup.zero
    nodes, local = job.sharding.mesh
    return (f"zeroxla train: {job.model_name} on {data.source} ({data.describe()}, vocab "
            f"{data.vocab_size}), ZeRO-{zero.stage} "
            f"on a {nodes}x{local} mesh of {mesh.devices.flat[0].platform} devices"
            + (f", sequences split over {job.sharding.sequence_parallel_size} of them"
               if job.sharding.sequence_parallel_size > 1 else "")
            + (f", experts split over {job.sharding.expert_parallel_size} of them"
               if job.sharding.expert_parallel_size > 1 else "")
            + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
            + f", batch {job.schedule.batch_size} x {job.data.seq_len} tokens"
            + (f" in {zero.gradient_accumulation_steps} micro-batches"
               if zero.gradient_accumulation_steps > 1 else "")
            + f", {settings['dtype']}, recipe: {setup.source}")


__all__ = ["describe_run", "make_train_step", "recorded_tokenizer"]
