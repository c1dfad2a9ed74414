"""How a `zeroxla train` run ends early, with its training kept.

A run writes the checkpoint of its last finished step before anything else at its end
(`save_final`): the report after a finished run, the exit after a stop signal (`interrupted`:
Ctrl-C's SIGINT or SIGTERM, exit 128 + the signal) and the error after a non-finite loss
(`diverged`). A step that checks for overflow (`ZeroConfig.skips_overflow`: the job's
`numerics.check_grad_overflow`, on by default, or fp16's loss scaler) returns the state it was
given when its gradients are not finite, so the last finite parameters and optimizer state are
still there to save; where they are not, the error says why and names the newest checkpoint.

`Progress` is where the loop stands, kept up to date as it goes, so the end can read it after a
stop or an error.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.app import rundir
from zeroxla.app.interrupt import signal_name
from zeroxla.app.train.prepare import TrainRun
from zeroxla.app.train.report import write_plot


class TrainingInterrupted(Exception):
    """A stop signal (`signum`: Ctrl-C's SIGINT, or SIGTERM) stopped the run after `step`; its
    checkpoint was saved at `checkpoint_path`."""

    def __init__(self, step: int, checkpoint_path: Path, run_dir: Path,
                 signum: int = signal.SIGINT):
        super().__init__(f"interrupted ({signal_name(signum)}) after step {step}; saved "
                         f"checkpoint {checkpoint_path}")
        self.step, self.checkpoint_path, self.run_dir = step, checkpoint_path, run_dir
        self.signum = signum


class TrainingDiverged(FloatingPointError):
    """A step's loss was not finite: the run stopped there. The message names the step and
    what was kept: the checkpoint of the last finite state, or why there is none."""


@dataclasses.dataclass
class Progress:
    """Where the loop stands, updated as it goes (so `run` can read it after a stop or an
    error)."""

    done: int                       # steps trained, resumed ones included
    records: list[dict]             # metrics.jsonl's records, the resumed run's included
    saved_at: int | None = None     # the step of the newest checkpoint in the run directory
    saved_path: Path | None = None
    val_loss: float = float("nan")
    step_times: list[float] = dataclasses.field(default_factory=list)
    diverged: float | None = None   # the non-finite loss the last step returned

    def mark_saved(self, path: Path) -> None:
        self.saved_at, self.saved_path = self.done, path


def save_final(state: Any, progress: Progress, save: Callable[[Any, int], Path]) -> Path:
    """The checkpoint of the last finished step (unless it was just saved); its path."""
    if progress.saved_at != progress.done:
        progress.mark_saved(save(state, progress.done))
    return progress.saved_path


def all_finite(state: Any) -> bool:
    """Whether every parameter of `state` is finite (a collective on a multi-process mesh)."""
    leaves = [x for x in jax.tree.leaves(state.params) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x))
                                                      for x in xs])))(leaves))


def diverged(r: TrainRun, state: Any, progress: Progress,
             save: Callable[[Any, int], Path]) -> TrainingDiverged:
    """After a non-finite loss at step `progress.done`: keeps the last finite state if the step
    skipped its update (`check_grad_overflow`, fp16's loss scaler), and returns the error that
    names the step and what was kept."""
    step, zero = progress.done, r.setup.zero
    what = (f"step {step}: the loss is {progress.diverged} (not finite), so training stopped "
            "(lower --lr, or clip gradients: gradient_clipping in a --config)")
    if not zero.skips_overflow:
        kept = ("its update was applied (the overflow check is off: --no-check-grad-overflow, "
                "or bf16.check_grad_overflow false in a --config), so its parameters are not "
                "kept")
    elif not all_finite(state):
        kept = (f"its update was skipped, but the parameters it kept, those of step {step - 1}, "
                "are not finite already (an earlier update overflowed), so they are not kept")
    else:
        path = save_final(state, progress, save)
        if jax.process_index() == 0:
            write_plot(r.out / rundir.PLOT_FILE, progress.records, r.plot_title)
        return TrainingDiverged(
            f"{what}. Its update was skipped: checkpoint {step} at {path} holds the parameters "
            f"and optimizer state of step {step - 1}, the last finite ones (--resume "
            f"{r.out} continues from there)")
    earlier = (f"the newest checkpoint is step {progress.saved_at} at {progress.saved_path}"
               if progress.saved_path is not None else "no checkpoint was saved before it "
               "(--save-every N keeps one every N steps)")
    return TrainingDiverged(f"{what}. No checkpoint of it was saved: {kept}; {earlier}")


def interrupted(r: TrainRun, state: Any, progress: Progress, save: Callable[[Any, int], Path],
                signum: int) -> TrainingInterrupted:
    """After a stop signal: saves the last finished step (unless just saved), draws the loss
    curve and returns the exception that says where the checkpoint is."""
    path = save_final(state, progress, save)
    if jax.process_index() == 0:
        write_plot(r.out / rundir.PLOT_FILE, progress.records, r.plot_title)
    return TrainingInterrupted(progress.done, path, r.out, signum)


__all__ = ["Progress", "TrainingDiverged", "TrainingInterrupted", "all_finite", "diverged",
           "interrupted", "save_final"]
