"""LoRA exports against transformers and peft: the merged export loads as a plain
`LlamaForCausalLM` and the `--adapter-only` one as `peft.PeftModel` on the base's export, both
giving our model's logits (1e-4). Skips without torch / transformers / peft (the dev extra)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora
from zeroxla.lora.export import save_merged, save_peft_adapter
from zeroxla.models import Llama, LlamaConfig, hf

CONFIG = LlamaConfig.tiny()
LORA = LoRAConfig(dim=4, alpha=8.0, module_name=r"blocks/layers/(wq|wk|wo|w_gate|w_down)")
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 9))


@pytest.fixture(scope="module")
def libs():
    torch = pytest.importorskip("torch")
    return torch, pytest.importorskip("transformers"), pytest.importorskip("peft")


def _trained_lora_model():
    """Our Llama with adapters whose B is nonzero (as after training), and its logits."""
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    convert_linear_layer_to_lora(model, LORA, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        variable.set_value(jnp.asarray(rng.normal(0, 0.1, variable.get_value().shape),
                                       jnp.float32))
    return model, np.asarray(model(jnp.asarray(TOKENS, jnp.int32)))


def _logits(torch, hf_model):
    with torch.no_grad():
        return hf_model(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_peft_adapter_and_merged_export_give_our_logits(libs, tmp_path):
    torch, transformers, peft = libs
    model, ours = _trained_lora_model()
    base = Llama(CONFIG, rngs=nnx.Rngs(0))                  # the same base weights, no adapters
    hf.save_hf_model(CONFIG, base, tmp_path / "base")
    files = save_peft_adapter(model, LORA, CONFIG, tmp_path / "adapter",
                              base_model_name_or_path=str(tmp_path / "base"))
    assert [f.name for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    saved = json.loads(files[0].read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0
    assert saved["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj"]

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    without = _logits(torch, hf_base)
    assert np.abs(without - ours).max() > 1e-2           # the adapters change the function
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_logits(torch, adapted), ours, rtol=1e-4, atol=1e-4)

    save_merged(model, CONFIG, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_logits(torch, merged), ours, rtol=1e-4, atol=1e-4)
