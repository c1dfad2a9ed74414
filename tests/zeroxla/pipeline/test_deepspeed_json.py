"""DeepSpeed's pipeline settings (gradient_accumulation_steps, the `pipeline` section) onto a
PipelineConfig; no devices needed."""

import warnings

import pytest

from zeroxla.deepspeed import DeepSpeedConfigError, DeepSpeedConfigWarning, pipeline_config_from_json
from zeroxla.pipeline import PipelineConfig

BATCH = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}


def test_micro_batches_are_gradient_accumulation_steps():
    # 32 = 2 per micro-batch x 4 accumulation steps x 4 data replicas (8 devices, 2 stages).
    config, stages = pipeline_config_from_json(
        {**BATCH, "pipeline": {"stages": 2, "partition": "uniform"}}, data_parallel_size=4)
    assert config == PipelineConfig(4, partition_method="uniform")
    assert stages == 2


@pytest.mark.parametrize("partition,method", [("best", "parameters"), ("parameters", "parameters"),
                                              ("type:transformer", "type:transformer")])
def test_partition(partition, method):
    config, stages = pipeline_config_from_json(
        {"gradient_accumulation_steps": 8, "pipeline": {"partition": partition, "stages": "auto"}},
        schedule="gpipe")
    assert config == PipelineConfig(8, schedule="gpipe", partition_method=method)
    assert stages is None


def test_keys_without_effect_warn():
    with pytest.warns(DeepSpeedConfigWarning, match=r"'pipeline.activation_checkpoint_interval' "
                                                    r"is ignored"):
        pipeline_config_from_json({"pipeline": {"activation_checkpoint_interval": 1}})


@pytest.mark.parametrize("section,message", [
    ({"partition": "profile"}, r"pipeline.partition='profile' is invalid; accepted: \"best\""),
    ({"stages": 0}, r"pipeline.stages=0 is invalid; accepted: \"auto\" or an integer >= 1"),
    ({"stage": 2}, r"unknown key 'pipeline.stage'; accepted: activation_checkpoint_interval, "
                   r"grad_partitioned, partition, pipe_partitioned, seed_layers, stages"),
])
def test_bad_pipeline_section(section, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        with pytest.raises(DeepSpeedConfigError, match=message):
            pipeline_config_from_json({"pipeline": section})
