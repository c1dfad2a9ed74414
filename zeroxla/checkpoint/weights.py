"""Weights-only load: a checkpoint's model with its trained parameters, without the optimizer.

For evaluation, generation and fine-tuning from a checkpoint: `load_params` needs neither the
optimizer the run used nor a mesh. It reads each parameter (and the model state, such as
BatchNorm statistics) as numpy straight from the stored arrays, checksum-verified, and builds
the model on this process's first device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx

from zeroxla import models
from zeroxla.checkpoint.manager import model_config_from_record
from zeroxla.checkpoint.stored import StoredArrays
from zeroxla.sharding.model_def import ModelDef


def load_params(directory: str | Path, *, step: int | None = None,
                model: nnx.Module | Callable[[], nnx.Module] | None = None) -> nnx.Module:
    """The model of checkpoint `step` (default: the newest complete one) under `directory`,
    holding its trained float32 parameters.

    `model` gives the structure: None rebuilds it from the model config the checkpoint records
    (what `zeroxla train` and `save(..., model_config=...)` store); else an nnx.Module or a
    factory of the model that was trained (its values are replaced). Raises ValueError naming
    the first parameter the checkpoint lacks or stores with another shape.
    """
    arrays = StoredArrays(directory, step)
    if model is None:
        record = arrays.meta["model_config"]
        if record is None:
            raise ValueError(f"checkpoint step {arrays.info.step} at {arrays.info.path} records "
                             "no model config; pass model= (the module or a factory of it)")
        config = model_config_from_record(record)
        model_cls = models.model_class(config)
        factory: Callable[[], nnx.Module] = lambda: model_cls(config, rngs=nnx.Rngs(0))  # noqa: E731
    elif isinstance(model, nnx.Module):
        factory = lambda: model  # noqa: E731
    else:
        factory = model
    model_def, _ = ModelDef.of(nnx.eval_shape(factory))
    values = {}
    for path, shape, dtype in zip(model_def.paths, model_def.shapes, model_def.dtypes):
        values[path] = _read(arrays, f"params/{path}", shape).astype(dtype)
    model_state = {path: _read(arrays, f"model_state/{path}", shape).astype(dtype)
                   for path, shape, dtype in zip(model_def.state_paths, model_def.state_shapes,
                                                 model_def.state_dtypes)}
    device = jax.local_devices()[0]
    return model_def.module(jax.device_put(values, device), jax.device_put(model_state, device))


def _read(arrays: StoredArrays, name: str, shape: tuple[int, ...]):
    if name not in arrays:
        stored = arrays.meta["arrays"]
        raise ValueError(f"checkpoint step {arrays.info.step} has no array {name!r}; the model "
                         f"does not match the one that was saved (it has "
                         f"{sorted(n for n in stored if n.startswith('params/'))[:4]}...)")
    if arrays.shape(name) != tuple(shape):
        raise ValueError(f"checkpoint step {arrays.info.step}: {name!r} has shape "
                         f"{arrays.shape(name)}, the model's is {tuple(shape)}")
    return arrays.read(name)
