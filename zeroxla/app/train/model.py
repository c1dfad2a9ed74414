"""The model a `zeroxla train` job trains: a `models/` preset, or a pretrained Hugging Face
checkpoint (`--init-from`), whose weights go straight into their ZeRO partitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from zeroxla import models
from zeroxla.app.train.config import TrainJobConfig
from zeroxla.app.train.data import SFTData, TextData
from zeroxla.checkpoint.pretrained import spread_hf_params
from zeroxla.models import hf as hf_io


# The heads (`models.hf`) each command's --init-from accepts, and where a refused one goes.
INIT_FROM_HEADS = {
    "zeroxla train": ((hf_io.CAUSAL_LM,), "use `zeroxla reward --init-from` or `zeroxla ppo "
                      "--reward` for a reward model (...ForSequenceClassification)"),
    "zeroxla reward": ((hf_io.CAUSAL_LM, hf_io.SEQUENCE_CLASSIFICATION),
                       "a causal LM gets a new zero score head, a reward model keeps its own"),
}


def init_from_head(init_from: str, command: str = "zeroxla train") -> str:
    """The head (`models.hf.hf_head`) of the HF checkpoint `init_from`, refused by its
    `architectures` class, before any tensor is read, when `command` does not take it."""
    accepted, instead = INIT_FROM_HEADS[command]
    try:
        return hf_io.check_head(hf_io.read_hf_config(init_from), accepted, user=f"`{command}`",
                                instead=instead)
    except ValueError as err:
        raise ValueError(f"--init-from {init_from}: {err}") from None


def pretrained_config(init_from: str, tokenizer: Any, seq_len: int,
                      command: str = "zeroxla train") -> Any:
    """The models config of the HF checkpoint `init_from`, refused (before any compute) when
    its head is not one `command` takes (`init_from_head`), `tokenizer` produces ids beyond its
    vocabulary or `seq_len` exceeds its positions."""
    init_from_head(init_from, command)
    config = hf_io.from_hf_config(hf_io.read_hf_config(init_from))
    tokenizer.check_vocab(config.vocab_size, f"{init_from}/config.json")
    _check_seq_len(seq_len, config, f"--init-from {init_from}")
    return config


def _check_seq_len(seq_len: int, config: Any, source: str) -> None:
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len={config.max_seq_len} of "
                         f"{source}; accepted: --seq-len <= {config.max_seq_len}")


def model_config(job: TrainJobConfig, data: TextData | SFTData) -> Any:
    """The models config: the pretrained checkpoint's (`init_from`), or the preset's with the
    tokenizer's vocabulary (65 characters for tiny-shakespeare, 256 bytes)."""
    init_from, seq_len = job.model.init_from, job.data.seq_len
    if init_from is not None:
        return pretrained_config(init_from, data.tokenizer, seq_len)
    _, preset = models.PRESETS[job.model.preset]
    config = preset().replace(vocab_size=data.vocab_size)
    _check_seq_len(seq_len, config, f"--model {job.model.preset}")
    return config


def model_factory(job: TrainJobConfig, config: Any) -> Callable[[], Any]:
    from flax import nnx

    cls = models.model_class(config)
    return lambda: cls(config, rngs=nnx.Rngs(job.run.seed))


def initial_state(job: TrainJobConfig, step: Any, config: Any, mesh: Any) -> Any:
    """A fresh run's state: the pretrained weights placed in their partitions, or a new model."""
    if job.model.init_from is None:
        return step.init()
    values = spread_hf_params(config, job.model.init_from, mesh, progress=job.run.progress,
                              dtype=np.dtype(step.layout.config.master_dtype))
    return step.init_from(values, job.run.seed)


__all__ = ["INIT_FROM_HEADS", "init_from_head", "initial_state", "model_config", "model_factory",
           "pretrained_config"]
