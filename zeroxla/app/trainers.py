"""The jobs as TRL's trainers, for a notebook: `SFTTrainer`, `RewardTrainer`, `DPOTrainer`,
`GRPOTrainer`, each with its args (`SFTConfig`, ... : `zeroxla.app.trainer_args`).

    from zeroxla.app.trainers import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="runs/sft", reward_funcs=[my_reward, "format"],
                          args=GRPOConfig(output_dir="runs/g", max_steps=5, num_generations=4),
                          train_dataset=ds)
    records = trainer.train()            # metrics.jsonl's records, one per iteration

A trainer is a way to write the command line, not a second program: it builds the job's config
tree from `args`, `model` and `train_dataset`, and `train()` runs the job (`zeroxla.app.jobs`)
under the one runner (`zeroxla.app.run.runner`) as `zeroxla <job>` does, so the records equal
the command's with the same settings, one for one (checkpoints, metrics.jsonl, summary.json,
`report_to` trackers and the failure rule are the runner's).

- model: what the command's `--init-from` (SFT, reward, DPO) or `--actor` (GRPO) takes: a
  Hugging Face directory or a zeroxla run (or checkpoint) directory. SFTTrainer's None: the
  tree's models/ preset (`args`' `preset`).
- train_dataset: a `datasets.Dataset`, a list of row dicts, or a path the command's data option
  takes (JSON lines, Parquet, a `datasets` directory); None: the job's bundled data. An
  in-memory dataset is written into the run directory (a Dataset as Parquet, rows as JSON
  lines) and read by the one reader (`zeroxla.app.data_files`), as the command reads a file.
- The run directory (`run_dir`): args' `output_dir`, else a fresh runs/<job>-<time> chosen when
  the trainer is built. The runner claims it and applies the failure rule (`zeroxla.app.run`);
  a job that fails to start (rows without its columns) leaves the dataset file alone there,
  which is no run: the same output_dir is accepted again.
- GRPOTrainer's reward_funcs: callables `(prompts, completions, **row_fields) -> list[float]`
  (TRL's) or the names `--reward-funcs` takes ("accuracy", "format", "module:function"); the tree
  records a callable as `module:qualname`. A reward model is args' `reward`.

The devices are the caller's: a notebook sets the simulated CPU device count in its first cell,
before JAX starts, as the command does from `--mesh`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from zeroxla.app import data_files
from zeroxla.app.jobs.dpo import DPOJob
from zeroxla.app.jobs.grpo import GRPOJob
from zeroxla.app.jobs.reward import RewardJob
from zeroxla.app.jobs.train.job import TrainJob
from zeroxla.app.run import rundir, runner, trackers
from zeroxla.app.run.resume import data_paths
from zeroxla.app.trainer_args import (DPOConfig, GRPOConfig, RewardConfig, SFTConfig,
                                      TrainerArgs)
from zeroxla.rlhf.grpo.reward_funcs import BUILT_IN, load_reward_func

DATASET_NAME = "train_dataset"     # an in-memory dataset's file in the run directory


def _dataset_module() -> Any:
    """The `datasets` package if the caller imported it (a Dataset can exist only then)."""
    return sys.modules.get("datasets")


def _json_line(row: Any, number: int) -> str:
    """Row `number` of a list dataset as a JSON line; TypeError naming it when it is not a
    dict of JSON values."""
    if not isinstance(row, dict):
        raise TypeError(f"train_dataset[{number}] is a {type(row).__name__}; accepted: a dict "
                        "of columns per row")
    try:
        return json.dumps(row) + "\n"
    except TypeError as err:
        raise TypeError(f"train_dataset[{number}]: {err}; accepted: JSON values (str, numbers, "
                        "lists, dicts), or a datasets.Dataset") from None


class Trainer:
    """What every trainer shares: args to a tree, the dataset to a file, `train()`.

    ARGS: its args class. JOB: the job class the runner drives. MODEL: the tree field `model`
    sets; NEEDS_MODEL: whether None is refused. The data field is the job's (`JOB.DATA`)."""

    ARGS: ClassVar[type[TrainerArgs]]
    JOB: ClassVar[type]
    MODEL: ClassVar[str]
    NEEDS_MODEL: ClassVar[bool] = True

    def __init__(self, model: str | os.PathLike | None = None, args: TrainerArgs | None = None,
                 train_dataset: Any = None):
        kind = type(self).__name__
        args = self.ARGS() if args is None else args
        if not isinstance(args, self.ARGS):
            raise TypeError(f"{kind}(args={args!r}) is invalid; accepted: a {self.ARGS.__name__} "
                            f"(from zeroxla.app.trainers import {self.ARGS.__name__})")
        if not isinstance(model, (str, os.PathLike)) and (model is not None or self.NEEDS_MODEL):
            raise TypeError(f"{kind}(model={model!r}) is invalid; accepted: a path: a Hugging "
                            "Face directory or a zeroxla run directory"
                            + ("" if self.NEEDS_MODEL else ", or None for args' preset"))
        self.args, self.train_dataset = args, train_dataset
        self.run_dir = Path(args.settings.get("run.out_dir") or rundir.default_run_dir(
            self.JOB.NAME, now=datetime.datetime.now()))
        # (the file the job reads, a list's rows as JSON lines to write there)
        self.data_file, self._lines = self._data_file(train_dataset)
        supplied = {"run.out_dir": str(self.run_dir), self.data_field: self.data_file,
                    **self.own_fields(model)}
        self.tree = args.tree(**supplied)

    @property
    def data_field(self) -> str:
        """The tree's dotted field of the job's data option ("prompts", "data.path")."""
        (field,) = self.JOB.DATA.values()
        return field

    def own_fields(self, model: str | os.PathLike | None) -> dict[str, Any]:
        """The tree fields the trainer's own arguments set: `model`'s (GRPO: and the reward
        functions')."""
        return {self.MODEL: None if model is None else os.fspath(model)}

    def _data_file(self, dataset: Any) -> tuple[str | None, list[str] | None]:
        """(the path the job reads `dataset` from (the module docstring), a list's rows as
        JSON lines or None): the rows are checked here, so a bad one is refused before
        anything is written. TypeError naming `train_dataset` for anything else."""
        if dataset is None or isinstance(dataset, (str, os.PathLike)):
            return None if dataset is None else os.fspath(dataset), None
        module, kind = _dataset_module(), type(self).__name__
        if module is not None and isinstance(dataset, module.DatasetDict):
            raise TypeError(f"{kind}(train_dataset=DatasetDict with splits "
                            f"{', '.join(dataset)}) is invalid; accepted: one split, e.g. "
                            f"train_dataset=ds[{next(iter(dataset), 'train')!r}]")
        if module is not None and isinstance(dataset, module.Dataset):
            return str(self.run_dir / f"{DATASET_NAME}.parquet"), None
        if not isinstance(dataset, (list, tuple)):
            raise TypeError(f"{kind}(train_dataset={type(dataset).__name__}) is invalid; "
                            "accepted: a datasets.Dataset, a list of row dicts, a path (JSON "
                            "lines, Parquet, a datasets directory), or None (the bundled data)")
        lines = [_json_line(row, number) for number, row in enumerate(dataset)]
        return str(self.run_dir / f"{DATASET_NAME}.jsonl"), lines

    def _write_dataset(self) -> None:
        """The in-memory dataset as the file `data_file` names, inside the run directory."""
        if self.data_file is None or isinstance(self.train_dataset, (str, os.PathLike)):
            return
        Path(self.data_file).parent.mkdir(parents=True, exist_ok=True)
        if self._lines is None:
            self.train_dataset.to_parquet(self.data_file)
        else:
            Path(self.data_file).write_text("".join(self._lines), encoding="utf-8")

    def make_job(self) -> Any:
        """The job of `tree` (built once its data file exists)."""
        return self.JOB(self.tree)

    def train(self) -> list[dict[str, Any]]:
        """Runs the job to its end under the runner; metrics.jsonl's records (one per step, or
        iteration, evaluations added where they ran). The run directory must hold no run yet:
        a second `train()` of one trainer is refused (a new output_dir starts another)."""
        rundir.check_out_dir(self.run_dir)
        trackers.check_installed(self.tree.run.report_to)
        data_files.check_installed(data_paths(self.tree, self.JOB.DATA).values())
        self._write_dataset()       # a job that then fails to start leaves this file alone
        runner.run(self.make_job())
        return rundir.read_metrics(self.run_dir / rundir.METRICS_FILE, key=self.JOB.COUNTER[0])


class SFTTrainer(Trainer):
    """`zeroxla train` on prompt/completion, messages or text rows (TRL's SFTTrainer)."""

    ARGS, JOB, MODEL, NEEDS_MODEL = SFTConfig, TrainJob, "model.init_from", False

    def own_fields(self, model: str | os.PathLike | None) -> dict[str, Any]:
        """A Hugging Face `model` brings its own tokenizer, as `--init-from` does."""
        if model is None:
            return {}
        return {self.MODEL: os.fspath(model), "data.tokenizer": "pretrained"}


class RewardTrainer(Trainer):
    """`zeroxla reward` on chosen/rejected pairs (TRL's RewardTrainer)."""

    ARGS, JOB, MODEL = RewardConfig, RewardJob, "init_from"


class DPOTrainer(Trainer):
    """`zeroxla dpo` on chosen/rejected pairs (TRL's DPOTrainer)."""

    ARGS, JOB, MODEL = DPOConfig, DPOJob, "init_from"


def reward_name(fn: Any, where: str) -> str:
    """The name a reward function is recorded by: a `--reward-funcs` name as given, a built-in
    function's name, else `module:qualname`; TypeError naming `where` for a non-callable."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise TypeError(f"{where}={fn!r} is invalid; accepted: a callable (prompts, "
                        "completions, **row_fields) -> list[float], or a --reward-funcs name")
    built_in = [name for name, known in BUILT_IN.items() if known is fn]
    return built_in[0] if built_in else f"{fn.__module__}:{fn.__qualname__}"


class GRPOTrainer(Trainer):
    """`zeroxla grpo` with reward functions (TRL's GRPOTrainer); without a dataset, the bundled
    arithmetic task."""

    ARGS, JOB, MODEL = GRPOConfig, GRPOJob, "actor"

    def __init__(self, model: str | os.PathLike,
                 reward_funcs: Callable[..., Any] | str | Sequence[Any] | None = None,
                 args: GRPOConfig | None = None, train_dataset: Any = None):
        funcs = ([] if reward_funcs is None else [reward_funcs]
                 if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs))
        self.reward_names = tuple(reward_name(fn, f"reward_funcs[{i}]")
                                  for i, fn in enumerate(funcs))
        # Names load here, so a bad one is refused before anything runs, as the command does.
        self.reward_funcs = tuple(load_reward_func(fn) if isinstance(fn, str) else fn
                                  for fn in funcs)
        super().__init__(model, args, train_dataset)

    def own_fields(self, model: str | os.PathLike | None) -> dict[str, Any]:
        return {self.MODEL: os.fspath(model), "reward_funcs": self.reward_names}

    def make_job(self) -> GRPOJob:
        return GRPOJob(self.tree, reward_funcs=self.reward_funcs or None)


__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "RewardConfig",
           "RewardTrainer", "SFTConfig", "SFTTrainer", "Trainer", "reward_name"]
