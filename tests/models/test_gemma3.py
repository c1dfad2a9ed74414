"""Gemma 3 text (`models.gemma3`, `models.families.gemma3`) against transformers itself, from
tiny random checkpoints transformers writes here (6 layers: two periods of two sliding layers,
window 4, and one global layer; the local and global RoPE differ in base, the global one linear
scaled; the final logits soft-capped; every tensor perturbed, no network):

- loaded straight into ZeRO-3 partitions on 2 x 4: logits within 1e-4 of transformers'
  `Gemma3ForCausalLM` (float32) on sequences longer than the window, the loss equal to its
  `labels=` loss (rtol 1e-5);
- a published-layout checkpoint (`Gemma3ForConditionalGeneration`: `text_config` nesting, the
  language model under `language_model.model.`, a vision tower and projector) loads the text
  model alone with logits equal to transformers';
- a packed row (two sequences and padding) equals its sequences run alone (1e-5);
- the Hybrid Engine's greedy tokens, static and continuous batching at tp 1 and 2, equal
  transformers' `generate(do_sample=False)` past the window;
- ZeRO-3 on 2 x 4 with packed rows, with SP = 2 and with LoRA adapters trains 3 steps as the
  unsharded model does on one device;
- the export reloads in transformers with equal logits, and every config.json option not built
  is refused by its key, flat and nested under `text_config`;
- a layer count that is not whole periods (8 layers: one period of 6, then 2 sliding layers in
  the tail): logits and loss under ZeRO-3 equal transformers', the export reloads, the Hybrid
  Engine's greedy tokens equal transformers' `generate` (static and continuous), ZeRO-3 on
  2 x 4 and with SP = 2 trains as the unsharded model does, and a pipeline refuses it by name.
"""

import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
import family_checkpoints
from family_checkpoints import (assert_export_reloads_in_transformers,
                                assert_packed_row_equals_its_sequences_alone,
                                assert_zero3_logits_and_loss_equal_transformers,
                                packed_row,
                                save_random, token_ids, torch_causal_lm)
from zeroxla import models
from zeroxla.models import hf
from runs import run_steps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 67
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}}
# Periods of 3 (transformers' default is 6: the tail checkpoint below keeps it): what ZeRO-3
# compiles per period is half as long, and a period still holds several sliding layers.
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=4,
            query_pre_attn_scalar=12, final_logit_softcapping=3.0,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, rope_parameters=ROPE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A `Gemma3ForCausalLM` (model_type gemma3_text) checkpoint, every tensor perturbed."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Gemma3TextConfig(**TEXT))
    return save_random(model, tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def tail_checkpoint(tmp_path_factory):
    """8 layers: one period of 6 (5 sliding, 1 global), then 2 sliding layers (the tail),
    transformers' own `layer_types` for 8 layers; every tensor perturbed."""
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma3TextConfig(**{**TEXT, "num_hidden_layers": 8, "layer_types": None}))
    return save_random(model, tmp_path_factory.mktemp("gemma3_tail"))


def test_zero3_logits_and_loss_equal_transformers_on_2x4(checkpoint):
    assert_zero3_logits_and_loss_equal_transformers(checkpoint, "gemma3", 2, VOCAB, ATOL)


def test_a_published_layout_checkpoint_loads_its_text_model(tmp_path):
    """`Gemma3ForConditionalGeneration` as the hub's Gemma 3 4B-27B checkpoints are: config.json
    nests the text model under text_config (the RoPE in 4.x keys: rope_theta,
    rope_local_base_freq, rope_scaling), the tensors are under language_model.model. beside
    vision_tower.* and multi_modal_projector.*, which are never read."""
    from safetensors.numpy import load_file

    torch.manual_seed(1)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=2)
    text = {**{k: v for k, v in TEXT.items() if k != "rope_parameters"}, "num_hidden_layers": 6,
            "layer_types": None, "final_logit_softcapping": None}
    reference = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4))
    save_random(reference, tmp_path)
    hf_json = json.loads((tmp_path / "config.json").read_text())
    hf_json["text_config"].pop("rope_parameters")     # the 4.x spelling of the same RoPE
    hf_json["text_config"].update(rope_theta=5000.0, rope_local_base_freq=100.0,
                                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("vision_tower.") for n in tensors)
    assert any(n.startswith("language_model.model.layers.") for n in tensors)
    config, model = hf.load_hf_model(tmp_path)
    assert (config.num_layers, config.rope_type, config.rope_factor) == (1, "linear", 4.0)
    assert (config.rope_theta, config.rope_local_theta) == (5000.0, 100.0)
    reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    x = token_ids(VOCAB, (2, 16), seed=1)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(x)), theirs, atol=ATOL, rtol=0)


def test_a_packed_row_equals_its_sequences_run_alone(checkpoint):
    _, model = hf.load_hf_model(checkpoint)
    assert_packed_row_equals_its_sequences_alone(model, VOCAB, padding=4)


@pytest.fixture(scope="module")
def greedy_case(checkpoint):
    """The ZeRO-3 load, prompts and transformers' tokens every engine of the next test starts
    from, made once (`family_checkpoints.greedy_case`)."""
    return family_checkpoints.greedy_case(checkpoint, VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("batching,tp", [pytest.param("static", 1, marks=pytest.mark.slow),
                                         pytest.param("static", 2, marks=pytest.mark.slow),
                                         pytest.param("continuous", 1, marks=pytest.mark.slow),
                                         ("continuous", 2)])
def test_hybrid_engine_greedy_equals_transformers_generate(greedy_case, batching, tp):
    """From ZeRO-3 partitions on 2 x 4 (every leaf partitioned) to tp 1 and 2, static and
    continuous batching (pages of 4 slots); 7-token prompts and 12 new tokens: past the
    sliding window of 4."""
    family_checkpoints.assert_engine_greedy_equals_transformers(greedy_case, batching, tp)


def _packed_batch():
    """8 packed rows [8, 16] with their positions, segment ids and loss mask."""
    rows = [packed_row(VOCAB, 4, seed) for seed in range(0, 16, 2)]
    seq = np.concatenate([r[0] for r in rows])
    seg = np.concatenate([r[2] for r in rows])
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:],
            "positions": np.concatenate([r[1] for r in rows])[:, :-1],
            "segment_ids": seg[:, :-1],
            # a token's target is the next token of its own sequence
            "loss_mask": ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float32)}


LORA = dict(dim=4, alpha=8.0, module_name=r"blocks/.*(wq|wv|w_up)$")
# name -> (mesh (nodes, local, sequence), with LoRA adapters)
TRAINING = {"zero3-2x4-packed": ((2, 4, 1), False), "zero3-sp2-packed": ((2, 2, 2), False),
            "zero3-2x4-lora": ((2, 4, 1), True), "tail-zero3-2x4-packed": ((2, 4, 1), False),
            "tail-zero3-sp2-packed": ((2, 2, 2), False)}


def _float64_model(checkpoint, lora):
    """The checkpoint's float64 model, with `LORA`'s adapters if `lora`."""
    return family_checkpoints.float64_model(checkpoint, LORA if lora else None)


def _training_batches():
    """3 x `_packed_batch()`, its loss mask in float64."""
    batch = _packed_batch()
    return [{**batch, "loss_mask": batch["loss_mask"].astype(np.float64)}] * 3


TRAINING_OPTIMIZER = optax.sgd(0.01, momentum=0.9)


def _one_device_run(checkpoint, lora):
    """`family_checkpoints.one_device_run` over `_training_batches()`."""
    return family_checkpoints.one_device_run(checkpoint, LORA if lora else None,
                                             TRAINING_OPTIMIZER, _training_batches())


@pytest.fixture(scope="module")
def one_device():
    """`_one_device_run`, once per checkpoint and adapters: the layouts without adapters
    (2 x 4, SP = 2) compare with one run of it."""
    return functools.cache(_one_device_run)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINING))
def test_zero3_trains_packed_rows_like_the_unsharded_model(checkpoint, tail_checkpoint,
                                                            one_device, name):
    """3 steps of SGD with momentum on packed rows, every leaf partitioned, against single-
    device optax on the same model (`reference.train_single_device`; with LoRA the base masked
    out of the reference's optimizer): losses rtol 1e-5, every leaf rtol 1e-4 + atol 1e-6. In
    float64, as tests/models/test_qwen3_5.py says why: in float32 the adapters (which start at
    zero, so hold the update alone) were 2e-6 apart after 3 steps, float32 reassociation grown
    by the steps."""
    from reference import flat_params
    from runs import run_steps
    from zeroxla.lora import LoRAConfig, lora_trainable

    (nodes, local, sequence), lora = TRAINING[name]
    checkpoint = tail_checkpoint if name.startswith("tail-") else checkpoint
    config = LoRAConfig(**LORA, only_optimize_lora=True)
    want, expected, trained = one_device(checkpoint, lora)
    with jax.enable_x64(True):
        step = zeroxla.make_step(_float64_model(checkpoint, lora),
                                 zeroxla.make_mesh(nodes, local, sequence=sequence),
                                 optimizer=TRAINING_OPTIMIZER,
                                 config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                                           compute_dtype="float64"),
                                 trainable=lora_trainable(config) if lora else None)
        state, losses = run_steps(step, step.init(), _training_batches())
        got = flat_params(zeroxla.gather_params(state))
    assert want[2] < want[1] < want[0]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert not lora or trained == {leaf.path for leaf in step.layout.plan.trainable_leaves}
    for path in expected:
        assert got[path].dtype == np.float64, path
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)


def test_export_reloads_in_transformers_with_equal_logits(checkpoint, tmp_path):
    assert_export_reloads_in_transformers(checkpoint, tmp_path, "gemma3_text", "Gemma3ForCausalLM",
                                          VOCAB, ATOL)


def test_a_trailing_partial_period_equals_transformers(tail_checkpoint):
    """One period and a tail of 2 sliding layers, loaded into ZeRO-3 partitions on 2 x 4:
    logits within 1e-4 of transformers', the loss equal to its `labels=` loss."""
    config = hf.from_hf_config(hf.read_hf_config(tail_checkpoint))
    assert (config.num_layers, config.tail_layers) == (1, 2)
    assert_zero3_logits_and_loss_equal_transformers(tail_checkpoint, "gemma3", 1, VOCAB, ATOL)


def test_a_trailing_partial_period_exports_and_reloads(tail_checkpoint, tmp_path):
    assert_export_reloads_in_transformers(tail_checkpoint, tmp_path, "gemma3_text",
                                          "Gemma3ForCausalLM", VOCAB, ATOL)


@pytest.fixture(scope="module")
def tail_greedy_case(tail_checkpoint):
    return family_checkpoints.greedy_case(tail_checkpoint, VOCAB)


# slow: the tail's logits against transformers are daily; its generation is the engines'
# (Gemma 4's mixed-shape greedy test is their daily representative)
@pytest.mark.slow
@pytest.mark.parametrize("batching,tp", [("continuous", 2), ("static", 1)])
def test_a_trailing_partial_period_generates_as_transformers(tail_greedy_case, batching, tp):
    """The tail's KV cache (one more row of the periods' shape; a paged cache's last layer):
    the Hybrid Engine's greedy tokens equal transformers' `generate`, past the window of 4."""
    family_checkpoints.assert_engine_greedy_equals_transformers(tail_greedy_case, batching, tp)


def test_a_pipeline_refuses_a_stack_after_the_periods(tail_checkpoint):
    """The pipeline stores every stacked layer split over its stages as the periods' own: a
    model with the tail's stack besides is refused by name, not split wrong."""
    _, model = hf.load_hf_model(tail_checkpoint)
    with pytest.raises(ValueError, match="LayerStack besides self.blocks"):
        zeroxla.make_step(model, zeroxla.make_mesh(1, stages=2), optimizer=optax.sgd(0.1),
                          config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0),
                          pipeline=zeroxla.PipelineConfig(2))


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]},
     "layer_types"),
    ({"num_hidden_layers": 5, "layer_types": None}, "num_hidden_layers=5"),
    ({"sliding_window_pattern": 1, "layer_types": None}, "sliding_window_pattern=1"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "yarn", "factor": 4.0}}},
     "rope_parameters.full_attention.rope_type='yarn'"),
    ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_parameters.full_attention.rope_type='dynamic'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
])
def test_options_not_built_are_refused_by_key(checkpoint, change, match):
    source = hf.read_hf_config(checkpoint)
    edited = {k: v for k, v in {**source, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config(edited)
    # the published layout (its final soft-capping is refused: the next test)
    nested = {"model_type": "gemma3",
              "text_config": {k: v for k, v in edited.items() if k != "final_logit_softcapping"}}
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config(nested)


def test_a_final_softcap_nested_under_text_config_is_refused_by_key(checkpoint):
    """transformers' Gemma3ForConditionalGeneration does not apply it; flat, it loads (the
    checkpoint's 3.0, held to transformers' logits above)."""
    source = hf.read_hf_config(checkpoint)
    assert hf.from_hf_config(source).final_softcap == 3.0
    with pytest.raises(ValueError, match="text_config.final_logit_softcapping=3.0"):
        hf.from_hf_config({"model_type": "gemma3", "text_config": source})


def test_defaults_and_parameter_count_equal_transformers(checkpoint):
    """`Gemma3Config`'s RoPE bases and soft-capping default to transformers' Gemma3TextConfig's,
    and the checkpoint's model holds as many parameters as transformers' (the tied head once)."""
    defaults = transformers.Gemma3TextConfig()
    config = models.Gemma3Config()
    assert config.rope_theta == defaults.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == (
        defaults.rope_parameters["sliding_attention"]["rope_theta"])
    assert config.final_softcap is None and config.attn_softcap is None
    assert config.sliding_window_pattern == defaults.layer_types.index("full_attention") + 1
    tiny = hf.from_hf_config(hf.read_hf_config(checkpoint))
    ours = sum(np.size(v) for v in hf.param_dict(models.Gemma3(tiny, rngs=nnx.Rngs(0))).values())
    assert ours == sum(p.numel() for p in torch_causal_lm(checkpoint).parameters())


@pytest.mark.slow
def test_pipelined_over_two_stages_trains_like_one_device():
    """Periods of 3 (2 sliding + 1 global) as the pipeline's units: 2 stages, ZeRO-3, against
    single-device optax."""
    from reference import token_batches, train_single_device

    config = models.Gemma3Config(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2,
                                 mlp_dim=64, num_layers=2, sliding_window=4,
                                 sliding_window_pattern=3, init_std=0.2)
    _assert_pipeline_equals_one_device(lambda: models.Gemma3(config, rngs=nnx.Rngs(0)),
                                       token_batches(2, 8, 16, 64), train_single_device)


def _assert_pipeline_equals_one_device(build, batches, train_single_device):
    expected, _ = train_single_device(build(), optax.sgd(0.1), batches)
    step = zeroxla.make_step(build(), zeroxla.make_mesh(1, stages=2), optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0),
                             pipeline=zeroxla.PipelineConfig(2))
    _, losses = run_steps(step, step.init(), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
