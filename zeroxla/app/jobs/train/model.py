"""The model a `zeroxla train` job trains: a `models/` preset, or a pretrained Hugging Face
checkpoint (`--init-from`), whose weights go straight into their ZeRO partitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from zeroxla import models
from zeroxla.app.jobs.train.config import TrainJobConfig
from zeroxla.app.jobs.train.data import SFTData, TextData
from zeroxla.app.jobs.loading import (adapted_factory, check_seq_len, pretrained_config,
                                      with_adapters)
from zeroxla.checkpoint.pretrained import spread_hf_params, stage_layers


def model_config(job: TrainJobConfig, data: TextData | SFTData) -> Any:
    """The models config: the pretrained checkpoint's (`init_from`), or the preset's with the
    tokenizer's vocabulary (65 characters for tiny-shakespeare, 256 bytes)."""
    init_from, seq_len = job.model.init_from, job.data.seq_len
    if init_from is not None:
        return pretrained_config(init_from, data.tokenizer, seq_len)
    _, preset = models.PRESETS[job.model.preset]
    config = preset().replace(vocab_size=data.vocab_size)
    check_seq_len(seq_len, config, f"--model {job.model.preset}")
    return config


def model_factory(job: TrainJobConfig, config: Any) -> Callable[[], Any]:
    """The job's model; with `--lora-dim`, its adapters added (`convert_linear_layer_to_lora`,
    their A drawn after the model's own parameters from the same seed)."""
    return adapted_factory(models.model_class(config), config, job.lora.config(), job.run.seed)


def initial_state(job: TrainJobConfig, step: Any, config: Any, mesh: Any) -> Any:
    """A fresh run's state: the pretrained weights placed in their partitions, or a new model."""
    if job.model.init_from is None:
        return step.init()
    values = spread_hf_params(config, job.model.init_from, mesh, progress=job.run.progress,
                              dtype=np.dtype(step.layout.config.master_dtype),
                              stage_layers=stage_layers(step))
    if job.lora.enabled:
        values = with_adapters(values, model_factory(job, config), mesh)
    return step.init_from(values, job.run.seed)


__all__ = ["initial_state", "model_config", "model_factory"]
