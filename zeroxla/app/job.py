"""What a training job is: `TrainJobConfig`, and how a resumed run gets its settings back.

Every checkpoint of `zeroxla train` records the job as it was given (`job_record`: `None` where
the DeepSpeed config or a default decided) next to the settings actually used. `--resume` rebuilds
the job from that record, with the options given on the command line winning
(`resumed_fields`), so a resumed run keeps its model, data, batch, mesh, ZeRO stage and dtype
unless told otherwise (`train_options.describe_resume` says which came back and which changed).
Nothing here uses a device.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from zeroxla import models
from zeroxla.app.tokenizer import TOKENIZERS
from zeroxla.inference.sampling import SCALAR_TYPES, TEMPERATURE_ACCEPTED, check_temperature

DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 1e-2
# --dtype: the compute dtype (ZeroConfig.compute_dtype); master weights stay float32. fp16 turns
# on DeepSpeed's dynamic loss scaling.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# --offload-optimizer / --offload-param: where ZeRO-Offload keeps that state.
OFFLOAD_DEVICES = ("none", "cpu")
# Fields that belong to one invocation, not to the run: never restored by --resume.
PER_INVOCATION = ("out_dir", "resume", "progress")
@dataclasses.dataclass(frozen=True)
class TrainJobConfig:
    """Everything `zeroxla train` needs. `None` means "from the DeepSpeed config, else default"."""

    model: str = "gpt-tiny"
    # A Hugging Face checkpoint directory to start from (config.json, safetensors, tokenizer):
    # its model replaces `model`, its tokenizer `tokenizer`.
    init_from: str | None = None
    # A UTF-8 text file, or {"prompt", "response"} pairs in a .jsonl or .json (supervised
    # fine-tuning: the loss on the responses only; `train_data.read_data` decides which);
    # None = bundled tiny-shakespeare.
    data: str | None = None
    tokenizer: str | None = None            # "char" or "byte"; None: char, or init_from's
    steps: int = 600
    batch_size: int | None = None           # global batch (train_batch_size)
    seq_len: int = 128
    lr: float | None = None                 # peak learning rate of the default schedule
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1               # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    gradient_clipping: float = 1.0          # global-norm clipping of the default recipe
    mesh: tuple[int, int] = (2, 4)          # (nodes, local devices per node)
    # Pipeline stages, each a NODESxLOCAL data-parallel mesh (devices = stages x nodes x local);
    # the micro-batches are grad_accum (DeepSpeed's gradient_accumulation_steps), 1F1B.
    pipeline_stages: int = 1
    zero_stage: int | None = None           # default 3
    # Parameters with fewer elements stay replicated (DeepSpeed's
    # stage3_param_persistence_threshold). None: from the DeepSpeed config, else 0. DeepSpeed's
    # default, 1e5, exceeds every leaf of gpt-tiny (the largest has 28,800 elements), so it would
    # partition nothing; 0 partitions every leaf and the summary shows ZeRO-3's 1/8 per device.
    persistence_threshold: int | None = None
    dtype: str | None = None                # "fp32", "bf16" or "fp16"; default fp32
    grad_accum: int | None = None           # micro-batches per step; default 1
    # ZeRO-Offload (ZeroConfig.offload_optimizer / offload_param): "none" or "cpu"; None: from
    # the DeepSpeed config, else "none".
    offload_optimizer: str | None = None
    offload_param: str | None = None
    deepspeed_config: str | None = None     # a DeepSpeed JSON path
    out_dir: str | None = None              # None: a fresh runs/<model>-<YYYYmmdd-HHMMSS>
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    val_fraction: float = 0.1
    sample_tokens: int = 400
    temperature: float = 0.8
    save_every: int = 0                     # checkpoint every N steps; 0: only the final one
    keep_last: int = 0                      # keep the newest K step checkpoints; 0: keep all
    progress: bool = True
    resume: str | None = None               # a run directory, its checkpoint/ or a step in it

    def __post_init__(self) -> None:
        def fail(name: str, accepted: str) -> None:
            raise ValueError(f"TrainJobConfig.{name}={getattr(self, name)!r} is invalid; "
                             f"accepted: {accepted}")

        if self.model not in models.PRESETS:
            fail("model", ", ".join(models.PRESETS))
        if self.tokenizer is not None and self.tokenizer not in TOKENIZERS:
            fail("tokenizer", ", ".join(TOKENIZERS) + ", or None (char; with init_from, its own)")
        for name in ("steps", "seq_len", "eval_every", "eval_batches", "pipeline_stages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, "an integer >= 1")
        for name in ("warmup_steps", "sample_tokens", "seed", "save_every", "keep_last"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                fail(name, "an integer >= 0")
        for name, default in (("batch_size", f"{DEFAULT_BATCH_SIZE}"), ("grad_accum", "1")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                fail(name, f"an integer >= 1, or None (from the DeepSpeed config, else {default})")
        if self.lr is not None and not 0 < self.lr < math.inf:
            fail("lr", "a finite positive number, or None")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("min_lr_ratio", "a number in [0, 1]")
        if not 0 <= self.weight_decay < math.inf:          # refuses nan too
            fail("weight_decay", "a finite number >= 0")
        if not 0 <= self.gradient_clipping < math.inf:
            fail("gradient_clipping", "0 (off) or a finite positive max norm")
        if (len(self.mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in self.mesh)):
            fail("mesh", "(nodes, local) with both >= 1, e.g. (2, 4)")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", "0, 1, 2, 3 or None")
        if self.persistence_threshold is not None and (
                not isinstance(self.persistence_threshold, int) or self.persistence_threshold < 0):
            fail("persistence_threshold", "an integer >= 0, or None")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in (None, *OFFLOAD_DEVICES):
                fail(name, ", ".join(OFFLOAD_DEVICES) + ", or None (from the DeepSpeed config, "
                     "else none)")
        if self.dtype is not None and self.dtype not in DTYPES:
            fail("dtype", ", ".join(DTYPES) + ", or None (from the DeepSpeed config, else fp32)")
        if not 0 < self.val_fraction < 1:
            fail("val_fraction", "a number in (0, 1)")
        try:           # the engine's own check (the closing sample), stored as a Python float
            object.__setattr__(self, "temperature", check_temperature(self.temperature))
        except ValueError:
            fail("temperature", f"{TEMPERATURE_ACCEPTED} ({SCALAR_TYPES})")

    @property
    def model_name(self) -> str:
        """The checkpoint directory it starts from, else the preset's name."""
        return self.init_from if self.init_from is not None else self.model

    @property
    def data_parallel_size(self) -> int:
        return self.mesh[0] * self.mesh[1]


def job_record(job: TrainJobConfig) -> dict[str, Any]:
    """The job as JSON, as given (None stays None), for a checkpoint; file paths made absolute
    so a resume from another working directory finds them. Per-invocation fields are left out."""
    record = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)
              if f.name not in PER_INVOCATION}
    record["mesh"] = list(job.mesh)
    for name in ("data", "deepspeed_config", "init_from"):
        if record[name] is not None:
            record[name] = os.path.abspath(record[name])
    return record


def resumed_fields(saved: Mapping[str, Any] | None,
                   explicit: Mapping[str, Any]) -> dict[str, Any]:
    """TrainJobConfig fields for a resumed run: the saved job's, then `explicit` (the options
    given on the command line) over them. Unknown saved keys (an older zeroxla) are dropped."""
    known = {f.name for f in dataclasses.fields(TrainJobConfig)} - set(PER_INVOCATION)
    fields = {k: v for k, v in (saved or {}).items() if k in known}
    if "mesh" in fields:
        fields["mesh"] = tuple(fields["mesh"])
    fields.update(explicit)
    return fields


__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_LR", "DTYPES", "DTYPE_NAMES", "PER_INVOCATION",
           "TrainJobConfig", "job_record", "resumed_fields"]
