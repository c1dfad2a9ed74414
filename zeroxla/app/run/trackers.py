"""Experiment trackers: every metrics.jsonl record also to TensorBoard, W&B and MLflow.

    with opened(("tensorboard", "wandb"), out, job="dpo", key="step",
                config=tree_record(tree), resumed=False) as track:
        track.log(record)               # each record the runner writes to metrics.jsonl
        track.finish(summary)           # summary.json's figures

`--report-to` (TRL's `report_to`: `none`, or a list of tracker names) chooses them. Each tracker
is its package's own client, an optional extra of zeroxla (`pip install "zeroxla[wandb]"`),
imported only when a run asks for it; `check_installed` refuses a missing one before the run
starts, naming the package and the extra. What each one receives, once per run invocation:

- the records: every number of a record under its own key, at the record's position (the step,
  or the iteration) as the tracker's step. TensorBoard keeps a scalar as float32 (its
  `simple_value`); W&B and MLflow keep the float64.
- the configuration tree (`resume.tree_record`) once: W&B's run config (nested), MLflow's
  params (flattened to dotted keys, each value as JSON), TensorBoard's `config` text.
- the closing figures (summary.json without its settings): W&B's run summary, MLflow's
  `summary.json` artifact, TensorBoard's `summary` text.

Where they write: TensorBoard to `<run>/tensorboard/`; W&B to `<run>/wandb/` (offline with
`WANDB_MODE=offline`, synced later by `wandb sync`; the project is `WANDB_PROJECT`, else
"zeroxla"); MLflow to `MLFLOW_TRACKING_URI` when set, else a SQLite store in the run
directory, `<run>/mlflow.db` with artifacts in `<run>/mlartifacts/` (the experiment is
`MLFLOW_EXPERIMENT_NAME`, else "zeroxla"; SQLite is MLflow 3's local default, and it refuses
its older `./mlruns` directory store unless `MLFLOW_ALLOW_FILE_STORE` is set). A resumed
run sends the run's whole metrics.jsonl again: TensorBoard purges its earlier events
(`purge_step` 0) so its log is the file's records once; W&B and MLflow get a new run holding
them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from zeroxla.app.run.job import check_trackers
from zeroxla.app.run.resume import flat_record

NONE = "none"
# tracker -> (the module its client imports, the zeroxla extra that installs it)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboardX", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def parse_report_to(text: str) -> tuple[str, ...]:
    """--report-to's value as RunSettings.report_to: "tensorboard,wandb" -> ("tensorboard",
    "wandb"), "none" -> (); ValueError naming the accepted names otherwise."""
    names = tuple(name.strip() for name in text.split(","))
    if names == (NONE,):
        return ()
    check_trackers(names, text)
    return names


def missing(names: Sequence[str],
            find_spec: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """The trackers among `names` whose client module `find_spec` does not find."""
    return [name for name in names if find_spec(PACKAGES[name][0]) is None]


def check_installed(names: Sequence[str],
                    find_spec: Callable[[str], Any] = importlib.util.find_spec) -> None:
    """Before a run starts, ValueError naming each tracker of `names` whose package is missing,
    the package and the zeroxla extra that installs it (or naming a name that is no tracker:
    a tree whose run section does not check it, as train's `Run`)."""
    check_trackers(names)
    absent = missing(names, find_spec)
    if absent:
        needs = "; ".join(f"--report-to {name} needs the package {PACKAGES[name][0]}, which is "
                          f"not installed (pip install \"zeroxla[{PACKAGES[name][1]}]\")"
                          for name in absent)
        kept = [name for name in names if name not in absent]
        raise ValueError(f"{needs}; accepted: install it, or --report-to "
                         f"{','.join(kept) if kept else NONE}")


def scalars(record: Mapping[str, Any], key: str) -> dict[str, float]:
    """A record's numbers, its position `key` left out (a bool or a text is not a metric)."""
    return {k: float(v) for k, v in record.items()
            if k != key and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_params(tree: Mapping[str, Any]) -> dict[str, str]:
    """A nested record as MLflow params: {"sharding.mesh": "[2, 4]", "run.seed": "0"}."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flat_record(tree).items()}


def _fenced(value: Any) -> str:
    """JSON as a Markdown code block (TensorBoard's text plugin renders Markdown)."""
    return "```json\n" + json.dumps(value, indent=2) + "\n```"


class Tracker(Protocol):
    """One tracker's client over one run invocation."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any]) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoard:
    """tensorboardX's SummaryWriter on <run>/tensorboard/ (what `tensorboard --logdir` reads)."""

    def __init__(self, out: Path, job: str, config: dict[str, Any], resumed: bool):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=0 if resumed else None)
        self.writer.add_text("config", _fenced(config), 0)
        self.step = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.step = step

    def finish(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", _fenced(summary), self.step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandB:
    """A W&B run in <run>/wandb/ (`WANDB_MODE=offline`: files only, no network)."""

    def __init__(self, out: Path, job: str, config: dict[str, Any], resumed: bool):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "zeroxla"),
                              name=out.name, dir=str(out), config=config, job_type=job,
                              reinit="create_new")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflow:
    """An MLflow run through `MlflowClient` (no process-wide tracking URI is set): the
    `MLFLOW_TRACKING_URI` store, else SQLite in the run directory."""

    def __init__(self, out: Path, job: str, config: dict[str, Any], resumed: bool):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out.resolve()}/mlflow.db"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "zeroxla")
        experiment = self.client.get_experiment_by_name(name)
        local = (out / "mlartifacts").resolve().as_uri()
        experiment_id = (experiment.experiment_id if experiment is not None else
                         self.client.create_experiment(
                             name, artifact_location=None if "MLFLOW_TRACKING_URI" in os.environ
                             else local))
        run = self.client.create_run(experiment_id, run_name=out.name,
                                     tags={"zeroxla.job": job, "zeroxla.run_dir": str(out)})
        self.run_id = run.info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in
                                                   flat_params(config).items()])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in metrics.items()])

    def finish(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


CLIENTS: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB,
                                               "mlflow": MLflow}


class Trackers:
    """The run's trackers (none: every call does nothing); records keyed by `key` ("step",
    "iteration": the record's position, the trackers' step)."""

    def __init__(self, clients: Sequence[Tracker], key: str):
        self.clients, self.key = tuple(clients), key

    def log(self, record: Mapping[str, Any]) -> None:
        metrics = scalars(record, self.key)
        for client in self.clients:
            client.log(metrics, int(record[self.key]))

    def finish(self, summary: Mapping[str, Any]) -> None:
        figures = {k: v for k, v in summary.items() if k != "settings"}
        for client in self.clients:
            client.finish(figures)


@contextlib.contextmanager
def opened(names: Sequence[str], out: Path, *, job: str, key: str, config: dict[str, Any],
           resumed: bool) -> Iterator[Trackers]:
    """The trackers `names` of run directory `out` (job `job`, configuration tree record
    `config`), closed when the block ends: marked failed when it raises."""
    clients: list[Tracker] = []
    failed = False
    try:
        for name in names:
            clients.append(CLIENTS[name](Path(out), job, config, resumed))
        yield Trackers(clients, key)
    except BaseException:
        failed = True
        raise
    finally:
        for client in reversed(clients):
            client.close(failed)


__all__ = ["CLIENTS", "MLflow", "NONE", "PACKAGES", "TensorBoard", "Tracker", "Trackers", "WandB",
           "check_installed", "flat_params", "missing", "opened", "parse_report_to", "scalars"]
