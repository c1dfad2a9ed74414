"""config.json keys whose meaning depends on how transformers reads them, checked against
transformers itself (its `AutoConfig` and its logits on tiny checkpoints it writes here):

- `rope_scaling` beside `rope_parameters`: transformers 4.x and 5.x read `rope_scaling` first
  (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`: `rope_scaling or rope_parameters`,
  `rope_theta` from inside it, else the top-level key, else 10000). When the two give the same
  RoPE it loads, equal to transformers; when they disagree (a stale key) it is refused, naming
  both, in every family that reads RoPE.
- Qwen's `use_sliding_window` with `max_window_layers`: layer i slides when i >=
  max_window_layers (`Qwen2Config.__post_init__`, when `layer_types` is not given), so
  `max_window_layers` >= the layer count slides no layer and loads; a sliding layer is refused.
"""

import json

import numpy as np
import pytest

from family_checkpoints import edit_config, save_random
from zeroxla import models
from zeroxla.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 67
SIZES = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None)
LINEAR = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}


def write(cls_name, directory, **options):
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**SIZES, **options)
    return save_random(transformers.AutoModelForCausalLM.from_config(config), directory)


def logits_equal_transformers(directory):
    """Our model of `directory` (read by `hf.load_hf_model`) has transformers' logits."""
    x = np.random.default_rng(0).integers(0, VOCAB, (2, 16)).astype(np.int32)
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        theirs = model(torch.tensor(x, dtype=torch.long)).logits.numpy()
    _, ours = hf.load_hf_model(directory)
    assert theirs.std() > 0.3
    np.testing.assert_allclose(np.asarray(ours(x)), theirs, atol=1e-4, rtol=0)


# ---- rope_scaling beside rope_parameters -------------------------------------------------------

def tiny_config_json(family):
    return hf.to_hf_config(models.FAMILIES[family][1](vocab_size=VOCAB, d_model=48, num_heads=4,
                                                      num_kv_heads=2, mlp_dim=80))


STALE = {   # (rope_scaling, top-level rope_theta: None deletes it) beside rope_parameters
    "another-factor": ({"type": "linear", "factor": 2.0}, 5000.0),
    # the same scaling, but transformers takes rope_theta from the top level (here absent: its
    # default 10000), never from the rope_parameters it does not read
    "theta-only-in-rope_parameters": ({"type": "linear", "factor": 4.0}, None),
}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2"])
@pytest.mark.parametrize("stale", sorted(STALE))
def test_rope_scaling_disagreeing_with_rope_parameters_is_refused_naming_both(tmp_path, family,
                                                                              stale):
    scaling, theta = STALE[stale]
    config = {**tiny_config_json(family), "rope_parameters": LINEAR, "rope_scaling": scaling}
    if family == "gemma2":
        del config["layer_types"]                  # transformers' default pattern
    config.pop("rope_theta")
    if theta is not None:
        config["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert (read["factor"], read["rope_theta"]) != (LINEAR["factor"], LINEAR["rope_theta"])
    with pytest.raises(ValueError, match=r"config\.json rope_scaling=\{.*'factor': "
                                         rf"{scaling['factor']}.*rope_parameters=\{{.*'rope_theta'"
                                         r": 5000\.0.*transformers reads rope_scaling"):
        hf.from_hf_config(config)


def test_rope_scaling_agreeing_with_rope_parameters_loads_as_transformers_reads_it(tmp_path):
    """transformers 4.x's keys beside 5.x's, saying the same: one RoPE, transformers' logits."""
    directory = write("LlamaConfig", tmp_path, rope_parameters=dict(LINEAR))
    edit_config(directory, rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=5000.0)
    assert hf.read_hf_config(directory)["rope_scaling"]
    logits_equal_transformers(directory)


# ---- Qwen's sliding window on no layer ----------------------------------------------------------

@pytest.mark.parametrize("cls_name", ["Qwen2Config", "Qwen3Config"])
def test_qwen_use_sliding_window_on_no_layer_loads_with_transformers_logits(tmp_path, cls_name):
    """max_window_layers = the layer count: no layer slides (a 3-token window would change the
    logits of a 16-token row if one did)."""
    directory = write(cls_name, tmp_path, use_sliding_window=True, sliding_window=3,
                      max_window_layers=2)
    edit_config(directory, layer_types=None)       # transformers derives them, as from 4.x
    read = transformers.AutoConfig.from_pretrained(directory)
    assert read.layer_types == ["full_attention"] * 2 and read.sliding_window == 3
    logits_equal_transformers(directory)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_layers_are_refused_naming_the_keys(tmp_path, family):
    config = {**tiny_config_json(family), "use_sliding_window": True, "sliding_window": 3,
              "max_window_layers": 1}
    del config["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = transformers.AutoConfig.from_pretrained(tmp_path)
    assert read.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match=r"use_sliding_window=True .*sliding_window=3.*"
                                         r"max_window_layers=1.*layer 1 of 2 slides"):
        hf.from_hf_config(config)
