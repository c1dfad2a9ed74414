"""models/hf.py: logits parity with `transformers` both ways, round trips, sharded checkpoints.

The parity tests need torch and transformers (the `test` extra) and skip without them.
"""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.models import hf

# Small shapes; GPT mlp_dim != 4 * d_model exercises n_inner, Llama has GQA (6 q / 2 kv heads)
# and a non-default rope_theta and eps.
GPT = models.GPTConfig(vocab_size=67, max_seq_len=32, d_model=48, num_heads=4, num_layers=2,
                       mlp_dim=100)
LLAMA = models.LlamaConfig(vocab_size=67, max_seq_len=32, d_model=48, num_heads=6, num_kv_heads=2,
                           num_layers=2, mlp_dim=80, rope_theta=5000.0, norm_eps=1e-5)
TOKENS = np.random.default_rng(0).integers(0, 67, size=(2, 16)).astype(np.int32)   # [B, T]
ATOL = 1e-4          # float32 logits, ours vs transformers


@pytest.fixture(scope="module")
def transformers():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return pytest.importorskip("transformers")


def random_params(config, seed=0):
    """Every parameter random, norm scales around 1 and biases nonzero, so no mapping hides."""
    shapes = {p: v.shape for p, v in hf.param_dict(abstract_model(config)).items()}
    rng = np.random.default_rng(seed)
    return {p: ((1.0 if p.endswith("scale") else 0.0)
                + 0.1 * rng.standard_normal(s)).astype(np.float32)
            for p, s in sorted(shapes.items())}


def abstract_model(config):
    cls = models.GPT if config.family == "gpt2" else models.Llama
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))


def our_logits(model):
    return np.asarray(model(jnp.asarray(TOKENS)))


def hf_logits(hf_model):
    import torch

    with torch.no_grad():
        return hf_model(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()


def random_hf_model(transformers, family, *, tied=False):
    import torch

    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=67, n_positions=32, n_embd=48, n_layer=2,
                                      n_head=4, n_inner=100, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=48, intermediate_size=80,
                                       num_hidden_layers=2, num_attention_heads=6,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       rms_norm_eps=1e-5, tie_word_embeddings=tied,
                                       rope_theta=5000.0)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = p.ndim == 1 and name.endswith("weight")
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm_weight else 0.0))
    return model.eval()


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("llama", False),
                                         pytest.param("llama", True, marks=pytest.mark.slow)])
def test_load_transformers_checkpoint_matches_its_logits(transformers, tmp_path, family, tied):
    hf_model = random_hf_model(transformers, family, tied=tied)
    hf_model.save_pretrained(tmp_path)
    config, model = hf.load_hf_model(tmp_path)
    expected = GPT if family == "gpt2" else LLAMA.replace(tie_word_embeddings=tied)
    assert config == expected
    np.testing.assert_allclose(our_logits(model), hf_logits(hf_model), atol=ATOL, rtol=0)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt2", "llama"])
def test_transformers_loads_our_export_with_same_logits(transformers, tmp_path, config):
    model = hf.model_from_params(config, random_params(config))
    files = hf.save_hf_model(config, model, tmp_path)
    assert sorted(f.name for f in files) == ["config.json", "model.safetensors"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(hf_logits(hf_model), our_logits(model), atol=ATOL, rtol=0)


def test_sharded_export_loads_in_transformers_and_back(transformers, tmp_path):
    params = random_params(LLAMA, seed=1)
    model = hf.model_from_params(LLAMA, params)
    limit = 20_000          # bytes; the largest tensor (mlp, 80 * 48 * 4 = 15,360 B) fits
    files = hf.save_hf_model(LLAMA, params, tmp_path, max_shard_size=limit)
    shards = [f for f in files if f.name.startswith("model-")]
    assert len(shards) > 2 and all(f.name.endswith(f"-of-{len(shards):05d}.safetensors")
                                   for f in shards)
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
    names = [name for name, _ in hf.to_hf_tensors(LLAMA, params)]
    assert sorted(index["weight_map"]) == sorted(names)
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert all(f.stat().st_size <= limit + 4096 for f in shards)    # + safetensors header
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(hf_logits(hf_model), our_logits(model), atol=ATOL, rtol=0)
    _, back = hf.load_hf_model(tmp_path)
    np.testing.assert_array_equal(our_logits(back), our_logits(model))


@pytest.mark.parametrize("config", [pytest.param(GPT, marks=pytest.mark.slow), LLAMA],
                         ids=["gpt2", "llama"])     # gpt2's export: against transformers daily
def test_export_import_round_trip_is_exact(tmp_path, config):
    params = random_params(config, seed=2)
    model = hf.model_from_params(config, params)
    hf.save_hf_model(config, model, tmp_path)
    loaded_config, loaded = hf.load_hf_model(tmp_path)
    assert loaded_config == config
    for path, value in hf.param_dict(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), params[path], err_msg=path)
    np.testing.assert_array_equal(our_logits(loaded), our_logits(model))


def test_bfloat16_export_rounds_each_parameter_once(tmp_path):
    params = random_params(LLAMA, seed=3)
    hf.save_hf_model(LLAMA, params, tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with hf.open_safetensors(tmp_path) as get_tensor:
        assert get_tensor("lm_head.weight").dtype == ml_dtypes.bfloat16
    _, loaded = hf.load_hf_model(tmp_path)
    for path, value in hf.param_dict(loaded).items():
        rounded = params[path].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(value), rounded, err_msg=path)


def test_gpt2_checkpoint_without_transformer_prefix(tmp_path):
    # The hub's openai-community/gpt2 was saved from GPT2Model: "h.0.attn.c_attn.weight", ...
    params = random_params(GPT, seed=4)
    tensors = ((name.removeprefix("transformer."), t) for name, t in hf.to_hf_tensors(GPT, params))
    hf.write_safetensors(tensors, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf.to_hf_config(GPT)))
    _, loaded = hf.load_hf_model(tmp_path)
    np.testing.assert_array_equal(our_logits(loaded),
                                  our_logits(hf.model_from_params(GPT, params)))


def test_streaming_getter_matches_mapping():
    params = random_params(GPT, seed=5)
    calls = []

    def get(path, layer):
        calls.append((path, layer))
        return params[path] if layer is None else params[path][layer]

    streamed = list(hf.to_hf_tensors(GPT, get))
    from_mapping = list(hf.to_hf_tensors(GPT, params))
    assert [n for n, _ in streamed] == [n for n, _ in from_mapping]
    for (_, a), (_, b) in zip(streamed, from_mapping):
        np.testing.assert_array_equal(a, b)
    assert all(layer is not None for path, layer in calls if path.startswith("blocks/"))
    assert len(streamed) == 4 + 12 * GPT.num_layers


def test_name_map_covers_every_parameter_once():
    for config in (GPT, LLAMA):
        ours = [p for rule in hf.hf_name_map(config) for p in rule.ours]
        assert sorted(ours) == sorted(hf.param_dict(abstract_model(config)))
    names = {r.hf for r in hf.hf_name_map(GPT)}
    assert "lm_head.weight" not in names                       # tied to wte, as HF saves it
    assert "lm_head.weight" in {r.hf for r in hf.hf_name_map(LLAMA)}


@pytest.mark.parametrize("change,match", [
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
     "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "falcon"}, "model_type"),
])
def test_unsupported_llama_options_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config({**hf.to_hf_config(LLAMA), **change})


@pytest.mark.parametrize("change,match", [
    ({"tie_word_embeddings": False}, "tie_word_embeddings"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_gpt2_options_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config({**hf.to_hf_config(GPT), **change})


def test_hf_config_round_trip():
    for config in (GPT, LLAMA, models.GPTConfig.gpt2_124m(), models.LlamaConfig.llama_7b()):
        assert hf.from_hf_config(hf.to_hf_config(config)) == config
    legacy = {**hf.to_hf_config(LLAMA), "rope_theta": 500000.0}    # transformers 4.x keys only
    del legacy["rope_parameters"]
    assert hf.from_hf_config(legacy).rope_theta == 500000.0


@pytest.mark.parametrize("size,expected", [
    (123, 123), ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
    ("10KB", 10_000), ("1.5GB", 1_500_000_000), ("8Mb", 10**6),
])
def test_parse_size(size, expected):
    assert hf.parse_size(size) == expected


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="max_shard_size"):
        hf.parse_size("five gigs")


# ---- the sequence-classification head: a reward model <-> *ForSequenceClassification ------------
SEQ = hf.SEQUENCE_CLASSIFICATION


def reward_params(config, seed):
    """A reward model's parameters (module docstring of models/hf.py): the base's under `base/`,
    a random score vector `v_head` [D]."""
    rng = np.random.default_rng(seed + 100)
    return ({f"base/{p}": v for p, v in random_params(config, seed).items()}
            | {"v_head": (0.3 * rng.standard_normal(config.d_model)).astype(np.float32)})


def our_reward_model(config, params):
    from zeroxla import rlhf

    model = rlhf.RewardModel(hf.model_from_params(
        config, {p.removeprefix("base/"): v for p, v in params.items() if p != "v_head"}))
    model.v_head[...] = jnp.asarray(params["v_head"])
    return model


def hf_scores(hf_model, tokens):
    """transformers' score at every position [B, T]: `score(base(tokens).last_hidden_state)`,
    not its pooled output (so every position is compared, not only the pooled one)."""
    import torch

    with torch.no_grad():
        hidden = hf_model.base_model(torch.as_tensor(tokens, dtype=torch.long)).last_hidden_state
        return hf_model.score(hidden).numpy()[..., 0]


def random_hf_reward_model(transformers, family):
    import torch

    common = dict(num_labels=1, pad_token_id=66)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=67, n_positions=32, n_embd=48, n_layer=2,
                                      n_head=4, n_inner=100, **common)
        model = transformers.GPT2ForSequenceClassification(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=48, intermediate_size=80,
                                       num_hidden_layers=2, num_attention_heads=6,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       rms_norm_eps=1e-5, rope_theta=5000.0, **common)
        model = transformers.LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = p.ndim == 1 and name.endswith("weight")
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if norm_weight else 0.0))
    return model.eval()


def test_sequence_classification_map_is_the_reward_models_parameters():
    from zeroxla import rlhf

    for config in (GPT, LLAMA):
        reward = nnx.eval_shape(lambda: rlhf.RewardModel(abstract_model(config)))
        ours = [p for rule in hf.hf_name_map(config, SEQ) for p in rule.ours]
        assert sorted(ours + list(hf.unmapped_params(config, SEQ))) == sorted(
            hf.param_dict(reward))
        assert len(ours) == len(set(ours))
    assert hf.unmapped_params(GPT, SEQ) == ()                     # tied: no LM projection
    assert hf.unmapped_params(LLAMA, SEQ) == ("base/head/weight",)
    assert "lm_head.weight" not in {r.hf for r in hf.hf_name_map(LLAMA, SEQ)}


@pytest.mark.parametrize("config", [pytest.param(GPT, marks=pytest.mark.slow), LLAMA],
                         ids=["gpt2", "llama"])
def test_transformers_loads_our_reward_model_as_a_sequence_classifier(transformers, tmp_path,
                                                                      config):
    """Our reward model written as `*ForSequenceClassification` with one more (zero) token row
    as its pad id: transformers' score equals ours at every position, and its pooled output of
    a batch without padding is our value at the last token, whichever ids end the rows."""
    params = reward_params(config, seed=6)
    ours = our_reward_model(config, params)
    grown, get = hf.with_vocab_size(config, lambda p, i: params[p] if i is None else params[p][i],
                                    68, SEQ)
    hf.save_hf_model(grown, get, tmp_path, head=SEQ, pad_token_id=67)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == hf.ARCHITECTURES[SEQ][config.family]
    assert (theirs.config.num_labels, theirs.config.pad_token_id) == (1, 67)
    values = np.asarray(ours(jnp.asarray(TOKENS)))                               # [B, T]
    np.testing.assert_allclose(hf_scores(theirs, TOKENS), values, atol=ATOL, rtol=0)
    import torch

    with torch.no_grad():
        pooled = theirs(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()[:, 0]
    np.testing.assert_allclose(pooled, values[:, -1], atol=ATOL, rtol=0)
    with hf.open_safetensors(tmp_path) as get_tensor:
        assert get_tensor("score.weight").shape == (1, config.d_model)
        embedding = "transformer.wte.weight" if config.family == "gpt2" else \
            "model.embed_tokens.weight"
        table = get_tensor(embedding)
    np.testing.assert_array_equal(table[:67], params[f"base/{hf.hf_name_map(config)[0].ours[0]}"])
    np.testing.assert_array_equal(table[67], 0)


@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_transformers_reward_model_loads_as_ours(transformers, tmp_path, family):
    from zeroxla import rlhf

    theirs = random_hf_reward_model(transformers, family)
    theirs.save_pretrained(tmp_path)
    ours = rlhf.load_hf_reward_model(tmp_path)
    assert ours.base.config == (GPT if family == "gpt2" else LLAMA)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(TOKENS))), hf_scores(theirs, TOKENS),
                               atol=ATOL, rtol=0)
    if family == "llama":              # no lm_head in the checkpoint: the unread projection is 0
        np.testing.assert_array_equal(np.asarray(ours.base.head.weight[...]), 0)
    with pytest.raises(ValueError, match=r"LlamaForSequenceClassification|GPT2ForSequence.*is a "
                                         r"sequence-classification \(reward\) model; "
                                         r"load_hf_model needs a causal LM"):
        hf.load_hf_model(tmp_path)


@pytest.mark.parametrize("architecture,kind", [
    ("GPT2LMHeadModel", "causal LM"), ("LlamaForCausalLM", "causal LM"),
    ("LlamaForSequenceClassification", r"sequence-classification \(reward\) model"),
    ("GPT2ForTokenClassification", "token-classification model"),
    ("LlamaForQuestionAnswering", "question-answering model"),
    ("GPT2DoubleHeadsModel", "double-heads"), ("LlamaModel", "base model whose checkpoint holds "
                                                             r"no LM head \(untied\)"),
    ("LlamaBidirectionalEncoder", "model whose head zeroxla does not read"),
])
def test_heads_other_than_the_accepted_ones_are_refused_by_architecture(architecture, kind):
    config = {**hf.to_hf_config(LLAMA), "architectures": [architecture]}
    accepted = (hf.SEQUENCE_CLASSIFICATION,) if "CausalLM" in architecture or "LMHead" in \
        architecture else (hf.CAUSAL_LM,)
    with pytest.raises(ValueError, match=rf"architectures=\['{architecture}'\]: {architecture} "
                                         rf"is an? {kind}.*; the job needs"):
        hf.check_head(config, accepted, user="the job", instead="use another")
    assert hf.check_head({k: v for k, v in config.items() if k != "architectures"},
                         (hf.CAUSAL_LM,), user="the job", instead="") == hf.CAUSAL_LM
    bare_gpt2 = {**hf.to_hf_config(GPT), "architectures": ["GPT2Model"]}   # head = tied wte
    assert hf.hf_head(bare_gpt2) == hf.CAUSAL_LM


def test_a_sequence_classifier_needs_one_label():
    config = {**hf.to_hf_config(GPT, head=SEQ)}
    assert hf.check_head(config, (SEQ,), user="u", instead="") == SEQ
    two = {**config, "id2label": {"0": "bad", "1": "good"}}
    with pytest.raises(ValueError, match=r"num_labels=2 .*needs num_labels=1"):
        hf.check_head(two, (SEQ,), user="u", instead="")
    del two["id2label"]                                        # transformers' default: 2 labels
    with pytest.raises(ValueError, match="num_labels=2"):
        hf.check_head(two, (SEQ,), user="u", instead="")


def test_with_vocab_size_adds_rows_and_never_drops_them():
    params = random_params(GPT, seed=7)
    grown, get = hf.with_vocab_size(GPT, lambda p, i: params[p] if i is None else params[p][i], 70)
    assert grown.vocab_size == 70
    np.testing.assert_array_equal(get("embed/wte", None)[:67], params["embed/wte"])
    np.testing.assert_array_equal(get("embed/wte", None)[67:], 0)
    assert get("embed/wpe", None) is params["embed/wpe"]
    with pytest.raises(ValueError, match="vocab_size=60 < the model's 67"):
        hf.with_vocab_size(GPT, get, 60)
