"""The MoE families against transformers: logits and the auxiliary loss of tiny random
checkpoints (per-expert and fused expert tensors), our export read back by transformers, and the
options not built refused by key. Needs torch and transformers (skips without)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


def _one_layout_per_family():
    """Daily: one case per family, the two layouts shared between them; the rest slow."""
    daily = {("qwen3_moe", "per_expert"), ("qwen2_moe", "fused"), ("mixtral", "per_expert"),
             ("olmoe", "fused")}
    return [pytest.param(f, layout, marks=() if (f, layout) in daily else pytest.mark.slow,
                         id=f"{f}-{layout}")
            for f in FAMILIES for layout in ("per_expert", "fused")]


@pytest.mark.parametrize("family,layout", _one_layout_per_family())
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


def test_padded_aux_loss_equals_transformers_given_the_attention_mask(transformers, tmp_path):
    """Rows of 12, 7 and 3 tokens right-padded to 12 (padding: segment id 0, transformers'
    attention_mask 0): our router statistics give transformers' `load_balancing_loss_func` of
    its router logits given the attention_mask (top-4 of 16: each token's 4 assignments
    counted once it is a real token, padding not at all)."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = random_hf_model(transformers, "qwen3_moe")
    model.save_pretrained(tmp_path)
    _, ours_model = hf.load_hf_model(tmp_path)
    tokens = np.concatenate([TOKENS, TOKENS[:1]])                                   # [3, 12]
    mask = (np.arange(12)[None] < np.array([[12], [7], [3]])).astype(np.int32)
    with torch.no_grad():
        out = model(torch.as_tensor(tokens, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask), output_router_logits=True)
        c = model.config
        want = float(load_balancing_loss_func(out.router_logits, c.num_experts,
                                              c.num_experts_per_tok, torch.as_tensor(mask)))
    _, stats = ours_model.routed_token_logprobs(jnp.asarray(tokens), jnp.asarray(tokens),
                                                segment_ids=jnp.asarray(mask),
                                                positions=jnp.broadcast_to(jnp.arange(12),
                                                                           tokens.shape))
    assert abs(float(aux_loss(stats)) - want) <= 1e-6, (float(aux_loss(stats)), want)
    assert float(stats.rows) == c.num_hidden_layers * mask.sum()


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "olmoe" else pytest.mark.slow)
                                    for f in FAMILIES])
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
                                              ("deepseek_v2", "kv_lora_rank")])
def test_other_moe_model_types_are_refused_with_why(model_type, match):
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config({"model_type": model_type})


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family):
    spec = models.REGISTRY[family]
    config = spec.config_class()
    assert hf.from_hf_config(hf.to_hf_config(config)) == config


@pytest.mark.parametrize("layout", [pytest.param("per_expert", marks=pytest.mark.slow), "fused"])
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


@pytest.mark.slow          # daily: each family's logits in test_transformers_checkpoint_...
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


def test_qwen3_moe_use_sliding_window_slides_every_layer_as_transformers(transformers, tmp_path):
    """transformers 5.23's Qwen3-MoE has no max_window_layers: `use_sliding_window` with a
    `sliding_window` slides every layer (`Qwen3MoeModel.forward`'s one mask). A 3-token window
    on a 12-token row changes the logits, so full attention here would not pass."""
    model = random_hf_model(transformers, "qwen3_moe", use_sliding_window=True, sliding_window=3)
    model.save_pretrained(tmp_path)
    config, ours_model = hf.load_hf_model(tmp_path)
    assert config.sliding_window == 3
    want_logits, _ = hf_outputs(model)
    logits, _ = ours(ours_model)
    np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)
    exported = hf.to_hf_config(config)
    assert hf.from_hf_config(exported) == config
    assert transformers.Qwen3MoeConfig(**exported).sliding_window == 3


def test_qwen2_moe_sliding_layers_follow_its_own_rule_and_are_refused(transformers):
    """Qwen2-MoE's rule is not Qwen2's: layer i slides when `use_sliding_window`, i is even and
    i < max_window_layers (`Qwen2MoeConfig.__post_init__`), so max_window_layers 28 over two
    layers slides layer 0 (Qwen2's rule would slide none)."""
    spec = models.REGISTRY["qwen2_moe"]
    hf_dict = {**spec.to_hf(spec.config_class()), "use_sliding_window": True,
               "sliding_window": 3, "max_window_layers": 28}
    del hf_dict["layer_types"]
    read = transformers.Qwen2MoeConfig(**hf_dict)
    assert read.layer_types == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"use_sliding_window=True .*sliding_window=3.*"
                                         r"max_window_layers=28.*layer 0 of 2 slides"):
        hf.from_hf_config(hf_dict)
    hf.from_hf_config({**hf_dict, "max_window_layers": 0})    # no layer slides: loads


def test_olmoe_sliding_window_is_refused_by_key():
    """transformers' OLMoE mask is full causal, but its attention passes `sliding_window` on to
    flash_attention_2: a config.json naming one means two things, so it is refused."""
    spec = models.REGISTRY["olmoe"]
    with pytest.raises(ValueError, match=r"sliding_window=3"):
        hf.from_hf_config({**spec.to_hf(spec.config_class()), "sliding_window": 3})


@pytest.mark.slow          # compiles the init program at EP 1 and EP 2
def test_loading_at_expert_degree_2_never_holds_a_whole_expert_leaf(transformers, tmp_path,
                                                                    capfd):
    """`spread_hf_params` at EP 2 spreads each expert tensor as it is stored (its experts over
    the expert axis, the rest over the data devices), so the program `init_from` compiles moves
    it into its partitions without XLA replicating it whole first ("Involuntary full
    rematerialization"): its per-device temporaries and arguments are at most EP 1's
    (temporaries: 131,968 bytes at EP 1, 82,816 at EP 2; 180,100 at EP 2 when every piece was
    spread over all 8 devices), and the loaded values are the checkpoint's."""
    import optax

    import zeroxla
    from zeroxla.checkpoint.pretrained import spread_hf_params

    path = tmp_path / "ckpt"
    random_hf_model(transformers, "qwen3_moe").save_pretrained(path)
    config, want = hf.load_hf_model(path)
    sizes, errors = {}, {}
    for ep, mesh in ((1, zeroxla.make_mesh(2, 4)), (2, zeroxla.make_mesh(2, 2, expert=2))):
        step = zeroxla.make_step(lambda: models.model_class(config)(config, rngs=nnx.Rngs(0)),
                                 mesh, optimizer=optax.sgd(0.1),
                                 config=zeroxla.ZeroConfig(stage=3))
        values = spread_hf_params(config, path, mesh, progress=False)
        capfd.readouterr()
        memory = step._jitted_init.lower(values, {}, step._seed(0)).compile(
            ).memory_analysis()                   # the program init_from(values) runs
        errors[ep] = capfd.readouterr().err
        sizes[ep] = (memory.temp_size_in_bytes, memory.argument_size_in_bytes)
    assert "Involuntary full rematerialization" not in errors[2], errors[2][:400]
    assert sizes[2][0] <= sizes[1][0] and sizes[2][1] <= sizes[1][1], sizes
    got = hf.param_dict(zeroxla.gathered_model(step.init_from(values)))
    for name, value in hf.param_dict(want).items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)
