"""The family template: every registered family and option (`models.families`) passes the same
checks against transformers itself, from a tiny random checkpoint transformers writes here (no
network):

- logits of the checkpoint loaded straight into ZeRO-3 partitions equal transformers' (float32,
  atol 1e-4), on 2x4 (daily) and 1x8 with the first training loss (rtol 1e-5);
- the KV-cached decode (prefill, then one token at a time) equals the full forward;
- the Hybrid Engine's greedy tokens at tp 1/2/4 equal transformers' `generate(do_sample=False)`
  for 16 new tokens (tp 4 > 2 kv-heads: the kv-heads are replicated);
- every training path (ZeRO 0-3, ZeRO++'s hpZ and qwZ + qgZ, `pipeline=` 1F1B and ZB-H1 on 2
  stages) trains 2 steps as the unsharded model does on one device;
- the exported checkpoint reloads in transformers with equal logits and its own model_type;
- every option not built is refused by config.json key before any tensor is read, and a
  classifier head by its `architectures` entry.

A new family adds its case to CASES (docs/models.md).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
import family_checkpoints
from family_checkpoints import save_random
from zeroxla import models
from zeroxla.models import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB, NEW_TOKENS = 67, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)   # no early stop
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}

# case -> (transformers config class, its options): one per family and per option.
CASES = {
    "llama-llama3-biases-head_dim": ("LlamaConfig", dict(
        head_dim=16, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3)),
    "llama-linear-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                   "factor": 4.0})),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", dict(sliding_window=5, head_dim=12)),
    "gemma2-softcap-window": ("Gemma2Config", dict(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=12, sliding_window=5,
        attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
}
FAMILY_OF = {"LlamaConfig": "llama", "Qwen2Config": "qwen2", "Qwen3Config": "qwen3",
             "MistralConfig": "mistral", "Gemma2Config": "gemma2"}


def write_checkpoint(case, directory):
    """A random transformers checkpoint of `case` (norm weights ~1, every other tensor std 0.1,
    biases nonzero, so no mapping hides)."""
    cls_name, options = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**{**COMMON, **options})
    return save_random(transformers.AutoModelForCausalLM.from_config(config), directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            made[case] = write_checkpoint(case, tmp_path_factory.mktemp(case))
        return made[case]
    return get


@pytest.fixture(scope="module")
def zero3_on_2x4(checkpoint):
    """`get(case)`: (step, state) of `case`'s checkpoint loaded into ZeRO-3 partitions on 2 x 4
    (persistence_threshold 0: every leaf partitioned), loaded once per case for the tests that
    only read the state (its logits, the Hybrid Engine's generation)."""
    loaded = {}

    def get(case):
        if case not in loaded:
            loaded[case] = zeroxla.load_pretrained(
                checkpoint(case), zeroxla.make_mesh(nodes=2, local=4), progress=False,
                config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
        return loaded[case]
    return get


def torch_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def torch_logits(directory, x):
    with torch.no_grad():
        return torch_model(directory)(torch.tensor(x, dtype=torch.long)).logits.numpy()


def tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int32)


ALL = sorted(CASES)


@pytest.mark.parametrize("case", ALL)
def test_zero3_logits_equal_transformers_on_2x4(checkpoint, zero3_on_2x4, case):
    directory = checkpoint(case)
    _, state = zero3_on_2x4(case)
    model = zeroxla.gathered_model(state)
    assert model.config.family == FAMILY_OF[CASES[case][0]]
    x = tokens((2, 16))
    theirs = torch_logits(directory, x)
    assert theirs.std() > 0.3                # not a degenerate near-zero model
    np.testing.assert_allclose(np.asarray(model(x)), theirs, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL)
def test_1x8_logits_and_first_loss_equal_transformers(checkpoint, case):
    directory = checkpoint(case)
    mesh = zeroxla.make_mesh(nodes=1, local=8)
    # threshold 0: every leaf partitioned, the tied embedding too (gathered for both its uses)
    step, state = zeroxla.load_pretrained(directory, mesh, optimizer=optax.adamw(1e-3),
                                          config=zeroxla.ZeroConfig(stage=3,
                                                                    persistence_threshold=0),
                                          progress=False)
    x = tokens((2, 16))
    np.testing.assert_allclose(np.asarray(zeroxla.gathered_model(state)(x)),
                               torch_logits(directory, x), atol=ATOL, rtol=0)
    seq = tokens((8, 17), seed=1)
    _, metrics = step(state, {"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    with torch.no_grad():
        t = torch.tensor(seq, dtype=torch.long)
        want = torch_model(directory)(t, labels=t).loss.item()
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL)
def test_kv_cached_decode_equals_the_full_forward(checkpoint, case):
    """Prefill 6 tokens, then decode 10 one at a time: with a window of 5 the cached decode
    must drop the keys the full forward's mask drops."""
    _, model = hf.load_hf_model(checkpoint(case))
    x = tokens((2, 16), seed=2)
    full = np.asarray(model(x))
    cache = model.init_cache(2, 16)
    decode = jax.jit(lambda m, t, p, c: m.decode(t, p, c))
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    logits, cache = decode(model, x[:, :6], pos[:, :6], cache)
    steps = [np.asarray(logits)]
    for i in range(6, 16):
        logits, cache = decode(model, x[:, i:i + 1], pos[:, i:i + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case,change,same_until", [
    ("mistral-window", {"sliding_window": None}, 5),
    ("gemma2-softcap-window", {"sliding_window": 64}, 5),
    ("gemma2-softcap-window", {"attn_softcap": None}, 0),
    ("gemma2-softcap-window", {"final_softcap": None}, 0),
])
def test_each_option_is_honoured(checkpoint, case, change, same_until):
    """The option is not ignored: the same weights without it give other logits (a window
    of 5 only from position 5 on, where it drops keys)."""
    config, model = hf.load_hf_model(checkpoint(case))
    other = hf.model_from_params(config.replace(**change), hf.param_dict(model))
    x = tokens((1, 16))
    ours, theirs = np.asarray(model(x)), np.asarray(other(x))
    np.testing.assert_array_equal(ours[:, :same_until], theirs[:, :same_until])
    assert np.abs(ours[:, same_until:] - theirs[:, same_until:]).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL)
def test_hybrid_engine_greedy_equals_transformers_generate(checkpoint, zero3_on_2x4, case):
    """From ZeRO-3 partitions on 2 x 4 (persistence_threshold 0: every leaf partitioned) to
    each tensor-parallel size that divides the 4 query heads; tp 4 > 2 kv-heads replicates
    them. The engine only reads the state."""
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    directory = checkpoint(case)
    step, state = zero3_on_2x4(case)
    prompts = [tokens((7,), seed=3), tokens((7,), seed=4)]
    reference, want = torch_model(directory), []
    for prompt in prompts:
        with torch.no_grad():
            want.append(reference.generate(torch.tensor(prompt[None], dtype=torch.long),
                                           max_new_tokens=NEW_TOKENS, do_sample=False,
                                           attention_mask=torch.ones((1, prompt.size)),
                                           pad_token_id=0)[0].numpy())
    for tp in (1, 2, 4):
        engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=tp,
                                                              max_out_tokens=32))
        outs = engine.generate(state, prompts, max_new_tokens=NEW_TOKENS)
        for out, expected in zip(outs, want):
            np.testing.assert_array_equal(np.asarray(out), expected, err_msg=f"tp {tp}")


# Every training path of the engine, per family: the checkpoint loaded straight into each
# layout (ZeRO-3's with persistence_threshold 0: every leaf partitioned, quantized on the wire
# under qwZ / qgZ) trains 3 steps of SGD with momentum (optimizer state for ZeRO-1 and up to
# partition) as the unsharded model does on one device (single-device optax on
# `hf.load_hf_model`'s model, `reference.train_single_device`). ZeRO++'s quantized weights and
# gradients (qwZ, qgZ: int8 blocks) change the rounding, hence their looser bound; every other
# path is exact to float32 reassociation. The pipeline cuts the model at its stack and runs the
# rest as is (a tied embedding is read on the first and the last stage; Gemma 2's blocks are
# its layer pairs).
PATHS = {   # name -> (mesh, ZeroConfig options, PipelineConfig or None, loss rtol)
    "zero0": ((2, 4), dict(stage=0), None, 1e-5),
    "zero1": ((2, 4), dict(stage=1), None, 1e-5),
    "zero2": ((2, 4), dict(stage=2), None, 1e-5),
    "zero3-hpz": ((2, 4), dict(stage=3, hpz_partition_size=4, persistence_threshold=0), None,
                  1e-5),
    "zero3-qwz-qgz": ((2, 4), dict(stage=3, quantized_weights=True, quantized_gradients=True,
                                   persistence_threshold=0), None, 2e-2),
    "1f1b-zero1": ((1, 4), dict(stage=1), dict(micro_batches=2), 1e-5),
    "zb-h1-zero0": ((1, 4), dict(stage=0), dict(micro_batches=2, schedule="zb-h1"), 1e-5),
}


def _momentum_sgd():
    """SGD with momentum: optimizer state that ZeRO-1 and up partition (plain SGD has none)."""
    return optax.sgd(0.1, momentum=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL)
def test_every_engine_path_trains_like_the_unsharded_model(checkpoint, case):
    from reference import train_single_device
    from runs import run_steps

    directory = checkpoint(case)
    seq = tokens((16, 17), seed=5)
    batches = [{"inputs": seq[:, :-1], "targets": seq[:, 1:]}] * 3
    want, _ = train_single_device(hf.load_hf_model(directory)[1], _momentum_sgd(), batches)
    assert want[2] < want[1] < want[0]
    for name, (shape, options, pipeline, rtol) in PATHS.items():
        nodes, local = shape
        mesh = zeroxla.make_mesh(nodes, local, stages=2 if pipeline else 1)
        step, state = zeroxla.load_pretrained(
            directory, mesh, optimizer=_momentum_sgd(), config=zeroxla.ZeroConfig(**options),
            pipeline=zeroxla.PipelineConfig(**pipeline) if pipeline else None, progress=False)
        got = run_steps(step, state, batches)[1]
        np.testing.assert_allclose(got, want, rtol=rtol, err_msg=name)
        if options.get("quantized_weights"):       # int8 weights on the wire: not the float run
            assert got[0] != want[0], name


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL)
def test_export_reloads_in_transformers_with_equal_logits(checkpoint, case, tmp_path):
    config, model = hf.load_hf_model(checkpoint(case))
    hf.save_hf_model(config, model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == FAMILY_OF[CASES[case][0]]
    source = json.loads((checkpoint(case) / "config.json").read_text())
    assert written["tie_word_embeddings"] == source["tie_word_embeddings"]
    x = tokens((2, 16))
    np.testing.assert_allclose(torch_logits(tmp_path, x), np.asarray(model(x)), atol=ATOL, rtol=0)
    assert hf.from_hf_config(written) == config


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL)
def test_a_sequence_classifier_of_the_family_loads_as_a_reward_model(tmp_path, case):
    """`*ForSequenceClassification` with one label: the base and `score` as our RewardModel,
    its score at every position equal to transformers' `score(base(x).last_hidden_state)`."""
    cls_name, options = CASES[case]
    config = getattr(transformers, cls_name)(**{**COMMON, **options}, num_labels=1,
                                             pad_token_id=0)
    family_checkpoints.assert_sequence_classifier_scores_as_transformers(
        config, tmp_path, tokens((2, 16)), ATOL)


def test_transformers_4_rope_scaling_reads_as_5_rope_parameters():
    """Llama 3.1's config.json as transformers 4.x wrote it (rope_scaling + rope_theta) and as
    5.x writes it (rope_parameters) give one config."""
    config = models.LlamaConfig(vocab_size=VOCAB, d_model=48, num_heads=4, num_kv_heads=2,
                                rope_type="llama3", rope_factor=8.0, rope_theta=500000.0,
                                rope_original_max_len=8)
    new = hf.to_hf_config(config)
    old = {**new, "rope_parameters": None, "rope_theta": 500000.0,
           "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}
    assert hf.from_hf_config(old) == hf.from_hf_config(new) == config


def test_tied_embeddings_train_as_one_parameter(checkpoint):
    """transformers ties lm_head to embed_tokens: one tensor, trained once. So is ours."""
    config, model = hf.load_hf_model(checkpoint("qwen2-tied"))
    assert config.tie_word_embeddings
    paths = set(hf.param_dict(model))
    assert "embed/weight" in paths and "head/weight" not in paths
    assert not any(r.hf == "lm_head.weight" for r in hf.hf_name_map(config))


REFUSED = [
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type='longrope'"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type='dynamic'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    # layer 1 of 2 slides: transformers' rule, with layer_types left to it (test_family_config_keys)
    ("qwen2", {"max_window_layers": 1, "layer_types": None, "use_sliding_window": True},
     "use_sliding_window=True"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("llama", {"model_type": "falcon"},
     "model_type='falcon'.*gemma2, gemma3, gemma4, gpt2, gpt_oss, llama"),
    ("gemma2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("gemma2", {"num_hidden_layers": 3}, "num_hidden_layers=3"),
    ("gemma2", {"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
]


@pytest.mark.parametrize("family,change,match", REFUSED,
                         ids=[f"{family}-{key}" for family, change, _ in REFUSED for key in
                              [list(change)[-1]]])
def test_options_not_built_are_refused_by_key_before_any_tensor(tmp_path, family, change, match):
    """Only config.json exists: the refusal comes from it, not from a missing tensor file."""
    base = hf.to_hf_config(models.FAMILIES[family][1](vocab_size=VOCAB, d_model=48, num_heads=4,
                                                      num_kv_heads=2, mlp_dim=80))
    if family == "gemma2" and "layer_types" not in change:
        del base["layer_types"]          # transformers' default pattern, for the layer count
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(ValueError, match=match):
        zeroxla.load_pretrained(tmp_path, zeroxla.make_mesh(nodes=2, local=4), progress=False)


@pytest.mark.parametrize("architecture", ["Qwen2ForTokenClassification",
                                          "MistralForSequenceClassification"])
def test_train_init_from_refuses_a_classifier_by_its_architectures(tmp_path, architecture):
    from zeroxla.app.jobs.loading import init_from_head

    config = models.Qwen2Config(vocab_size=VOCAB, d_model=48, num_heads=4, num_kv_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(
        hf.to_hf_config(config, architectures=[architecture])))
    with pytest.raises(ValueError, match=f"architectures=\\['{architecture}'\\]"):
        init_from_head(str(tmp_path))
