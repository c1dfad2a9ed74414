"""Pipelining's bad inputs: each a ValueError naming the field, the bad value and what is
accepted, raised before anything is compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.pipeline import PipelineConfig


@pytest.mark.parametrize("kwargs,message", [
    (dict(micro_batches=0), r"PipelineConfig.micro_batches=0 is invalid; accepted: an integer >= 1"),
    (dict(micro_batches=2.0), r"PipelineConfig.micro_batches=2.0 is invalid"),
    (dict(micro_batches=2, schedule="interleaved"),
     r"PipelineConfig.schedule='interleaved' is invalid; accepted: \"1f1b\", \"gpipe\""),
    (dict(micro_batches=2, partition_method="profile"),
     r"PipelineConfig.partition_method='profile' is invalid; accepted: \"parameters\", "
     r"\"uniform\", \"type:<regex>\""),
    (dict(micro_batches=2, partition_method="type:("),
     r"PipelineConfig.partition_method='type:\(' is invalid; accepted: .* valid regex"),
    (dict(micro_batches=2, zero3_gather="never"),
     r"PipelineConfig.zero3_gather='never' is invalid; accepted: \"micro_batch\", \"step\""),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_config_defaults_and_replace():
    config = PipelineConfig(4)
    assert (config.schedule, config.partition_method, config.zero3_gather) == (
        "1f1b", "parameters", "micro_batch")
    assert config.schedule_class.__name__ == "TrainSchedule"
    assert config.replace(schedule="gpipe").schedule_class.__name__ == "GPipeSchedule"
    assert PipelineConfig(2, partition_method="type:Block").partition_method == "type:Block"
    assert PipelineConfig(2, partition_method="UNIFORM").partition_method == "UNIFORM"


def test_stages_not_dividing_the_devices():
    with pytest.raises(ValueError, match=r"stages=3 does not divide the 8 devices; use one of "
                                         r"\[1, 2, 4, 8\]"):
        zeroxla.make_mesh(1, stages=3)


def _step(model=None, stages=2, pipeline=PipelineConfig(2), **config):
    model = model if model is not None else models.build("gpt-tiny", num_layers=2)
    return zeroxla.make_step(model, zeroxla.make_mesh(1, stages=stages),
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(**config),
                             pipeline=pipeline)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"stages=4 \(the mesh's 'stage' axis\) exceeds the "
                                         r"model's num_layers=2; accepted: stages <= 2"):
        _step(stages=4)


def test_micro_batches_not_dividing_the_per_replica_batch():
    step = _step(pipeline=PipelineConfig(3))               # 4 data replicas per stage
    batch = {"inputs": np.zeros((8, 4), np.int32), "targets": np.zeros((8, 4), np.int32)}
    with pytest.raises(ValueError, match=r"PipelineConfig.micro_batches=3 does not divide the "
                                         r"per-replica batch \(global batch 8 over 4 "
                                         r"data-parallel replicas\); accepted: a global batch "
                                         r"that is a multiple of 12"):
        step(step.init(), batch)


def test_unknown_partition_method_is_refused_before_the_model_is_split():
    with pytest.raises(ValueError, match=r"partition_method='params' is invalid"):
        _step(pipeline=PipelineConfig(2, partition_method="params"))


def test_type_regex_matching_no_layer():
    with pytest.raises(ValueError, match=r"method='type:conv' matches no layer; layer names are "
                                         r"\['Block', 'Embed', 'head'\]"):
        _step(pipeline=PipelineConfig(2, partition_method="type:conv"))


class _NoStack(nnx.Module):
    """A model with embed and head but its blocks in a plain list."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(10, 8, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 10, rngs=rngs)

    def head(self, x):
        return self.out(x)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_model_without_a_layer_stack():
    with pytest.raises(ValueError, match=r"_NoStack cannot be pipelined: .*`blocks` attribute, "
                                         r"which must be a models.LayerStack"):
        _step(model=_NoStack(nnx.Rngs(0)))


@pytest.mark.parametrize("config,message", [
    (dict(gradient_accumulation_steps=3),
     r"ZeroConfig.gradient_accumulation_steps=3 with PipelineConfig.micro_batches=2: .*accepted: "
     r"1 or 2"),
    (dict(stage=3, quantized_weights=True),
     r"ZeRO\+\+ .* is not supported with pipeline=; accepted: the plain ZeRO stages 0-3"),
])
def test_unsupported_step_options(config, message):
    with pytest.raises(ValueError, match=message):
        _step(**config)


def test_a_loss_fn_that_never_runs_the_stack_is_refused_before_compute():
    # A custom loss_fn is cut at the stack on the first batch's shapes (`stages.check_stages`).
    step = zeroxla.make_step(models.build("gpt-tiny", num_layers=2),
                             zeroxla.make_mesh(1, stages=2),
                             loss_fn=lambda model, batch: jnp.float32(0),
                             pipeline=PipelineConfig(2))
    batch = {"inputs": np.zeros((8, 4), np.int32), "targets": np.zeros((8, 4), np.int32)}
    with pytest.raises(ValueError, match=r"the loss never calls model.blocks"):
        step.lower(jax.eval_shape(step.init), batch)


def test_pipeline_must_be_a_config():
    with pytest.raises(TypeError, match=r"pipeline must be a PipelineConfig, got dict"):
        _step(pipeline={"micro_batches": 2})
