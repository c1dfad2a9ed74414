"""models/hf.py against the golden checkpoints transformers wrote (tests/assets/hf); no torch.

The golden directories hold transformers' bfloat16 safetensors, config.json, tokenizer and its
logits for a fixed input (tests/support/hf_golden.py). `load_hf_model` of each must compute those
logits; and wherever torch is installed, the golden is regenerated with transformers and must be
what is committed, so the torch-free tests keep comparing against transformers itself.
"""

import importlib.util

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hf_golden import ASSETS, ATOL, FAMILIES, LOGITS_FILE, golden
from zeroxla import models
from zeroxla.models import hf

# make_golden.py's shapes, as our configs (the bf16 weights load into float32 parameters).
EXPECTED = {
    "gpt2": models.GPTConfig(vocab_size=512, max_seq_len=128, d_model=32, num_heads=4,
                             num_layers=2, mlp_dim=128),
    "llama": models.LlamaConfig(vocab_size=512, max_seq_len=128, d_model=32, num_heads=4,
                                num_kv_heads=2, num_layers=2, mlp_dim=64, rope_theta=10000.0,
                                norm_eps=1e-6),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_load_hf_model_gives_transformers_logits(family):
    g = golden(family)
    config, model = hf.load_hf_model(g.directory)
    assert config == EXPECTED[family]
    ours = np.asarray(model(jnp.asarray(g.inputs)))                  # [B, T, V]
    assert g.logits.shape == ours.shape == (*g.inputs.shape, 512)
    assert g.logits.std() > 0.5          # weights of std 0.1: logits of spread ~0.55, not ~0
    np.testing.assert_allclose(ours, g.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_selected_part_is_read_from_the_files_as_stored(family):
    """`iter_hf_params(select=...)` reads only the selected rows of the tensors stored as they
    are (embeddings, norms, GPT-2's Conv1D weights; the Llama's spread over its 3 shards), equal
    to the same rows of the whole tensors; the others (transposed, split) come whole."""
    g = golden(family)
    config = hf.from_hf_config(hf.read_hf_config(g.directory))
    parted = 0
    with hf.open_safetensors(g.directory) as reader:
        whole = hf.from_hf_tensors(config, reader, dtype=ml_dtypes.bfloat16)     # as stored
        for path, layer, piece, index in hf.iter_hf_params(
                config, reader, select=lambda shape: (slice(0, shape[0] // 2),)):
            full = whole[path] if layer is None else whole[path][layer]
            assert piece.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(piece, full if index is None else full[index],
                                          err_msg=f"{path} layer {layer}")
            parted += index is not None
    # GPT-2: wte, wpe, ln_f and per layer its norms, biases but c_attn's, and the Conv1D MLP;
    # Llama: the embedding and the norms.
    assert parted == {"gpt2": 22, "llama": 6}[family]


def _make_golden():
    """tests/assets/hf/make_golden.py as a module (it is a script, not on the path)."""
    spec = importlib.util.spec_from_file_location("make_golden", ASSETS / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", FAMILIES)
def test_committed_golden_is_what_transformers_writes(tmp_path, family):
    """Every committed file byte for byte as make_golden.py writes it with the `dev` extra's
    torch and transformers; the logits to 1e-6 (transformers' CPU kernels may round the last bit
    differently on another CPU; the tests read them at 1e-4)."""
    pytest.importorskip("torch", reason="regenerating the golden needs torch (the dev extra; "
                                        "no CPU wheel is pinned for Python >= 3.12)")
    pytest.importorskip("transformers")
    make_golden = _make_golden()
    assert make_golden.FAMILIES == FAMILIES and make_golden.LOGITS_FILE == LOGITS_FILE
    fresh = make_golden.write_golden(tmp_path / family, family)
    committed = ASSETS / family
    names = sorted(p.name for p in committed.iterdir())
    assert sorted(p.name for p in fresh.iterdir()) == names
    rerun = "tests/assets/hf is stale: rerun python tests/assets/hf/make_golden.py"
    for name in names:
        if name != LOGITS_FILE:
            assert (fresh / name).read_bytes() == (committed / name).read_bytes(), (name, rerun)
    np.testing.assert_allclose(np.load(fresh / LOGITS_FILE), golden(family).logits, atol=1e-6,
                               rtol=0, err_msg=rerun)
