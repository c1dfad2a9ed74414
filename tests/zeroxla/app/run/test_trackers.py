"""`--report-to`: every metrics.jsonl record reaches each experiment tracker, read back with the
tracker's own reader (TensorBoard's EventAccumulator, W&B's offline run file with wandb's
protobuf records, MLflow's store through MlflowClient), and a missing package is refused before
the run directory exists.

The run is test_runner's `Regression` (an `nnx.Linear` fitted by SGD; seconds). The reference
for every value is the run's metrics.jsonl and summary.json, which test_runner checks against a
float64 numpy re-computation. The trackers' packages are optional: a run reports to those
installed here, and a test skips when its tracker is not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from test_runner import SPEC, TABLE, Regression, RegressionConfig
from zeroxla.app.run import command, rundir, runner, trackers
from zeroxla.app.run.job import TRACKERS, RunSettings
from zeroxla.app.run.resume import tree_record

ALL = ("tensorboard", "wandb", "mlflow")
# Each tracker's packages here: its client, and the reader the test reads it back with.
NEEDS = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb",),
         "mlflow": ("mlflow",)}
INSTALLED = tuple(name for name in ALL
                  if all(importlib.util.find_spec(m) is not None for m in NEEDS[name]))


@pytest.fixture
def data(tmp_path) -> str:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 2))
    path = tmp_path / "points.txt"
    np.savetxt(path, np.concatenate([x, x @ np.array([[0.5], [1.0]]) - 1.0], axis=1))
    return str(path)


@pytest.fixture
def offline(monkeypatch):
    """W&B offline and MLflow's own default store (the run directory's), whatever the host
    has set."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


def _job(data: str, out: Path, report_to: tuple[str, ...], **changes) -> Regression:
    return Regression(RegressionConfig(data=data, run=RunSettings(
        eval_every=3, out_dir=str(out), report_to=report_to), **changes))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / rundir.METRICS_FILE).read_text().splitlines()]


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of metrics.jsonl's records."""
    series: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step":
                series.setdefault(key, {})[record["step"]] = value
    return series


def _tensorboard(out: Path) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """({tag: {step: value}}, {text tag: its last text}) as TensorBoard's own loader reads the
    run's event files (it applies purge_step as TensorBoard shows the run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), (tag, [e.step for e in events])
        scalars[tag] = {e.step: e.value for e in events}
    texts = {tag: tensor_util.make_ndarray(acc.Tensors(tag)[-1].tensor_proto).item().decode()
             for tag in acc.Tags()["tensors"]}
    return scalars, texts


def test_report_to_names_parse_and_a_bad_one_is_refused_naming_the_accepted():
    parser = argparse.ArgumentParser()
    TABLE.add_to(parser)
    args = parser.parse_args(["--data", "x", "--report-to", "tensorboard,mlflow"])
    tree = TABLE.build(TABLE.given(args), data="x")
    assert tree.run.report_to == ("tensorboard", "mlflow")
    assert TABLE.build(TABLE.given(parser.parse_args(["--report-to", "none"])),
                       data="x").run.report_to == ()
    for bad in ("tensorboard,comet", "wandb,wandb", ""):
        with pytest.raises(ValueError, match="accepted: none, or a comma-separated list of "
                                             "tensorboard, wandb, mlflow"):
            trackers.parse_report_to(bad)
    with pytest.raises(ValueError, match="--report-to csv is invalid"):
        RunSettings(report_to=("csv",))
    assert tuple(trackers.PACKAGES) == TRACKERS         # a client for every accepted name


def test_a_missing_package_is_named_with_its_extra():
    present = {"tensorboardX"}

    def find_spec(name):        # what importlib.util.find_spec says on a host without them
        return object() if name in present else None

    assert trackers.missing(ALL, find_spec) == ["wandb", "mlflow"]
    trackers.check_installed(("tensorboard",), find_spec)
    with pytest.raises(ValueError) as caught:
        trackers.check_installed(ALL, find_spec)
    text = str(caught.value)
    assert "--report-to wandb needs the package wandb" in text
    assert 'pip install "zeroxla[mlflow]"' in text and 'pip install "zeroxla[wandb]"' in text
    assert text.endswith("accepted: install it, or --report-to tensorboard")


def test_a_missing_package_is_refused_before_the_run_directory_exists(data, tmp_path,
                                                                      monkeypatch):
    # A None entry in sys.modules is how Python itself marks a module as not importable:
    # importlib.util.find_spec("mlflow") is then None, as on a host without it.
    monkeypatch.setitem(sys.modules, "mlflow", None)
    out = tmp_path / "runs" / "r"
    parser = argparse.ArgumentParser()
    TABLE.add_to(parser)
    args = parser.parse_args(["--data", data, "--out", str(out), "--report-to", "mlflow"])
    with pytest.raises(ValueError, match=r'mlflow.*pip install "zeroxla\[mlflow\]"'):
        command.run_command(SPEC, args)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ValueError, match="needs the package mlflow"):
        runner.run(_job(data, out, ("mlflow",)), write=print)
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(not INSTALLED, reason="no tracker package installed (pip install "
                    "tensorboardX tensorboard wandb mlflow)")
def test_every_record_reaches_each_tracker_at_its_step(data, tmp_path, offline):
    """One run reporting to every tracker installed here (all three in the issue's check; the
    dev extra brings TensorBoard's alone): each read back holds metrics.jsonl."""
    out = tmp_path / "run"
    summary = runner.run(_job(data, out, INSTALLED), write=print)
    records = _metrics(out)
    want = _expected(records)
    assert [r["step"] for r in records] == list(range(7)) and set(want) == {"loss", "val_loss"}
    figures = json.loads((out / rundir.SUMMARY_FILE).read_text())
    figures.pop("settings")
    written = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow.db"}
    assert sorted(p.name for p in out.iterdir() if p.name in written.values()) == sorted(
        written[name] for name in INSTALLED)
    for name in INSTALLED:
        CHECKS[name](out, tmp_path, want, summary, figures, data)


def _check_tensorboard(out, tmp_path, want, summary, figures, data):
    scalars, texts = _tensorboard(out)           # TensorBoard keeps float32 scalars
    assert scalars == {k: {s: float(np.float32(v)) for s, v in steps.items()}
                       for k, steps in want.items()}
    assert json.loads(texts["config/text_summary"].strip("`json\n")) == summary["settings"]
    assert json.loads(texts["summary/text_summary"].strip("`json\n")) == figures


def _check_wandb(out, tmp_path, want, summary, figures, data):
    from wandb_records import offline_run

    run = offline_run(out)
    got = {}
    for row in run["history"]:
        for key, value in row.items():
            if not key.startswith("_"):
                got.setdefault(key, {})[row["_step"]] = value
    assert got == want                            # float64, exactly
    assert {k: v for k, v in run["config"].items() if k != "_wandb"} == summary["settings"]
    assert run["summary"]["final_loss"] == figures["final_loss"] == want["loss"][6]
    assert run["summary"]["parameters"] == {"total": 3, "trainable": 3}


def _check_mlflow(out, tmp_path, want, summary, figures, data):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name("zeroxla")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == out.name and found.info.status == "FINISHED"
    assert {key: {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
            for key in found.data.metrics} == want
    params = found.data.params
    assert (params["lr"], params["steps"], params["data"]) == ("0.1", "6", data)
    assert (params["run.eval_every"], json.loads(params["run.report_to"])) == (
        "3", list(INSTALLED))
    local = client.download_artifacts(found.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == figures


CHECKS = {"tensorboard": _check_tensorboard, "wandb": _check_wandb, "mlflow": _check_mlflow}


@pytest.mark.skipif("tensorboard" not in INSTALLED, reason="needs tensorboardX and tensorboard")
def test_a_resumed_run_leaves_tensorboard_holding_metrics_jsonl_once(data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(runner.RunInterrupted, match="after step 3"):
        runner.run(_job(data, out, ("tensorboard",), signal_at=2), write=print)
    tree, point, _ = command.resolve(SPEC, {"resume": str(out)})
    assert tree.run.report_to == ("tensorboard",)           # recorded with the run
    runner.run(Regression(tree), resume=point, write=print)
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(7))
    scalars, _ = _tensorboard(out)
    assert scalars == {k: {s: float(np.float32(v)) for s, v in steps.items()}
                       for k, steps in _expected(records).items()}
    assert tree_record(tree)["run"]["report_to"] == ["tensorboard"]
