"""The real-shape presets (`models.presets`) have their models' published parameter counts.

Qwen3.5's cards publish whole billions of the multimodal checkpoint ("27B", "35B in total"):
its presets' text models are counted here from their config.json keys by the formulas of
transformers' modules (and by transformers' own model, built on the meta device), then held
within 1% of the cards' figures. Gemma-4-31B's card publishes its text model's 30.7 B, which
transformers' own model of the preset's text_config (meta device) holds too."""

import jax
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.models import presets

# Parameter counts the model cards publish (billions, rounded or cut there: Qwen2.5-7B's
# 7,615,616,512 is "7.61B").
PUBLISHED = {"Llama-3.2-1B": 1.24, "Llama-3.1-8B": 8.03, "Qwen2.5-0.5B": 0.49,
             "Qwen2.5-1.5B": 1.54, "Qwen2.5-7B": 7.61, "Qwen3-0.6B": 0.6, "Qwen3-8B": 8.2,
             "Qwen3-30B-A3B": 30.5, "gpt-oss-20b": 20.9, "Gemma-4-31B": 30.7}
# The Qwen3.5 cards' totals (vision tower and MTP layer included) and the class transformers
# builds the text model with.
PUBLISHED_WHOLE = {"Qwen3.5-27B": (27e9, "Qwen3_5ForCausalLM"),
                   "Qwen3.5-35B-A3B": (35e9, "Qwen3_5MoeForCausalLM")}


def _count(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_every_preset_has_a_published_count():
    assert set(presets.NAMES) == set(PUBLISHED) | set(PUBLISHED_WHOLE)


@pytest.mark.parametrize("name", [n for n in presets.NAMES if n in PUBLISHED])
def test_parameter_count_is_the_published_one(name):
    count = _count(models.abstract_model(presets.config(name)))
    digits = len(str(PUBLISHED[name]).split(".")[1])
    assert abs(count / 1e9 - PUBLISHED[name]) < 10**-digits       # within the last digit shown


def _qwen3_5_text_count(text) -> int:
    """Parameters of a Qwen3.5 text model from its config.json keys, module by module as
    transformers 5.23 defines them (`Qwen3_5GatedDeltaNet`, `Qwen3_5Attention`, the MLP or
    `Qwen3_5MoeSparseMoeBlock`), the untied embedding and head, every RMSNorm one vector."""
    d, n = text["hidden_size"], text["num_hidden_layers"]
    full = text["layer_types"].count("full_attention")
    hd, h, g = text["head_dim"], text["num_attention_heads"], text["num_key_value_heads"]
    # q_proj (query and output gate), k_proj, v_proj, o_proj, q_norm, k_norm
    attention = d * h * hd * 2 + 2 * d * g * hd + h * hd * d + 2 * hd
    hk, kd = text["linear_num_key_heads"], text["linear_key_head_dim"]
    hv, vd = text["linear_num_value_heads"], text["linear_value_head_dim"]
    conv = 2 * hk * kd + hv * vd                                   # q | k | v channels
    # in_proj_qkv, conv1d (no bias), in_proj_z, in_proj_b and _a, dt_bias and A_log, the gated
    # norm, out_proj
    deltanet = (d * conv + text["linear_conv_kernel_dim"] * conv + d * hv * vd + 2 * d * hv
                + 2 * hv + vd + hv * vd * d)
    if "num_experts" in text:
        e, f = text["num_experts"], text["moe_intermediate_size"]
        s = text["shared_expert_intermediate_size"]
        mlp = d * e + e * 3 * d * f + 3 * d * s + d    # router, experts, shared one, its gate
    else:
        mlp = 3 * d * text["intermediate_size"]
    return 2 * text["vocab_size"] * d + d + full * attention + (n - full) * deltanet + n * (
        mlp + 2 * d)


@pytest.mark.parametrize("name", sorted(PUBLISHED_WHOLE))
def test_qwen3_5_count_is_its_config_arithmetic(name):
    """The preset's text model has the count its config gives by transformers' formulas, within
    1% of the card's total."""
    want = _qwen3_5_text_count(presets.HF_CONFIGS[name]["text_config"])
    assert _count(models.abstract_model(presets.config(name))) == want
    assert abs(want / PUBLISHED_WHOLE[name][0] - 1) < 0.01


@pytest.mark.parametrize("name", sorted(PUBLISHED_WHOLE))
def test_qwen3_5_arithmetic_is_transformers_own_count(name):
    """The formulas above count what transformers' own model of the config holds (built on the
    meta device; needs torch, which leg 2 lacks)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text = presets.HF_CONFIGS[name]["text_config"]
    config = transformers.AutoConfig.for_model(
        text["model_type"], **{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        reference = getattr(transformers, PUBLISHED_WHOLE[name][1])(config)
    assert sum(p.numel() for p in reference.parameters()) == _qwen3_5_text_count(text)


def test_gemma4_31b_count_is_transformers_own_count():
    """The preset's text model holds what transformers' `Gemma4ForCausalLM` of its
    text_config holds (built on the meta device; needs torch), plus one `layer_scalar` per
    layer: a buffer there, a parameter here (never trained, `models.gemma4`)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text = presets.HF_CONFIGS["Gemma-4-31B"]["text_config"]
    config = transformers.Gemma4TextConfig(**{k: v for k, v in text.items()
                                              if k != "model_type"})
    with torch.device("meta"):
        reference = transformers.Gemma4ForCausalLM(config)
    theirs = sum(p.numel() for p in reference.parameters())
    assert abs(theirs / 1e9 - PUBLISHED["Gemma-4-31B"]) < 0.1
    ours = _count(models.abstract_model(presets.config("Gemma-4-31B")))
    assert ours == theirs + text["num_hidden_layers"]


def test_an_unknown_preset_lists_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted: Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B"):
        presets.config("Llama-2-7B")
