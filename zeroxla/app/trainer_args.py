"""A trainer's `args` (TRL's `SFTConfig`, `RewardConfig`, `DPOConfig`, `GRPOConfig`) as the
job's own config tree: the settings a notebook gives become the tree `zeroxla <job>` runs.

    args = GRPOConfig(output_dir="runs/g", max_steps=3, num_generations=4, mesh=(1, 8))
    tree = args.tree(actor="runs/sft", prompts=None)      # a GRPOJobConfig

A setting is named
  - by TRL's name where it differs from the tree's (`TRL_NAMES`, one row each: `max_steps` is
    `iterations`), TRL's `transformers.TrainingArguments` names shared by every job first;
  - by a field of the tree itself (`iterations`, `reward_weights`, a whole section:
    `grpo=zeroxla.rlhf.GRPOConfig(...)`);
  - by a field of exactly one section (`num_generations` is `grpo.num_generations`, `mesh`
    `sharding.mesh`), or by its dotted path (`grpo.beta`) where several sections hold it.
Values are the tree's: lists become tuples (`mesh=[1, 8]`), `report_to` is taken as TRL takes
it ("none", "tensorboard", "tensorboard,wandb" or a list). The fields the trainer fills from its
own arguments (`model`, `train_dataset`) are not settings. An unknown, ambiguous or repeated
name is refused naming it and what is accepted; a bad value is refused by the tree's own checks,
their message prefixed with the setting as given. Nothing here uses JAX.

The TRL-style names live in the application (`zeroxla.app.trainers`): `zeroxla.rlhf.GRPOConfig`
is the algorithm's hyper-parameters, the `grpo` section of this module's `GRPOConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from zeroxla.app.jobs.dpo import DPOJobConfig
from zeroxla.app.jobs.grpo import GRPOJobConfig
from zeroxla.app.jobs.reward import RewardJobConfig
from zeroxla.app.jobs.train.config import TrainJobConfig
from zeroxla.app.run.trackers import parse_report_to

# transformers.TrainingArguments' names (every TRL config's base) -> every job's tree field.
RUN_NAMES: dict[str, str] = {
    "output_dir": "run.out_dir",
    "save_steps": "run.save_every",
    "save_total_limit": "run.keep_last",
    "eval_steps": "run.eval_every",
}


def tree_fields(tree: type) -> dict[str, type | None]:
    """Every settable dotted field of the tree type `tree`: its own fields ("iterations") and
    each section's ("grpo.beta"), the section dataclass as the value of a section's own name
    (None for a plain field)."""
    hints = typing.get_type_hints(tree)
    found: dict[str, type | None] = {}
    for field in dataclasses.fields(tree):
        hint = hints[field.name]
        section = hint if dataclasses.is_dataclass(hint) else None
        found[field.name] = section
        if section is not None:
            found.update({f"{field.name}.{inner.name}": None
                          for inner in dataclasses.fields(section)})
    return found


def _default(tree: type, name: str) -> Any:
    """The tree type's default of its field `name` (a section's default instance)."""
    field = {f.name: f for f in dataclasses.fields(tree)}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _value(path: str, value: Any) -> Any:
    """A setting's value as the tree holds it: lists as tuples, report_to as TRL takes it."""
    if path == "run.report_to":
        if value is None:
            return ()
        if isinstance(value, str):
            return parse_report_to(value)
    return tuple(value) if isinstance(value, list) else value


class TrainerArgs:
    """A job's settings under TRL's and the tree's names (the module docstring). `settings`:
    {dotted tree field: value}; `names`: {dotted tree field: the name it was given by}."""

    TREE: ClassVar[type]                      # the job's config tree
    TRL_NAMES: ClassVar[Mapping[str, str]]    # TRL's name -> the tree's dotted field
    SUPPLIED: ClassVar[tuple[str, ...]]       # filled by the trainer's model / train_dataset

    def __init__(self, **settings: Any):
        self.settings: dict[str, Any] = {}
        self.names: dict[str, str] = {}
        for name, value in settings.items():
            path = self.path(name)
            if path in self.names:
                raise ValueError(f"{type(self).__name__}: {self.names[path]} and {name} both "
                                 f"set {self.TREE.__name__}.{path}; accepted: one of them")
            try:
                self.settings[path] = _value(path, value)
            except ValueError as err:
                raise ValueError(f"{type(self).__name__}({name}={value!r}): {err}") from None
            self.names[path] = name

    @classmethod
    def trl_names(cls) -> dict[str, str]:
        """TRL's names this config accepts -> the tree's dotted field."""
        return {**RUN_NAMES, **cls.TRL_NAMES}

    @classmethod
    def path(cls, name: str) -> str:
        """The dotted tree field setting `name` stands for (the module docstring's rules)."""
        fields, trl = tree_fields(cls.TREE), cls.trl_names()
        path = trl.get(name, name if name in fields else None)
        if path is None:
            held = [p for p in fields if p.endswith(f".{name}")]
            if len(held) > 1:
                raise ValueError(f"{cls.__name__}({name}=...): {name} is a field of several "
                                 f"sections; accepted: its dotted path, one of {', '.join(held)}")
            path = held[0] if held else None
        if path is None:
            raise ValueError(f"{cls.__name__}({name}=...): unknown setting {name!r}; accepted: "
                             f"TRL's names {', '.join(sorted(trl))}, or a field of "
                             f"{cls.TREE.__name__}: {', '.join(sorted(fields))}")
        if path in cls.SUPPLIED or path.split(".")[0] in cls.SUPPLIED:
            raise ValueError(f"{cls.__name__}({name}=...) sets {cls.TREE.__name__}.{path}, "
                             "which the trainer's model / train_dataset give; accepted: pass "
                             "it to the trainer")
        return path

    def tree(self, **supplied: Any) -> Any:
        """The job's tree: its defaults, the `supplied` dotted fields (the trainer's model and
        data) and the settings over them; a refusal names the setting as it was given."""
        given = {**supplied, **self.settings}
        root: dict[str, Any] = {k: v for k, v in given.items() if "." not in k}
        sections: dict[str, dict[str, Any]] = {}
        for path, value in given.items():
            if "." in path:
                section, field = path.split(".", 1)
                sections.setdefault(section, {})[field] = value
        for section, changes in sections.items():
            base = root.get(section, _default(self.TREE, section))
            with self._named(section):
                root[section] = dataclasses.replace(base, **changes)
        with self._named(None):
            return self.TREE(**root)

    @contextlib.contextmanager
    def _named(self, section: str | None) -> Iterator[None]:
        """Re-raises the tree's refusal ("DPOConfig.beta=-1 is invalid; ...") of `section` (None:
        the tree's own checks) with the setting as the caller wrote it in front
        ("DPOConfig(beta=-1): ..."); unchanged when it names none of the settings."""
        try:
            yield
        except ValueError as err:
            text = str(err)
            for path, name in self.names.items():
                head, _, field = path.rpartition(".")
                shown = f".{path}=" if section is None else f".{field}="
                if (section is None or head == section) and shown in text:
                    raise ValueError(f"{type(self).__name__}({name}={self.settings[path]!r}): "
                                     f"{text}") from None
            raise

    def __repr__(self) -> str:
        given = ", ".join(f"{self.names[p]}={v!r}" for p, v in self.settings.items())
        return f"{type(self).__name__}({given})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.settings == self.settings


class SFTConfig(TrainerArgs):
    """`zeroxla train`'s tree (`TrainJobConfig`) under TRL's SFTConfig names."""

    TREE = TrainJobConfig
    TRL_NAMES = {"max_steps": "schedule.steps", "learning_rate": "schedule.lr",
                 "max_length": "data.seq_len", "max_grad_norm": "numerics.gradient_clipping"}
    SUPPLIED = ("model.init_from", "data.path")


class RewardConfig(TrainerArgs):
    """`zeroxla reward`'s tree (`RewardJobConfig`) under TRL's RewardConfig names."""

    TREE = RewardJobConfig
    TRL_NAMES = {"max_steps": "steps", "max_length": "seq_len"}
    SUPPLIED = ("init_from", "data")


class DPOConfig(TrainerArgs):
    """`zeroxla dpo`'s tree (`DPOJobConfig`) under TRL's DPOConfig names."""

    TREE = DPOJobConfig
    TRL_NAMES = {"max_steps": "steps", "max_length": "dpo.seq_len"}
    SUPPLIED = ("init_from", "data")


class GRPOConfig(TrainerArgs):
    """`zeroxla grpo`'s tree (`GRPOJobConfig`) under TRL's GRPOConfig names; its `grpo` section
    is `zeroxla.rlhf.GRPOConfig` (TRL's names already). The reward functions are the trainer's
    `reward_funcs`."""

    TREE = GRPOJobConfig
    TRL_NAMES = {"max_steps": "iterations", "vllm_importance_sampling_cap": "grpo.tis_cap"}
    SUPPLIED = ("actor", "prompts", "reward_funcs")


__all__ = ["DPOConfig", "GRPOConfig", "RUN_NAMES", "RewardConfig", "SFTConfig", "TrainerArgs",
           "tree_fields"]
