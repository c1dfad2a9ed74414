"""`make_step`: the one place that builds a step's layout and chooses what runs it.

    step = make_step(model, mesh, optimizer=optax.adamw(1e-3), config=ZeroConfig(stage=3))

The layout (`zeroxla.engine.layout.ZeroLayout`: axes, config, plan, collectives, optimizer layout,
shardings) is built once; the plain step (`zeroxla.engine.step.ZeroStep`) runs it, with the
pipeline executor (`zeroxla.pipeline.executor`) as its gradient pass when `pipeline=` is given.
So the engine never imports the pipeline: this module sits above both.
"""

from __future__ import annotations

from collections.abc import Callable

import optax
from flax import nnx
from jax.sharding import Mesh

from zeroxla.compat.cache import check_persistent_cache
from zeroxla.engine.layout import ModelSource, zero_layout
from zeroxla.engine.loss import LossFn
from zeroxla.engine.step import ZeroStep
from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.executor import PipelineExecutor
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.model_def import Filter


def make_step(model: nnx.Module | Callable[[], nnx.Module], mesh: Mesh, *,
              optimizer: optax.GradientTransformation | None = None,
              config: ZeroConfig | None = None, loss_fn: LossFn | None = None,
              trainable: Filter | None = None,
              pipeline: PipelineConfig | None = None) -> ZeroStep:
    """Builds the ZeRO training step for `model` on `mesh` (see `zeroxla.engine.step`).

    `model` is an `nnx.Module` (its current parameters become the initial state) or a zero-arg
    factory (the state is then created directly in sharded form). `loss_fn(model, batch)`
    returns the mean loss over the batch it is given, or `(sum, count)` (then the step's loss
    is the exact mean over the global batch); the default is next-token cross-entropy, masked
    by `batch["loss_mask"]` when present. `optimizer` is any optax transformation, applied to
    the whole (logical) parameters as on one device. `trainable` is an nnx filter (a Variable
    type, `nnx.PathContains("lora")`, a `(path, variable) -> bool` callable, `nnx.Not(...)`,
    ...) choosing the parameters to train; None trains all. The rest are frozen.
    `pipeline` (a `zeroxla.PipelineConfig`) pipelines the model's layers over the mesh's
    `stage` axis (`zeroxla.pipeline.executor`). Over CPU devices before jax 0.12, JAX's
    persistent compilation cache is refused (`zeroxla.compat.cache` says why).
    """
    check_persistent_cache(mesh.devices.flat)        # before anything is traced or compiled
    source = ModelSource.of(model, trainable)
    layout = zero_layout(source, mesh, optimizer=optimizer, config=config, loss_fn=loss_fn,
                         trainable=trainable)
    if pipeline is None:
        return ZeroStep(source, layout)
    # The executor's layout stores each stage's layers only (`zeroxla.pipeline.storage`).
    executor = PipelineExecutor(layout, pipeline)
    return ZeroStep(source, executor.layout, gradient_pass=executor)


__all__ = ["make_step"]
