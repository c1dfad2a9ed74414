"""A `zeroxla train` job as one typed config tree: `TrainJobConfig` and its sections.

    TrainJobConfig
      model     Model     the models/ preset, or a Hugging Face checkpoint to start from
      data      Data      the file, its tokenizer, the sequence length, the validation split
      schedule  Schedule  steps, global batch, the default recipe (lr, warmup, cosine, decay),
                          or a --config JSON's optimizer and scheduler sections
      sharding  Sharding  mesh, ZeRO stage, persistence, accumulation, prefetch, remat, SP, EP
      zeropp    ZeroPP    ZeRO++: hpZ, qwZ, qgZ
      numerics  Numerics  compute dtype, fp16 loss scaling, clipping, check_grad_overflow
      offload   Offload   ZeRO-Offload / ZeRO-Infinity
      pipeline  Pipeline  pipeline stages (1F1B over the accumulation's micro-batches)
      run       Run       seed, evaluation, checkpoints, the closing sample, run directory
      lora      LoRA      LoRA adapters (`zeroxla.app.jobs.train.lora`)
      deepspeed_config    the --config JSON the tree was filled from (None: none)

Each section is a frozen dataclass checked in `__post_init__`; an error names the field as
`TrainJobConfig.<section>.<field>`, its value and what is accepted. The fields of `sharding` (but
the mesh's: `mesh`, `expert_parallel_size`), `zeropp`, `numerics` and `offload` are ZeroConfig's
fields of the same name, checked by ZeroConfig's own checks; `TrainJobConfig.zero_config()` is
the one place the tree becomes the engine's ZeroConfig, and `engine_sections` the way back (a
DeepSpeed JSON's). Defaults are ZeroConfig's, except where `defaults.JOB_DEFAULTS` says why not.

A value in the tree is the value the job uses: nothing waits to be decided. None means absent:
no Hugging Face checkpoint, no data file (the bundled corpus), no --config, no run directory.
`.resolve` builds the tree from options, a --config JSON, a resumed run's record; no device.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import Any, ClassVar

from zeroxla import models
from zeroxla.app.distributed import check_expert_parallel
from zeroxla.app.tokenizers.basic import TOKENIZERS
from zeroxla.app.jobs.train.defaults import API_DEFAULTS, job_default
from zeroxla.app.jobs.train.lora import LoRA
from zeroxla.app.run.job import MESH_ACCEPTED, RunSettings, is_mesh
from zeroxla.deepspeed.keys import OPTIMIZER_NAMES, SCHEDULERS
from zeroxla.inference.sampling import SCALAR_TYPES, TEMPERATURE_ACCEPTED, check_temperature
from zeroxla.sharding.config import ZeroConfig

# Data.tokenizer with Model.init_from: the checkpoint's own tokenizer.json.
PRETRAINED = "pretrained"

def _fail(section: Any, name: str, accepted: str) -> None:
    raise ValueError(f"TrainJobConfig.{section.NAME}.{name}={getattr(section, name)!r} is "
                     f"invalid; accepted: {accepted}")


def _check_ints(section: Any, names: tuple[str, ...], minimum: int) -> None:
    for name in names:
        value = getattr(section, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            _fail(section, name, f"an integer >= {minimum}")


def _check_paths(section: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(section, name) is not None and not isinstance(getattr(section, name), str):
            _fail(section, name, "a path (a str), or None")


@dataclasses.dataclass(frozen=True)
class Model:
    """What is trained: a models/ preset, or a Hugging Face checkpoint directory (config.json,
    safetensors, tokenizer) whose model replaces the preset."""

    NAME: ClassVar[str] = "model"
    preset: str = "gpt-tiny"
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.preset not in models.PRESETS:
            _fail(self, "preset", ", ".join(models.PRESETS))
        _check_paths(self, ("init_from",))


@dataclasses.dataclass(frozen=True)
class Data:
    """What it trains on. path: a UTF-8 text file, or SFT rows (JSON, Parquet, a `datasets`
    directory: `train.data`), `split` a DatasetDict's; None: the bundled tiny-shakespeare.
    tokenizer: "char", "byte", or "pretrained" (with model.init_from: the checkpoint's own).
    packing: SFT examples packed into rows with segment ids (exact: the padded rows' loss)."""

    NAME: ClassVar[str] = "data"
    path: str | None = None
    split: str | None = None
    tokenizer: str = "char"
    seq_len: int = 128
    val_fraction: float = 0.1
    packing: bool = True           # SFT: whole examples packed into rows (`zeroxla.app.packing`)

    def __post_init__(self) -> None:
        _check_paths(self, ("path", "split"))
        if self.tokenizer not in (*TOKENIZERS, PRETRAINED):
            _fail(self, "tokenizer", ", ".join((*TOKENIZERS, PRETRAINED)))
        _check_ints(self, ("seq_len",), 1)
        if not 0 < self.val_fraction < 1:
            _fail(self, "val_fraction", "a number in (0, 1)")


@dataclasses.dataclass(frozen=True)
class DeepSpeedSection:
    """A --config JSON's `optimizer` or `scheduler` section, checked: its type (the canonical
    name: "adamw", "WarmupDecayLR") and params, as `zeroxla.deepspeed` reads them."""

    type: str
    params: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self) -> None:
        # Read-only, lists as tuples (a section read from a checkpoint's JSON equals its own).
        object.__setattr__(self, "params", types.MappingProxyType(
            {k: tuple(v) if isinstance(v, list) else v for k, v in self.params.items()}))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How long and on what batch it trains, and the optimizer. Without a --config optimizer
    or scheduler section the default recipe runs: AdamW (b1 0.9, b2 0.99, `weight_decay`), its
    lr warmed up linearly from 0 to `lr` over `warmup_steps`, then cosine down to
    lr * min_lr_ratio at `steps`. `optimizer` / `scheduler` (a JSON's sections) replace its
    optimizer / its schedule. batch_size is the global batch (DeepSpeed's train_batch_size)."""

    NAME: ClassVar[str] = "schedule"
    steps: int = 600
    batch_size: int = 32
    lr: float = 1e-2
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    optimizer: DeepSpeedSection | None = None
    scheduler: DeepSpeedSection | None = None

    def __post_init__(self) -> None:
        _check_ints(self, ("steps", "batch_size"), 1)
        _check_ints(self, ("warmup_steps",), 0)
        if not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            _fail(self, "lr", "a finite positive number")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(self, "min_lr_ratio", "a number in [0, 1]")
        if not 0 <= self.weight_decay < math.inf:          # refuses nan too
            _fail(self, "weight_decay", "a finite number >= 0")
        for name, known in (("optimizer", tuple(OPTIMIZER_NAMES)),
                            ("scheduler", tuple(SCHEDULERS))):
            section = getattr(self, name)
            if section is not None and (not isinstance(section, DeepSpeedSection)
                                        or section.type not in known):
                _fail(self, name, f"None, or a DeepSpeedSection of type {', '.join(known)}")


def _zero_names(section: type) -> tuple[str, ...]:
    """The ZeroConfig fields an engine-facing section holds."""
    return tuple(f.name for f in dataclasses.fields(section) if f.name in API_DEFAULTS)


def _check_as_zero_config(section: Any) -> None:
    """`section`'s ZeroConfig fields through ZeroConfig's own checks (the others at their
    defaults); an error names the tree's field."""
    try:
        ZeroConfig(**{name: getattr(section, name) for name in _zero_names(type(section))})
    except ValueError as err:
        raise ValueError(renamed(err)) from None


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The mesh (nodes, local devices per node; P = sequence_parallel_size of them a sequence's,
    EP = expert_parallel_size replicas an expert group, checked in the options' words) and how
    ZeRO partitions over it (ZeroConfig's fields of these names)."""

    NAME: ClassVar[str] = "sharding"
    mesh: tuple[int, int] = (2, 4)
    stage: int = job_default("stage")
    persistence_threshold: int = job_default("persistence_threshold")
    gradient_accumulation_steps: int = job_default("gradient_accumulation_steps")
    prefetch: bool = job_default("prefetch")
    max_live_parameters: int = job_default("max_live_parameters")
    remat: str = job_default("remat")
    sequence_parallel_size: int = job_default("sequence_parallel_size")
    sequence_parallel_strategy: str = job_default("sequence_parallel_strategy")
    expert_parallel_size: int = 1       # not a ZeroConfig field: the mesh's expert axis

    def __post_init__(self) -> None:
        if not is_mesh(self.mesh):
            _fail(self, "mesh", MESH_ACCEPTED)
        _check_as_zero_config(self)
        local = self.mesh[1]
        if self.sequence_parallel_size is None or local % self.sequence_parallel_size:
            _fail(self, "sequence_parallel_size", f"a divisor of the local devices mesh[1]="
                  f"{local}: " + ", ".join(str(d) for d in range(1, local + 1) if local % d == 0))
        check_expert_parallel(self.mesh, self.sequence_parallel_size, self.expert_parallel_size)


@dataclasses.dataclass(frozen=True)
class ZeroPP:
    """ZeRO++ (Wang et al. 2023): hpZ's secondary partition, qwZ's quantized weight gathers,
    qgZ's quantized gradient reduce-scatter (ZeroConfig's fields of these names; stage 3)."""

    NAME: ClassVar[str] = "zeropp"
    hpz_partition_size: int = job_default("hpz_partition_size")
    quantized_weights: bool = job_default("quantized_weights")
    quantized_nontrainable_weights: bool = job_default("quantized_nontrainable_weights")
    quantized_gradients: bool = job_default("quantized_gradients")
    weight_quantization_bits: int = job_default("weight_quantization_bits")
    weight_quantization_group_size: int = job_default("weight_quantization_group_size")
    gradient_quantization_group_size: int = job_default("gradient_quantization_group_size")

    __post_init__ = _check_as_zero_config


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The compute dtype (master weights and optimizer state stay float32), fp16's dynamic loss
    scaling, gradient clipping and the overflow check (ZeroConfig's fields of these names)."""

    NAME: ClassVar[str] = "numerics"
    compute_dtype: str = job_default("compute_dtype")
    loss_scale: float = job_default("loss_scale")
    initial_scale_power: int = job_default("initial_scale_power")
    loss_scale_window: int = job_default("loss_scale_window")
    hysteresis: int = job_default("hysteresis")
    min_loss_scale: float = job_default("min_loss_scale")
    gradient_clipping: float = job_default("gradient_clipping")
    check_grad_overflow: bool = job_default("check_grad_overflow")

    def __post_init__(self) -> None:
        _check_as_zero_config(self)
        if not 0 <= self.gradient_clipping < math.inf:          # refuses nan and inf too
            _fail(self, "gradient_clipping", "0 (off) or a finite positive max norm")


@dataclasses.dataclass(frozen=True)
class Offload:
    """ZeRO-Offload / ZeRO-Infinity: "none" or "cpu" (host memory) for the optimizer state and
    float32 masters, and for the parameter partitions (ZeroConfig's fields of these names)."""

    NAME: ClassVar[str] = "offload"
    offload_optimizer: str = job_default("offload_optimizer")
    offload_param: str = job_default("offload_param")
    offload_pin_memory: bool = job_default("offload_pin_memory")

    __post_init__ = _check_as_zero_config


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline stages, each a sharding.mesh of data-parallel devices (devices = stages x nodes x
    local); the micro-batches are sharding.gradient_accumulation_steps, run 1F1B."""

    NAME: ClassVar[str] = "pipeline"
    stages: int = 1

    def __post_init__(self) -> None:
        _check_ints(self, ("stages",), 1)


@dataclasses.dataclass(frozen=True)
class Run(RunSettings):
    """The run: every job's run section (`zeroxla.app.run.job.RunSettings`: seed, evaluation
    and checkpoint cadence, where it writes, --resume) with train's evaluation batches and the
    closing sample; train evaluates every 100 steps by default."""

    NAME: ClassVar[str] = "run"
    eval_every: int = 100
    eval_batches: int = 8
    sample_tokens: int = 400
    temperature: float = 0.8

    def __post_init__(self) -> None:
        # Train's own checks first: their messages name the tree's field (TrainJobConfig.run.x).
        _check_ints(self, ("eval_every", "eval_batches"), 1)
        _check_ints(self, ("seed", "save_every", "keep_last", "sample_tokens"), 0)
        _check_paths(self, ("out_dir", "resume"))
        try:           # the engine's own check (the closing sample), stored as a Python float
            object.__setattr__(self, "temperature", check_temperature(self.temperature))
        except ValueError:
            _fail(self, "temperature", f"{TEMPERATURE_ACCEPTED} ({SCALAR_TYPES})")
        if not isinstance(self.progress, bool):
            _fail(self, "progress", "True or False")


ENGINE_SECTIONS = (Sharding, ZeroPP, Numerics, Offload)
# ZeroConfig field -> the section that holds it.
SECTION_OF_FIELD = {name: cls.NAME for cls in ENGINE_SECTIONS for name in _zero_names(cls)}


def renamed(err: ValueError) -> str:
    """ZeroConfig's message ("ZeroConfig.stage=5 is invalid; ...") naming the tree's field."""
    text = str(err)
    match = re.match(r"ZeroConfig\.(\w+)=", text)
    if match is None or match.group(1) not in SECTION_OF_FIELD:
        return text
    return f"TrainJobConfig.{SECTION_OF_FIELD[match.group(1)]}.{text.removeprefix('ZeroConfig.')}"


def engine_sections(zero: ZeroConfig, mesh: tuple[int, int]) -> dict[str, Any]:
    """The sharding, zeropp, numerics and offload sections that hold `zero` on `mesh`."""
    sections = {cls.NAME: cls(**{name: getattr(zero, name) for name in _zero_names(cls)})
                for cls in ENGINE_SECTIONS}
    sections["sharding"] = dataclasses.replace(sections["sharding"], mesh=tuple(mesh))
    return sections


@dataclasses.dataclass(frozen=True)
class TrainJobConfig:
    """Everything `zeroxla train` does, as a tree of sections (see the module docstring)."""

    model: Model = Model()
    data: Data = Data()
    schedule: Schedule = Schedule()
    sharding: Sharding = Sharding()
    zeropp: ZeroPP = ZeroPP()
    numerics: Numerics = Numerics()
    offload: Offload = Offload()
    pipeline: Pipeline = Pipeline()
    run: Run = Run()
    lora: LoRA = LoRA()
    deepspeed_config: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            kind = SECTIONS.get(field.name)
            if kind is not None and not isinstance(getattr(self, field.name), kind):
                raise ValueError(f"TrainJobConfig.{field.name}={getattr(self, field.name)!r} is "
                                 f"invalid; accepted: a {kind.__name__}")
        if self.deepspeed_config is not None and not isinstance(self.deepspeed_config, str):
            raise ValueError(f"TrainJobConfig.deepspeed_config={self.deepspeed_config!r} is "
                             "invalid; accepted: None or the JSON's path")
        zero, (nodes, local) = self.zero_config(), self.sharding.mesh
        sequence, how = zero.sequence_parallel_size, zero.sequence_parallel_strategy
        try:
            zero.validate_for_mesh(local, nodes * local, sequence)
        except ValueError as err:
            raise ValueError(renamed(err)) from None
        self._check_batch()
        if self.data.seq_len % (chunks := models.sequence_parallel.SequenceParallel(
                "sequence", sequence, how).chunks):                 # zigzag: 2P chunks
            raise ValueError(f"TrainJobConfig.data.seq_len={self.data.seq_len} is invalid; "
                             f"accepted: a multiple of {chunks} ({how}, P = {sequence})")
        if (self.model.init_from is None) != (self.data.tokenizer != PRETRAINED):
            accepted = (f"{PRETRAINED!r} (a pretrained model's vocabulary is its own "
                        "tokenizer's)" if self.model.init_from is not None
                        else f"{', '.join(TOKENIZERS)} ({PRETRAINED!r} needs model.init_from)")
            raise ValueError(f"TrainJobConfig.data.tokenizer={self.data.tokenizer!r} with "
                             f"model.init_from={self.model.init_from!r} is invalid; accepted: "
                             f"{accepted}")

    def _check_batch(self) -> None:
        batch, accum = self.schedule.batch_size, self.sharding.gradient_accumulation_steps
        unit, sp = self.data_parallel_size * accum, self.sharding.sequence_parallel_size
        if batch % unit:
            what, over = (("data replicas", f" / sharding.sequence_parallel_size={sp}")
                          if sp > 1 else ("data-parallel devices", ""))
            raise ValueError(
                f"TrainJobConfig.schedule.batch_size={batch} is invalid; accepted: a multiple "
                f"of the {self.data_parallel_size} {what} of sharding.mesh {self.sharding.mesh}"
                f"{over} x sharding.gradient_accumulation_steps={accum}, e.g. "
                f"{max(unit, batch // unit * unit)}")

    def zero_config(self) -> ZeroConfig:
        """The engine's ZeroConfig: the fields of the sharding, zeropp, numerics and offload
        sections. Raises naming the tree's field where they do not fit together."""
        try:
            return ZeroConfig(**{name: getattr(getattr(self, section), name)
                                 for name, section in SECTION_OF_FIELD.items()})
        except ValueError as err:
            raise ValueError(renamed(err)) from None

    @property
    def model_name(self) -> str:
        """The checkpoint directory it starts from, else the preset's name."""
        return self.model.init_from if self.model.init_from is not None else self.model.preset

    @property
    def data_parallel_size(self) -> int:
        """The data replicas the batch's rows divide over (DeepSpeed's dp = world / sp)."""
        nodes, local = self.sharding.mesh
        return nodes * local // self.sharding.sequence_parallel_size

    @property
    def micro_batch_size(self) -> int:
        """Rows per device per micro-batch (DeepSpeed's train_micro_batch_size_per_gpu)."""
        return self.schedule.batch_size // (self.data_parallel_size
                                            * self.sharding.gradient_accumulation_steps)


# Section name -> its class, in the tree's order.
SECTIONS: dict[str, type] = {cls.NAME: cls for cls in (Model, Data, Schedule, Sharding, ZeroPP,
                                                       Numerics, Offload, Pipeline, Run, LoRA)}

__all__ = ["ENGINE_SECTIONS", "PRETRAINED", "SECTIONS", "SECTION_OF_FIELD",
           "Data", "DeepSpeedSection", "Model", "Numerics", "Offload", "Pipeline", "Run",
           "Schedule", "Sharding", "TrainJobConfig", "ZeroPP", "engine_sections", "renamed"]
