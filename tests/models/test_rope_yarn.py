"""YaRN RoPE scaling (`rope_type: yarn`, `models.rope`) against transformers: the inverse
frequencies and attention factor against `_compute_yarn_parameters` itself over the options
(betas, truncate, attention_factor, DeepSeek's mscale / mscale_all_dim), and the logits of tiny
Llama and Qwen2 checkpoints with yarn scaling written by transformers (positions past the
original length, where the scaling acts) within 1e-4; config.json written back reads the same
in transformers and in zeroxla."""

import numpy as np
import pytest

from family_checkpoints import save_random
from zeroxla.models import hf
from zeroxla.models.rope import inv_freq, yarn_attention_factor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402

SIZES = dict(vocab_size=61, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}


@pytest.mark.parametrize("extra", [
    {},
    {"beta_fast": 8, "beta_slow": 2, "truncate": False, "original_max_position_embeddings": 4096},
    {"attention_factor": 0.9},
    {"mscale": 0.7, "mscale_all_dim": 1.0, "factor": 16.0, "rope_theta": 5e5},
], ids=["defaults", "betas-untruncated", "attention_factor", "mscale"])
def test_inv_freq_and_attention_factor_equal_transformers(extra):
    rope = {**YARN, **extra}
    config = transformers.LlamaConfig(**{**SIZES, "rope_parameters": rope})
    want, want_factor = _compute_yarn_parameters(config)
    ours = hf.from_hf_config(config.to_dict())
    np.testing.assert_allclose(ours.rope_inv_freq(), want.numpy(), rtol=2e-7, atol=0)
    assert ours.rope_scaling() == pytest.approx(want_factor, rel=1e-12)
    head_dim = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    plain = inv_freq(head_dim, rope["rope_theta"])
    ramped = ~np.isclose(ours.rope_inv_freq(), plain) & ~np.isclose(ours.rope_inv_freq(),
                                                                    plain / rope["factor"])
    assert ramped.any() or "beta_fast" not in extra      # the ramp's inside is checked too
    assert yarn_attention_factor(4.0) == pytest.approx(0.1 * np.log(4.0) + 1.0)


@pytest.mark.parametrize("cls_name", ["LlamaConfig", "Qwen2Config"])
def test_yarn_logits_equal_transformers(tmp_path, cls_name):
    torch.manual_seed(0)
    # theta 100 and betas 1 / 0.1: over the original 16 positions the ramp lies inside the
    # head's 8 frequencies (dims 1 to 6): kept, ramped and interpolated ones all present
    config = getattr(transformers, cls_name)(**{**SIZES, "rope_parameters": {
        **YARN, "rope_theta": 100.0, "beta_fast": 1, "beta_slow": 0.1}})
    directory = save_random(transformers.AutoModelForCausalLM.from_config(config), tmp_path)
    ours, model = hf.load_hf_model(directory)
    assert (ours.rope_type, ours.rope_factor, ours.rope_original_max_len) == ("yarn", 4.0, 16)
    x = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 48)).astype(np.int32)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(
            torch.tensor(x, dtype=torch.long)).logits.numpy()
    assert want.std() > 0.3
    np.testing.assert_allclose(np.asarray(model(x)), want, atol=1e-4, rtol=0)
    # written back, transformers reads the same RoPE and so do we
    written = hf.to_hf_config(ours)
    again = getattr(transformers, cls_name)(**written)
    freqs, factor = _compute_yarn_parameters(again)
    np.testing.assert_array_equal(freqs.numpy(), _compute_yarn_parameters(config)[0].numpy())
    assert factor == _compute_yarn_parameters(config)[1]
    assert hf.from_hf_config(written) == ours


def test_yarn_without_a_factor_is_refused_by_key():
    written = hf.to_hf_config(hf.from_hf_config(
        transformers.LlamaConfig(**{**SIZES, "rope_parameters": YARN}).to_dict()))
    written["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_parameters.factor"):
        hf.from_hf_config(written)
