"""Setting up a `zeroxla train` job: everything that can fail on a bad option or bad data, done
before any file is made (`zeroxla.app.train.loop` creates the run directory only after
`set_up`).

`set_up(job, write) -> (TrainRun, state)`: the run directory's name (not yet created), the recipe
(`zeroxla.app.train.recipe`), the data, the mesh and the step, and the state restored from
`--resume`'s checkpoint or freshly initialized; `TrainRun` holds what the rest of the run reads.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

import zeroxla
from zeroxla import checkpoint
from zeroxla.app import distributed, rundir
from zeroxla.app.train.config import TrainJobConfig
from zeroxla.app.train.data import SFTData, TextData, load_train_data
from zeroxla.app.train.model import initial_state, model_config, model_factory
from zeroxla.app.train.recipe import TrainingSetup, build_setup
from zeroxla.app.train.report import run_settings
from zeroxla.lora import lora_trainable


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """A job set up to run: what `set_up` decided before the run directory is made."""

    job: TrainJobConfig
    out: Path                       # the run directory
    fresh: bool                     # a fresh default one (`_choose_out_dir`)
    resume: rundir.ResumePoint | None
    setup: TrainingSetup
    data: TextData | SFTData
    step: Any                       # from zeroxla.make_step
    first_step: int                 # the resumed checkpoint's data position, else 0
    restored_path: Path | None      # the resumed checkpoint
    val_batches: list[dict]
    settings: dict[str, Any]        # run_settings

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch."""
        return self.job.schedule.batch_size * self.job.data.seq_len

    @property
    def plot_title(self) -> str:
        """loss_curve.png's title: model, data, ZeRO stage, mesh and batch."""
        job = self.job
        nodes, local = job.sharding.mesh
        return (f"{job.model_name} on {self.data.source}: ZeRO-{self.setup.zero.stage}, mesh "
                f"{nodes}x{local}, batch {job.schedule.batch_size}x{job.data.seq_len}")


def _choose_out_dir(job: TrainJobConfig, resume: rundir.ResumePoint | None) -> tuple[Path, bool]:
    """(the run directory, whether it is a fresh default one). Every process gets the same."""
    if job.run.out_dir is not None:
        out = Path(job.run.out_dir)
        rundir.check_out_dir(out, resuming=resume.run_dir if resume else None)
        return out, False
    if resume is not None and resume.run_dir is not None:
        return resume.run_dir, False
    out = rundir.default_run_dir(Path(job.model_name).name, now=datetime.datetime.now())
    if jax.process_count() > 1:               # process 0's clock and file system decide
        out = Path(distributed.broadcast_text(str(out)))
    return out, True


def _check_no_newer_checkpoint(directory: Path, first_step: int) -> None:
    """Refuses to resume at `first_step` into a checkpoint directory that already goes further."""
    latest = checkpoint.latest_step(directory)
    if latest is not None and latest > first_step:
        raise rundir.RunDirError(
            f"--resume: the checkpoint is at step {first_step} but {directory} already has a "
            f"newer one, step {latest}; resume from the newest (--resume {directory.parent}) or "
            f"continue into a fresh directory (--out {rundir.fresh_path(directory.parent)})")


def _recorded_tokenizer(resume: rundir.ResumePoint | None) -> dict | None:
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


def _make_step(job: TrainJobConfig, setup: TrainingSetup, config: Any, mesh: Any) -> Any:
    """The job's model under `setup`'s ZeRO config and optimizer on `mesh`; with several
    pipeline stages, pipelined over `--grad-accum` micro-batches; with `--only-optimize-lora`,
    the adapters alone trainable."""
    pipeline = (zeroxla.PipelineConfig(setup.zero.gradient_accumulation_steps)
                if job.pipeline.stages > 1 else None)
    return zeroxla.make_step(model_factory(job, config), mesh, optimizer=setup.optimizer,
                             config=setup.zero, pipeline=pipeline,
                             trainable=lora_trainable(job.lora.config()))


def _restore_or_init(job: TrainJobConfig, step: Any, config: Any, mesh: Any,
                     resume: rundir.ResumePoint | None, checkpoint_dir: Path,
                     write: Callable[[str], None]) -> tuple[Any, int, Path | None]:
    """(state, first step, restored checkpoint path): the `--resume` checkpoint restored for
    `step`, or a fresh initial state at step 0."""
    if not resume:
        return initial_state(job, step, config, mesh), 0, None
    # Any mesh, device count or stage: the checkpoint is re-laid out for this step.
    restored = checkpoint.restore(resume.checkpoint_dir, step, step=resume.step)
    state, first_step = restored.state, int(restored.metadata["data_position"])
    if first_step >= job.schedule.steps:
        raise ValueError(f"--resume {job.run.resume}: the checkpoint is at step {first_step}, "
                         f"but --steps is {job.schedule.steps}; accepted: --steps > "
                         f"{first_step}")
    _check_no_newer_checkpoint(checkpoint_dir, first_step)
    write(f"resumed from {restored.path} at step {first_step}")
    return state, first_step, restored.path


def _describe(job: TrainJobConfig, setup: TrainingSetup, data: TextData | SFTData, mesh: Any,
              settings: Mapping[str, Any]) -> str:
    """The line that says what the run trains, on what, on which mesh and how."""
    zero = setup.zero
    nodes, local = job.sharding.mesh
    return (f"zeroxla train: {job.model_name} on {data.source} ({data.describe()}, vocab "
            f"{data.vocab_size}), ZeRO-{zero.stage} "
            f"on a {nodes}x{local} mesh of {mesh.devices.flat[0].platform} devices"
            + (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
            + f", batch {job.schedule.batch_size} x {job.data.seq_len} tokens"
            + (f" in {zero.gradient_accumulation_steps} micro-batches"
               if zero.gradient_accumulation_steps > 1 else "")
            + f", {settings['dtype']}, recipe: {setup.source}")


def set_up(job: TrainJobConfig, write: Callable[[str], None]) -> tuple[TrainRun, Any]:
    """(the run, its first state): the run directory's name, the recipe, the data, the step and
    the restored or initial state. Makes no file."""
    resume = rundir.locate_resume(job.run.resume) if job.run.resume else None
    out, fresh = _choose_out_dir(job, resume)
    write(f"zeroxla train: run directory {out}")
    setup = build_setup(job)
    data = load_train_data(job.data.path, tokenizer=job.data.tokenizer,
                           init_from=job.model.init_from, batch_size=job.schedule.batch_size,
                           seq_len=job.data.seq_len, val_fraction=job.data.val_fraction,
                           seed=job.run.seed, recorded=_recorded_tokenizer(resume))
    config = model_config(job, data)
    mesh = distributed.job_mesh(job.sharding.mesh, job.pipeline.stages)
    step = _make_step(job, setup, config, mesh)
    val_batches = data.eval_batches("val", job.run.eval_batches, step.layout.batch_sharding)
    state, first_step, restored_path = _restore_or_init(
        job, step, config, mesh, resume, out / rundir.CHECKPOINT_DIR, write)
    settings = run_settings(job, setup, data, out)
    write(_describe(job, setup, data, mesh, settings))
    run = TrainRun(job=job, out=out, fresh=fresh, resume=resume, setup=setup, data=data,
                   step=step, first_step=first_step, restored_path=restored_path,
                   val_batches=val_batches, settings=settings)
    return run, state


__all__ = ["TrainRun", "set_up"]
