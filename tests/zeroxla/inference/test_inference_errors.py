"""Bad input to the Hybrid Engine: a ValueError naming the field and the accepted values, raised
before anything is compiled. And DeepSpeed's `hybrid_engine` JSON section."""

import json

import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.inference import HybridEngine, HybridEngineConfig, hybrid_engine_config_from_json
from zeroxla.models import GPT, GPTConfig, Llama, LlamaConfig


def step_of(model):
    return zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3))


@pytest.fixture(scope="module")
def gpt():
    return step_of(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)))


def test_tp_not_dividing_devices(gpt):
    with pytest.raises(ValueError, match=r"inference_tp_size=3 does not divide the 8 devices; "
                                         r"accepted: 1, 2, 4$"):
        HybridEngine(gpt, HybridEngineConfig(inference_tp_size=3))


def test_tp_not_dividing_heads():
    step = step_of(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))         # 6 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"inference_tp_size=4 does not divide the 6 attention "
                                         r"heads; accepted: 1, 2$"):
        HybridEngine(step, HybridEngineConfig(inference_tp_size=4))


def test_max_out_tokens_beyond_learned_positions(gpt):
    with pytest.raises(ValueError, match=r"max_out_tokens=200 .*accepted: 1\.\.128"):
        HybridEngine(gpt, HybridEngineConfig(max_out_tokens=200))


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([np.arange(9)], {"max_new_tokens": 0}, r"prompts\[0\] has 9 tokens .*max_out_tokens=8; "
                                             r"accepted: prompt length \+ max_new_tokens"),
    ([np.arange(3)], {"max_new_tokens": 6}, r"9 > HybridEngineConfig\.max_out_tokens=8"),
    ([np.arange(3), np.array([], np.int32)], {"max_new_tokens": 1}, r"prompts\[1\] has shape \(0,\).*accepted: a "
                                                 r"1-D int array of at least one token"),
    ([], {"max_new_tokens": 1}, r"prompts must be a non-empty list"),
    ([np.arange(3)], {"max_new_tokens": -1}, r"max_new_tokens=-1 is invalid; accepted: an "
                                             r"integer >= 0"),
    ([np.array([1, 70])], {"max_new_tokens": 1}, r"prompts\[0\] holds token 70; accepted: ids "
                                                 r"in \[0, 65\)"),
    ([np.arange(3)], {"max_new_tokens": 1, "top_p": 2.0}, r"top_p=2\.0 is invalid; accepted"),
    ([np.arange(3)], {"max_new_tokens": 1, "eos_id": 99}, r"eos_id=99 is invalid; accepted"),
])
def test_bad_generate_arguments(gpt, prompts, kwargs, message):
    engine = HybridEngine(gpt, HybridEngineConfig(max_out_tokens=8))
    with pytest.raises(ValueError, match=message):
        engine.generate(None, prompts, **kwargs)   # refused before the state is read


def test_config_from_deepspeed_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "hybrid_engine": {
        "enabled": True, "max_out_tokens": 256, "inference_tp_size": 4,
        "release_inference_cache": True, "pin_parameters": False,
        "tp_gather_partition_size": 4}}))
    assert hybrid_engine_config_from_json(path) == HybridEngineConfig(
        enabled=True, max_out_tokens=256, inference_tp_size=4, release_inference_cache=True,
        pin_parameters=False, tp_gather_partition_size=4)
    assert hybrid_engine_config_from_json({}) == HybridEngineConfig()   # DeepSpeed's defaults
    with pytest.raises(ValueError, match=r"hybrid_engine\.inference_tp_size=0 is invalid; "
                                         r"accepted: an integer >= 1"):
        hybrid_engine_config_from_json({"hybrid_engine": {"inference_tp_size": 0}})
    with pytest.raises(ValueError, match=r"unknown key 'hybrid_engine\.max_tokens'; accepted "
                                         r"keys: enabled, max_out_tokens"):
        hybrid_engine_config_from_json({"hybrid_engine": {"max_tokens": 3}})
    with pytest.raises(ValueError, match=r"pin_parameters=1 is invalid; accepted: true or false"):
        HybridEngineConfig(pin_parameters=1)
