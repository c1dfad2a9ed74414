"""The runner's shared behaviours, once, against a minimal in-process job (seconds each).

`Regression` is the smallest job there is: a plain `nnx.Linear` fitted by SGD to the points of
a data file, one step a unit, on one device. Its losses are checked against a float64 numpy
re-computation of the same SGD, so "the same metrics as an uninterrupted run" compares the
runner with an independent reference, not with itself. Every real job's own wiring of these
behaviours is tested in its own file (tests/zeroxla/app/test_*_job.py); the rules are here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.app.run import rundir
from zeroxla.app.run import command, runner
from zeroxla.app.run.job import RunSettings
from zeroxla.app.run.options import RUN_OPTIONS, Option, OptionTable
from zeroxla.sharding.mesh import make_mesh


def _float(text: str) -> float:
    return float(text)


@dataclasses.dataclass(frozen=True)
class RegressionConfig:
    data: str
    steps: int = 6
    lr: float = 0.1
    fail_at: int | None = None            # advance raises at this unit (0-based)
    signal_at: int | None = None          # SIGINT sent to ourselves during this unit
    run: RunSettings = RunSettings(eval_every=3)


def _squared_error(model: nnx.Module, batch: dict[str, Any]) -> tuple[Any, Any]:
    """make_step's loss_fn: (sum of squared errors, count): the mean squared error."""
    err = model(batch["x"]) - batch["y"]                       # [N, 1]
    return (err ** 2).sum(), jax.numpy.float32(err.size)


def _points(path: str) -> tuple[np.ndarray, np.ndarray]:
    rows = np.loadtxt(path, ndmin=2)
    return rows[:, :2].astype(np.float32), rows[:, 2:].astype(np.float32)


class Regression:
    NAME: ClassVar[str] = "regression"
    UNIT: ClassVar[str] = "step"
    COUNTER: ClassVar[tuple[str, int]] = ("step", 0)
    EXPORT_DIR: ClassVar[None] = None
    PARTS: ClassVar[tuple[None]] = (None,)
    DATA: ClassVar[dict[str, str]] = {"--data": "data"}
    EVALUATE_FIRST: ClassVar[bool] = True
    label = NAME
    tokenizer = None

    def __init__(self, config: RegressionConfig):
        self.config = config
        self.x, self.y = _points(config.data)
        mesh = make_mesh(1, 1, devices=jax.devices()[:1])
        zero = zeroxla.ZeroConfig(stage=0, check_grad_overflow=True)
        self.step = zeroxla.make_step(
            lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(config.run.seed)), mesh,
            optimizer=optax.sgd(config.lr), config=zero,
            loss_fn=_squared_error)
        self.state = self.step.init()

    @property
    def total(self) -> int:
        return self.config.steps

    def parts(self) -> dict[None, "Regression"]:
        return {None: self}

    def _batch(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y}

    def describe(self, first: int) -> str:
        return f"regression: steps {first + 1}..{self.total}"

    def advance(self, done: int) -> dict[str, float]:
        if done == self.config.fail_at:
            raise RuntimeError(f"the job's step {done + 1} failed")
        if done == self.config.signal_at:
            os.kill(os.getpid(), signal.SIGINT)
        self.state, metrics = self.step(self.state, self._batch())
        return {"loss": float(metrics["loss"])}

    def evaluate(self) -> dict[str, float]:
        return {"val_loss": float(self.step.eval_loss(self.state, self._batch()))}

    def say(self, record: dict[str, Any]) -> str:
        return f"step {record['step']}: val {record['val_loss']:.4f}"

    def checkpoint_metadata(self, out: Path, part: None) -> dict[str, Any]:
        return {"out": str(out)}

    def checkpoint_model_config(self, part: None) -> None:
        return None

    def restored(self, metadata: dict[str, Any]) -> None:
        pass

    def draw(self, out: Path, records: list[dict]) -> None:
        (out / "drawn.txt").write_text(f"{len(records)} records")

    def finish(self, out: Path, records: list[dict], before: dict) -> dict[str, Any]:
        return {"final_loss": records[-1]["loss"], "nan_figure": float("nan")}


TABLE = OptionTable("regression", RegressionConfig, (
    Option("--data", "data", None, "data", "job", "points", metavar="FILE"),
    Option("--steps", "steps", None, "steps", "job", "steps; default {default}", type=int),
    Option("--lr", "lr", None, "lr", "job", "SGD's; default {default}", type=_float),
    *RUN_OPTIONS), {"job": "the job", "run": "the run"})
SPEC = command.JobSpec("regression", "fit a line", "fit a line", TABLE, Regression,
                       required={"data": "a file of points"})


def _reference_losses(path: str, lr: float, steps: int, seed: int = 0) -> list[float]:
    """The same SGD in float64 numpy from the same initial weights: each step's loss."""
    x, y = (a.astype(np.float64) for a in _points(path))
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(seed))
    w = np.asarray(model.kernel[...], np.float64)
    b = np.asarray(model.bias[...], np.float64)
    losses = []
    for _ in range(steps):
        err = x @ w + b - y                                    # [N, 1]
        losses.append(float(np.mean(err ** 2)))
        w -= lr * 2 * x.T @ err / err.size
        b -= lr * 2 * err.sum(0) / err.size
    return losses


@pytest.fixture
def data(tmp_path) -> str:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 2))
    y = x @ np.array([[1.5], [-2.0]]) + 0.5
    path = tmp_path / "points.txt"
    np.savetxt(path, np.concatenate([x, y], axis=1))
    return str(path)


def _job(data: str, out: Path | None, **changes: Any) -> Regression:
    run = changes.pop("run", {})
    return Regression(RegressionConfig(
        data=data, run=RunSettings(eval_every=3, out_dir=None if out is None else str(out),
                                   **run), **changes))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / rundir.METRICS_FILE).read_text().splitlines()]


def test_a_finished_run_matches_the_float64_reference_and_writes_strict_json(data, tmp_path):
    out = tmp_path / "run"
    summary = runner.run(_job(data, out, run={"save_every": 2, "keep_last": 2}), write=print)
    records = _metrics(out)
    want = _reference_losses(data, 0.1, 6)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]        # 0: before the first
    np.testing.assert_allclose([r["loss"] for r in records[1:]], want, rtol=2e-6)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6]
    saved = json.loads((out / rundir.SUMMARY_FILE).read_text())      # strict: no bare NaN
    assert saved["nan_figure"] is None and summary["parameters"] == {"total": 3, "trainable": 3}
    steps = sorted(int(p.name) for p in (out / rundir.CHECKPOINT_DIR).iterdir()
                   if p.name.isdigit())
    assert steps == [4, 6]                                   # saved 2, 4, 6; keep_last 2


def test_a_step_that_raises_after_a_checkpoint_keeps_it(data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="step 4 failed"):
        runner.run(_job(data, out, fail_at=3, run={"save_every": 2}), write=print)
    assert zeroxla.latest_step(out / rundir.CHECKPOINT_DIR) == 2
    assert [r["step"] for r in _metrics(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize("existed", [False, True])
def test_a_fresh_run_that_fails_before_a_checkpoint_leaves_nothing(data, tmp_path, existed):
    out = tmp_path / "new" / "run"
    if existed:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="step 2 failed"):
        runner.run(_job(data, out, fail_at=1), write=print)
    if existed:
        assert sorted(os.listdir(out)) == ["notes.txt"]
    else:
        assert not (tmp_path / "new").exists()


def test_a_diverging_run_stops_naming_the_step_keeping_the_last_finite_state(data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(runner.RunDiverged, match=r"step \d+: the loss is (nan|inf) \(not finite\), so training stopped") as caught:
        runner.run(_job(data, out, lr=1e6, steps=40, run={"save_every": 1}), write=print)
    assert "nothing was exported" in str(caught.value)
    step = zeroxla.latest_step(out / rundir.CHECKPOINT_DIR)
    assert step is not None
    model = zeroxla.load_params(out / rundir.CHECKPOINT_DIR, step=step,
                                model=lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    assert all(np.all(np.isfinite(np.asarray(p))) for p in jax.tree.leaves(nnx.state(model)))
    assert not (out / rundir.SUMMARY_FILE).exists()
    assert all(math.isfinite(r["loss"]) for r in _metrics(out) if "loss" in r)


def test_sigint_saves_the_step_and_resume_continues_like_an_uninterrupted_run(data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(runner.RunInterrupted, match="after step 3") as caught:
        runner.run(_job(data, out, signal_at=2), write=print)
    assert caught.value.signum == signal.SIGINT and caught.value.done == 3
    given = {"resume": str(out), "signal_at": None}
    tree, point, lines = command.resolve(SPEC, {k: v for k, v in given.items()
                                                if k in TABLE.by_dest})
    assert "changed on the command line: nothing" in lines[0]
    runner.run(Regression(tree), resume=point, write=print)
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in records[1:]],
                               _reference_losses(data, 0.1, 6), rtol=2e-6)
    with pytest.raises(runner.NothingLeft, match="nothing left to do"):
        runner.run(Regression(tree), resume=rundir.locate_resume(out), write=print)


def test_resume_says_a_changed_option_and_refuses_an_edited_data_file(data, tmp_path):
    out = tmp_path / "run"
    runner.run(_job(data, out, steps=2), write=print)
    tree, _, lines = command.resolve(SPEC, {"resume": str(out), "steps": 4, "lr": 0.05})
    assert (tree.steps, tree.lr, tree.data) == (4, 0.05, data)
    assert "--lr 0.1 -> 0.05" in lines[0] and "--steps 2 -> 4" in lines[0]
    with open(data, "a") as f:
        f.write("1 1 1\n")
    with pytest.raises(ValueError, match=r"--data .*points.txt changed since the run read it"):
        command.resolve(SPEC, {"resume": str(out), "steps": 4})
