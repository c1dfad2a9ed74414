"""What a job is to the runner: its config tree's shared `run` section, and the algorithm.

A job (`zeroxla dpo`, `zeroxla grpo`, ...) is a config tree (a frozen dataclass whose `run`
field is a `RunSettings`) and an object with the `Job` methods: everything that can fail on a
bad option, a bad file or a bad model happens when the object is built (before the runner
makes any directory); then the runner calls `advance` once per step (or iteration), `evaluate`
on its cadence and `finish` at the end. Checkpoints, metrics.jsonl, the progress bar, stop
signals, divergence, resume and summary.json are the runner's (`zeroxla.app.run.runner`), so
they are the same for every job.

A job's records are plain dicts of floats; the runner adds the position (`Job.COUNTER`) and
refuses a non-finite `loss`. Nothing here uses JAX.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, ClassVar, Protocol

from zeroxla.app.cli_args import check_batch, check_sequence_length
from zeroxla.app.distributed import check_expert_parallel, check_sequence_parallel, job_mesh
from zeroxla.sharding.config import ZERO_STAGES


def _fail(owner: Any, name: str, accepted: str) -> None:
    raise ValueError(f"{type(owner).__name__}.{name}={getattr(owner, name)!r} is invalid; "
                     f"accepted: {accepted}")


# The experiment trackers of --report-to (`zeroxla.app.run.trackers`: their clients).
TRACKERS = ("tensorboard", "wandb", "mlflow")


def check_trackers(names: Any, shown: Any = None) -> None:
    """ValueError unless `names` are distinct names of `TRACKERS` (shown as `shown`, else
    comma-joined, in the message: what --report-to was given)."""
    if (not isinstance(names, tuple) or any(name not in TRACKERS for name in names)
            or len(set(names)) != len(names)):
        value = shown if shown is not None else (
            ",".join(map(str, names)) if isinstance(names, tuple) else repr(names))
        raise ValueError(f"--report-to {value} is invalid; accepted: none, or a "
                         f"comma-separated list of {', '.join(TRACKERS)} (e.g. tensorboard,wandb)")


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run section every job's tree holds: the cadence, the seed, where it writes.

    eval_every: evaluate every N steps (or iterations) and at the end; None: at the end only.
    save_every / keep_last: 0 saves only the final checkpoint / keeps them all. out_dir: None
    for a fresh runs/<job>-<YYYYmmdd-HHMMSS>; resume: a run directory, its checkpoint/ or one
    step in it. out_dir, resume and progress (`PER_INVOCATION`) belong to one invocation: a
    resumed run does not record or compare them. report_to: the experiment trackers every
    record also goes to (`zeroxla.app.run.trackers`; () for none).
    """

    NAME: ClassVar[str] = "run"
    seed: int = 0
    eval_every: int | None = None
    save_every: int = 0
    keep_last: int = 0
    out_dir: str | None = None
    resume: str | None = None
    progress: bool = True
    report_to: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, low in (("seed", 0), ("save_every", 0), ("keep_last", 0), ("eval_every", 1)):
            value = getattr(self, name)
            if value is None and name == "eval_every":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                _fail(self, name, f"an integer >= {low}" + (", or None (at the end only)"
                                                            if name == "eval_every" else ""))
        for name in ("out_dir", "resume"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _fail(self, name, "a path (str) or None")
        if not isinstance(self.progress, bool):
            _fail(self, "progress", "True or False")
        check_trackers(self.report_to)


PER_INVOCATION = ("out_dir", "resume", "progress")
MESH_ACCEPTED = "(nodes, local) with both integers >= 1, e.g. (2, 4)"


def is_mesh(value: Any) -> bool:
    """Whether `value` is a (nodes, local) mesh shape: two integers >= 1."""
    return (isinstance(value, tuple) and len(value) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value))


def check_sections(tree: Any) -> None:
    """ValueError naming the field when a section of `tree` (a field whose type is a dataclass)
    holds something else: `DPOJobConfig.lora=4 is invalid; accepted: a LoRAConfig`."""
    hints = typing.get_type_hints(type(tree))
    for field in dataclasses.fields(tree):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint) and not isinstance(getattr(tree, field.name), hint):
            _fail(tree, field.name, f"a {hint.__name__}")


@dataclasses.dataclass(frozen=True)
class ShardingSettings:
    """The sharding section of a post-training job's tree: the (nodes, local) mesh, the ZeRO
    stage and the sequence-parallel degree P, which splits each node's `local` devices into
    local/P data replicas x P sequence devices (`zeroxla train`'s `Sharding` has these three
    fields and more)."""

    NAME: ClassVar[str] = "sharding"
    mesh: tuple[int, int] = (2, 4)
    stage: int = 3
    sequence_parallel_size: int = 1
    expert_parallel_size: int = 1          # EP consecutive replicas of a node: an expert group

    def __post_init__(self) -> None:
        if not is_mesh(self.mesh):
            _fail(self, "mesh", MESH_ACCEPTED)
        if self.stage not in ZERO_STAGES or isinstance(self.stage, bool):
            _fail(self, "stage", ", ".join(map(str, ZERO_STAGES)))
        # In the options' words (--mesh, --sequence-parallel-size): this section is theirs.
        check_sequence_parallel(self.mesh, self.sequence_parallel_size)
        check_expert_parallel(self.mesh, self.sequence_parallel_size, self.expert_parallel_size)

    def check_batch(self, batch: int, option: str, seq_len: int | None = None) -> None:
        """Before any device work, ValueError naming the options unless `batch` rows (the value
        of `option`) divide over the data replicas (nodes x local / P) and, when given, each
        row's `seq_len` tokens (--seq-len) over the P sequence devices."""
        check_batch(batch, option, self.mesh, sequence=self.sequence_parallel_size)
        if seq_len is not None:
            check_sequence_length(seq_len, "--seq-len", self.sequence_parallel_size)

    def check_packing(self, packing: bool) -> None:
        """ValueError naming the options for --no-packing under --sequence-parallel-size > 1:
        a job's padded rows (per-answer or per-pair arrays) do not split along the sequence."""
        if self.sequence_parallel_size > 1 and not packing:
            raise ValueError(f"--no-packing with --sequence-parallel-size "
                             f"{self.sequence_parallel_size}: padded rows do not split along "
                             "the sequence; accepted: --packing (the default)")

    def describe(self) -> str:
        """'ZeRO-3 on a 2x4 mesh' (', sequences split over 2 devices' under P = 2)."""
        nodes, local = self.mesh
        split, experts = self.sequence_parallel_size, self.expert_parallel_size
        return (f"ZeRO-{self.stage} on a {nodes}x{local} mesh"
                + (f", sequences split over {split} devices" if split > 1 else "")
                + (f", experts split over {experts} devices" if experts > 1 else ""))

    def job_mesh(self) -> Any:
        """The section's `jax.sharding.Mesh` (`distributed.job_mesh`)."""
        return job_mesh(self.mesh, sequence=self.sequence_parallel_size,
                        expert=self.expert_parallel_size)


class Job(Protocol):
    """The algorithm of one job, as the runner drives it.

    NAME: the subcommand ("dpo"; the fresh run directory's prefix, the progress bar's label).
    UNIT: what `advance` does once ("step" or "iteration"). COUNTER: (key, offset): the key of
    a record's position and how it counts, `record[key] = done - offset` (("step", 0): the
    record of step 3 says step 3; ("iteration", 1): 0-based iterations). config: the job's
    tree (a frozen dataclass with a `run: RunSettings` field). total: steps (iterations) the
    run ends at. EXPORT_DIR: where the runner exports the final checkpoint as a
    Hugging Face checkpoint with `tokenizer` (None: no export). DATA: {option flag: tree
    field} of the files the job reads ({"--data": "data"}), whose contents a resumed run must
    find unchanged (`zeroxla.app.run.resume`). EVALUATE_FIRST: evaluate before the first
    unit of a fresh run (the record of position 0, and `finish`'s `before`).
    """

    NAME: ClassVar[str]
    UNIT: ClassVar[str]
    COUNTER: ClassVar[tuple[str, int]]
    EXPORT_DIR: ClassVar[str | None]
    PARTS: ClassVar[tuple[str | None, ...]]
    DATA: ClassVar[dict[str, str]]
    EVALUATE_FIRST: ClassVar[bool]
    config: Any
    tokenizer: Any

    @property
    def label(self) -> str:
        """A fresh run directory's prefix: runs/<label>-<YYYYmmdd-HHMMSS>."""

    @property
    def total(self) -> int: ...

    def parts(self) -> dict[str | None, Any]:
        """What the runner checkpoints and restores, keyed by `PARTS`: objects with a `step`
        (`make_step`'s) and a settable `state` (its TrainState). PARTS (None,) for a job of
        one (checkpoint/<n>); ("actor", "critic") for several (checkpoint/<name>/<n>). The
        first part's final checkpoint is the one exported."""

    def describe(self, first: int) -> str:
        """The run's first line: what trains on what, units `first`..`total`."""

    def advance(self, done: int) -> dict[str, float]:
        """Trains unit `done` + 1 (`done` units are finished); its record."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current state ({} when the job has none)."""

    def say(self, record: dict[str, Any]) -> str:
        """The line the runner prints for an evaluated record."""

    def checkpoint_metadata(self, out: Path, part: str | None) -> dict[str, Any]:
        """What a checkpoint of `part` in run directory `out` records beside the runner's own
        keys (tokenizer, adapters, ...)."""

    def checkpoint_model_config(self, part: str | None) -> Any:
        """The models config a checkpoint of `part` records for `zeroxla export` and
        `load_params` (`checkpoint.save`'s `model_config`), or None for the model's own."""

    def restored(self, metadata: dict[str, Any]) -> int | None:
        """Called after the runner restored the parts from a checkpoint with `metadata`. For a
        checkpoint without the runner's record (an older zeroxla's), returns the units it had
        done (None otherwise)."""

    def draw(self, out: Path, records: list[dict[str, Any]]) -> None:
        """Pictures of the records so far (loss curves), at the end, after a stop signal and
        after a divergence (process 0 only)."""

    def finish(self, out: Path, records: list[dict[str, Any]],
               before: dict[str, float]) -> dict[str, Any]:
        """After the final checkpoint of a finished run (`records`: the whole run's, `before`:
        `evaluate()` before the first unit of a fresh run, {} otherwise): the job's figures,
        summary.json's keys ("settings" defaults to the tree's record)."""


__all__ = ["Job", "MESH_ACCEPTED", "PER_INVOCATION", "RunSettings", "ShardingSettings", "TRACKERS",
           "check_sections", "check_trackers", "is_mesh"]
