"""The maximum length rule is one for every family: a sequence (prompt and new tokens) holds at
most `max_seq_len` positions, GPT's (learned positions) and Llama's (RoPE) alike, refused the
same way in the model's forward and KV cache, the Hybrid Engine (and its baselines),
`zeroxla generate` and the app's samplers: the error names max_seq_len, the requested total and
the fix. Before it, a Llama generated 213 tokens with max_seq_len 128 (max_out_tokens=256)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from zeroxla.app.jobs.generate import generate_from_checkpoint
from zeroxla.app.sampling import sample_tokens, sample_with_engine
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.inference import (HybridEngine, HybridEngineConfig, SingleDeviceGenerator,
                               Zero3Generator)

PRESETS = {"gpt-tiny": "GPTConfig", "llama-tiny": "LlamaConfig"}      # both max_seq_len 128
CHARS = "".join(map(chr, range(65, 130)))                           # the presets' 65 ids


def rule(config, total, accepted=r"1\.\.128 positions"):
    """The message of `ModelConfig.check_seq_len` for a request of `total` positions."""
    return (rf"{total} exceeds {config}\.max_seq_len=128 \([^)]+\); accepted: {accepted}")


@pytest.fixture(scope="module", params=list(PRESETS))
def preset(request):
    """(preset name, its config class name, the model, its ZeRO-3 step on 2 x 4 devices)."""
    model = models.build(request.param)
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3))
    return request.param, PRESETS[request.param], model, step


def test_forward_and_cache_stop_at_max_seq_len(preset):
    _, config, model, _ = preset
    assert model.config.max_seq_len == 128
    assert model(jnp.zeros((1, 128), jnp.int32)).shape == (1, 128, 65)      # at the limit
    for forward in (model, model.hidden):
        with pytest.raises(ValueError, match=rf"^sequence length {rule(config, 129)}, or a "
                                             r"model config with a larger max_seq_len$"):
            forward(jnp.zeros((1, 129), jnp.int32))
    assert model.init_cache(1, 128)["k"].shape[2] == 128
    with pytest.raises(ValueError, match=rf"^KV cache length \(max_len\) {rule(config, 129)}"):
        model.init_cache(1, 129)


@pytest.mark.parametrize("generator", [
    lambda layout, n: HybridEngine(layout, HybridEngineConfig(max_out_tokens=n)),
    lambda layout, n: HybridEngine(layout, HybridEngineConfig(max_out_tokens=n,
                                                              inference_tp_size=2)),
    Zero3Generator, SingleDeviceGenerator], ids=["engine", "engine-tp2", "zero3", "single"])
def test_generators_refuse_a_cache_past_max_seq_len(preset, generator):
    """The issue's request (max_out_tokens=256 on a max_seq_len 128 model) is refused when the
    engine is built, for Llama as for GPT; 128 builds, and a prompt + new tokens beyond it is
    refused by generate before anything compiles."""
    _, config, _, step = preset
    with pytest.raises(ValueError, match=r"max_out_tokens=256 does not fit the model: KV cache "
                                         rf"length \(max_len\) {rule(config, 256)}"):
        generator(step.layout, 256)
    engine = generator(step.layout, 128)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 100 tokens and max_new_tokens=29: "
                                         r"129 > HybridEngineConfig\.max_out_tokens=128"):
        engine.generate(step.init(), [np.arange(100) % 65], max_new_tokens=29)


def test_app_samplers_follow_the_rule(preset):
    """The closing sample's `sample_with_engine` past max_seq_len (a caller's cap above it) and
    the plain sampler's window past it are refused, naming max_seq_len."""
    _, config, model, step = preset
    with pytest.raises(ValueError, match=rf"max_out_tokens=200 does not fit the model: .*"
                                         rf"{rule(config, 200)}"):
        sample_with_engine(step, step.init(), CharTokenizer(CHARS), np.arange(5),
                           num_tokens=195, max_len=200, temperature=0.0)
    with pytest.raises(ValueError, match=rf"sequence length {rule(config, 129)}"):
        sample_tokens(model, np.arange(5), num_tokens=2, context=129, temperature=0.0)


def test_generate_command_refuses_past_max_seq_len(preset, tmp_path):
    """`zeroxla generate` (its library half) on a checkpoint of each family, before it builds
    anything: prompt 'AB' (2 tokens) + 200 new tokens > 128."""
    _, config, _, step = preset
    zeroxla.save(tmp_path / "checkpoint", step.init(), layout=step.layout,
                 metadata={"tokenizer": {"kind": "char", "chars": CHARS}})
    with pytest.raises(ValueError, match=r"^--prompt \(2 tokens\) \+ --max-new-tokens 200 = "
                                         rf"{rule(config, 202, '--max-new-tokens <= 126 for')}"
                                         r" this prompt$"):
        generate_from_checkpoint(str(tmp_path / "checkpoint"), "AB", max_new_tokens=200,
                                 temperature=0.0, top_k=None, tp=1)
