"""Bad input to the Hybrid Engine: a ValueError naming the field and the accepted values, raised
before anything is compiled (sampling knobs, seeds, states of another step, models without a
KV-cache path). And DeepSpeed's `hybrid_engine` JSON section."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.deepspeed import hybrid_engine_config_from_json
from zeroxla.inference import HybridEngine, HybridEngineConfig
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
        HybridEngine(gpt.layout, HybridEngineConfig(inference_tp_size=3))


def test_tp_not_dividing_heads():
    step = step_of(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))         # 6 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"inference_tp_size=4 does not divide the 6 attention "
                                         r"heads; accepted: 1, 2$"):
        HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=4))


def test_max_out_tokens_beyond_learned_positions(gpt):
    with pytest.raises(ValueError, match=r"max_out_tokens=200 .*accepted: 1\.\.128"):
        HybridEngine(gpt.layout, HybridEngineConfig(max_out_tokens=200))


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
    engine = HybridEngine(gpt.layout, HybridEngineConfig(max_out_tokens=8))
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


# ---- every generate input, refused by name before the state is read -------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": NAN}, r"temperature=nan is invalid; accepted: 0 \(greedy\) or a finite "
                           r"positive number"),
    ({"temperature": INF}, r"temperature=inf is invalid; accepted"),
    ({"temperature": -0.5}, r"temperature=-0\.5 is invalid; accepted"),
    ({"temperature": "1"}, r"temperature='1' is invalid; accepted"),
    ({"temperature": 1.0, "top_p": NAN}, r"top_p=nan is invalid; accepted: None or a number in "
                                         r"\(0, 1\]"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p=0\.0 is invalid; accepted"),
    ({"temperature": 1.0, "top_k": 0}, r"top_k=0 is invalid; accepted: None or an integer >= 1"),
    ({"temperature": 1.0, "top_k": 2.5}, r"top_k=2\.5 is invalid; accepted"),
    ({"max_new_tokens": 1.5}, r"max_new_tokens=1\.5 is invalid; accepted: an integer >= 0"),
    ({"max_new_tokens": True}, r"max_new_tokens=True is invalid; accepted"),
    ({"eos_id": True}, r"eos_id=True is invalid; accepted: None or a token id in \[0, 65\)"),
    ({"seed": 1.5}, r"seed=1\.5 is invalid; accepted: an integer in \[-2\*\*63, 2\*\*63\) or a "
                    r"typed PRNG key"),
    ({"seed": "0"}, r"seed='0' is invalid; accepted"),
    ({"seed": 2**64}, r"seed=18446744073709551616 is invalid; accepted"),
    ({"seed": jax.random.PRNGKey(0)}, r"seed=.*shape \(2,\) is invalid \(a legacy uint32 key: "
                                      r"pass jax\.random\.wrap_key_data\(seed\)\); accepted"),
    ({"seed": jax.random.split(jax.random.key(0))}, r"seed=.*shape \(2,\) is invalid; "
                                                    r"accepted"),
])
def test_bad_sampling_arguments_name_the_field(gpt, kwargs, message):
    engine = HybridEngine(gpt.layout, HybridEngineConfig(max_out_tokens=8))
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.generate(None, [np.arange(3)], **kwargs)


def test_state_that_is_not_a_train_state(gpt):
    engine = HybridEngine(gpt.layout, HybridEngineConfig(max_out_tokens=8))
    with pytest.raises(ValueError, match=r"state is a dict; accepted: a TrainState of the "
                                         r"engine's step"):
        engine.generate({}, [np.arange(3)], max_new_tokens=2)


def test_state_of_another_step(gpt):
    engine = HybridEngine(gpt.layout, HybridEngineConfig(max_out_tokens=8))
    shallower = step_of(GPT(GPTConfig.tiny().replace(num_layers=1), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"state is a TrainState of another step: its model "
                                         r"has another model structure.*accepted: a state of "
                                         r"the step given to HybridEngine"):
        engine.generate(shallower.init(), [np.arange(3)], max_new_tokens=2)
    stage2 = zeroxla.make_step(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                               optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=2))
    with pytest.raises(ValueError, match=r"state is a TrainState of another step: state\.plan "
                                         r"is ZeRO-2 .*the engine's step's is ZeRO-3"):
        engine.generate(stage2.init(), [np.arange(3)], max_new_tokens=2)


def test_layout_that_is_not_a_zero_layout(gpt):
    """A model, or the step's plan, in place of the step's layout is refused, naming the fix (the
    step itself is read as its layout, with a DeprecationWarning: test_step_in_place_of_layout)."""
    for wrong, name in ((GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), "GPT"),
                        (gpt.layout.plan, "ShardingPlan")):
        with pytest.raises(ValueError, match=rf"HybridEngine: layout is a {name}; accepted: the "
                                             r"ZeroLayout of the training step \(step\.layout, "
                                             r"for a step zeroxla\.make_step returns\)"):
            HybridEngine(wrong)


# ---- a model the engine cannot decode, refused at construction --------------------------------

class NoCache(nnx.Module):
    """A plain nnx model, as the Flax examples write one: no KV-cache path."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(65, 16, rngs=rngs)
        self.out = nnx.Linear(16, 65, rngs=rngs)

    def __call__(self, tokens, positions=None):
        return self.out(self.embed(tokens))


class WrongDecode(NoCache):
    """A cache, but a `decode` that returns logits alone."""

    def init_cache(self, batch, max_len):
        shape = (1, batch, max_len, 2, 8)
        return {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}

    def decode(self, tokens, positions, cache):
        return self(tokens)


class WrongCache(WrongDecode):
    def init_cache(self, batch, max_len):
        return jnp.zeros((1, batch, max_len, 2, 8))


@pytest.mark.parametrize("model,message", [
    (NoCache, r"HybridEngine cannot decode NoCache: it has no init_cache and no decode method "
              r"\(no KV-cache path\); add init_cache\(batch, max_len\) returning \{'k', 'v'\}"),
    (WrongCache, r"HybridEngine cannot decode WrongCache: WrongCache\.init_cache\(1, 8\) "
                 r"returned .*; accepted: init_cache\(batch, max_len\)"),
    (WrongDecode, r"HybridEngine cannot decode WrongDecode: WrongDecode\.decode\(tokens \[1, 1\], "
                  r"positions \[1, 1\], cache\) returned .*; accepted: logits \[1, 1, 65\]"),
])
def test_model_without_the_cache_protocol_is_refused_by_name(model, message):
    step = step_of(model(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=message):
        HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=8))
