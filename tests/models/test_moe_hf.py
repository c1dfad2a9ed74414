"""The MoE families against transformers: logits and the auxiliary loss of tiny random
checkpoints (per-expert and fused expert tensors), our export read back by transformers, and the
options not built refused by key. Needs torch and transformers (skips without)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla import models
from zeroxla.models import hf
from zeroxla.models.moe import aux_loss

TOKENS = np.random.default_rng(0).integers(0, 61, size=(2, 12)).astype(np.int32)   # [B, T]
ATOL = 1e-4


def hf_config(transformers, family, **extra):
    common = dict(**extra,vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                  rope_theta=5000.0, router_aux_loss_coef=0.02, output_router_logits=True)
    if family == "qwen3_moe":      # 16 experts, top-4, normalised, explicit head_dim
        return transformers.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=40,
                                           moe_intermediate_size=12, num_experts=16,
                                           num_experts_per_tok=4, norm_topk_prob=True)
    if family == "qwen2_moe":      # shared expert, q/k/v biases, top-2 not normalised
        return transformers.Qwen2MoeConfig(**common, intermediate_size=40,
                                           moe_intermediate_size=12,
                                           shared_expert_intermediate_size=20, num_experts=8,
                                           num_experts_per_tok=2)
    if family == "mixtral":        # 8 experts, top-2, a sliding window
        return transformers.MixtralConfig(**common, intermediate_size=12, num_local_experts=8,
                                          num_experts_per_tok=2, sliding_window=5)
    return transformers.OlmoeConfig(**common, intermediate_size=12, num_experts=16,  # olmoe
                                    num_experts_per_tok=8)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


@pytest.fixture(scope="module")
def transformers():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return pytest.importorskip("transformers")


def random_hf_model(transformers, family, **extra):
    import torch

    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(transformers, family, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = "norm" in name and name.endswith("weight")
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if norm_weight else 0.0))
    return model.eval()


def hf_outputs(model):
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    return out.logits.numpy(), float(out.aux_loss)


def ours(model):
    tokens = jnp.asarray(TOKENS)
    logits = np.asarray(model(tokens))
    _, stats = model.routed_token_logprobs(tokens, tokens)
    return logits, float(aux_loss(stats))


def write_fused(model, path):
    """The checkpoint as transformers holds it in memory: fused 3-D expert tensors."""
    from safetensors.torch import save_file

    path.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_checkpoint_gives_its_logits_and_aux_loss(transformers, tmp_path, family,
                                                                layout):
    model = random_hf_model(transformers, family)
    path = tmp_path / "ckpt"
    if layout == "per_expert":
        model.save_pretrained(path)
    else:
        write_fused(model, path)
    config, ours_model = hf.load_hf_model(path)
    assert config.family == family
    want_logits, want_aux = hf_outputs(model)
    logits, aux = ours(ours_model)
    np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)
    assert abs(aux - want_aux) <= 1e-6, (aux, want_aux)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_our_export(transformers, tmp_path, family):
    config, model = hf.load_hf_model(_saved(transformers, family, tmp_path / "in"))
    hf.save_hf_model(config, model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    want_logits, want_aux = hf_outputs(back)
    logits, aux = ours(model)
    np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)
    assert abs(aux - want_aux) <= 1e-6


def _saved(transformers, family, path):
    random_hf_model(transformers, family).save_pretrained(path)
    return path


@pytest.mark.parametrize("family,key,value,match", [
    ("qwen3_moe", "mlp_only_layers", [1], "mlp_only_layers"),
    ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise"),
    ("olmoe", "clip_qkv", 8.0, "clip_qkv"),
])
def test_options_not_built_are_refused_by_key(family, key, value, match):
    spec = models.REGISTRY[family]
    hf_dict = spec.to_hf(spec.config_class())
    hf_dict[key] = value
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config(hf_dict)


@pytest.mark.parametrize("model_type,match", [("deepseek_v3", "kv_lora_rank"),
                                              ("gpt_oss", "sinks")])
def test_other_moe_model_types_are_refused_with_why(model_type, match):
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config({"model_type": model_type})


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family):
    spec = models.REGISTRY[family]
    config = spec.config_class()
    assert hf.from_hf_config(hf.to_hf_config(config)) == config


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_load_pretrained_streams_experts_into_zero3_partitions(transformers, tmp_path, layout):
    """`zeroxla.load_pretrained` (tensor by tensor into the ZeRO-3 partitions) gives the model
    `load_hf_model` gives, from either expert layout."""
    import zeroxla

    model = random_hf_model(transformers, "qwen2_moe")
    path = tmp_path / "ckpt"
    model.save_pretrained(path) if layout == "per_expert" else write_fused(model, path)
    _, want = hf.load_hf_model(path)
    _, state = zeroxla.load_pretrained(path, zeroxla.make_mesh(2, 4), progress=False)
    got = hf.param_dict(zeroxla.gathered_model(state))
    for name, value in hf.param_dict(want).items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


@pytest.mark.parametrize("config_class", [models.MixtralConfig, models.OlmoeConfig])
def test_one_intermediate_size_families_refuse_a_dense_size_of_their_own(config_class):
    with pytest.raises(ValueError, match=r"mlp_dim=10 != expert_mlp_dim=32"):
        config_class(mlp_dim=10)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_attention_bias_gives_transformers_logits(transformers, tmp_path, family):
    """`attention_bias: true` (q/k/v/o biases in Qwen3-MoE's and OLMoE's attention)."""
    model = random_hf_model(transformers, family, attention_bias=True)
    model.save_pretrained(tmp_path)
    config, ours_model = hf.load_hf_model(tmp_path)
    assert config.qkv_bias and config.o_bias
    want_logits, want_aux = hf_outputs(model)
    logits, aux = ours(ours_model)
    np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)
    assert abs(aux - want_aux) <= 1e-6
