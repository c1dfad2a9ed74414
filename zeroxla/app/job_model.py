"""The model a `zeroxla train` job trains: a `models/` preset, or a pretrained Hugging Face checkpoint
(`--init-from`), whose weights go straight into their ZeRO partitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from zeroxla import models
from zeroxla.app.job import TrainJobConfig
from zeroxla.app.train_data import SFTData, TextData
from zeroxla.checkpoint.pretrained import spread_hf_params
from zeroxla.models import hf as hf_io


def model_config(job: TrainJobConfig, data: TextData | SFTData) -> Any:
    """The models config: the pretrained checkpoint's (`init_from`), or the preset's with the
    tokenizer's vocabulary (65 characters for tiny-shakespeare, 256 bytes)."""
    if job.init_from is not None:
        config = hf_io.from_hf_config(hf_io.read_hf_config(job.init_from))
        data.tokenizer.check_vocab(config.vocab_size, f"{job.init_from}/config.json")
        where = f"the max_seq_len={config.max_seq_len} of --init-from {job.init_from}"
    else:
        _, preset = models.PRESETS[job.model]
        config = preset().replace(vocab_size=data.vocab_size)
        where = f"the max_seq_len={config.max_seq_len} of --model {job.model}"
    if job.seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {job.seq_len} exceeds {where}; accepted: --seq-len <= "
                         f"{config.max_seq_len}")
    return config


def model_factory(job: TrainJobConfig, config: Any) -> Callable[[], Any]:
    from flax import nnx

    cls = models.model_class(config)
    return lambda: cls(config, rngs=nnx.Rngs(job.seed))


def initial_state(job: TrainJobConfig, step: Any, config: Any, mesh: Any) -> Any:
    """A fresh run's state: the pretrained weights placed in their partitions, or a new model."""
    if job.init_from is None:
        return step.init()
    values = spread_hf_params(config, job.init_from, mesh, progress=job.progress,
                              dtype=np.dtype(step.config.master_dtype))
    return step.init_from(values, job.seed)


__all__ = ["initial_state", "model_config", "model_factory"]
