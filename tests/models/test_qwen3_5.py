"""Qwen3.5 dense (`models.qwen3_5`, `models.families.qwen3_5`) against transformers itself, from
tiny random checkpoints transformers writes here (8 layers: two periods of three Gated DeltaNet
layers and one gated attention layer; every tensor perturbed, no network):

- loaded straight into ZeRO-3 partitions on 2 x 4: logits within 1e-4 of transformers'
  `Qwen3_5ForCausalLM` (float32), the loss equal to its `labels=` loss (rtol 1e-5);
- a published-layout checkpoint (`Qwen3_5ForConditionalGeneration`: `text_config` nesting, the
  language model under `model.language_model.`, a vision tower, `mtp.*` tensors, a tied head)
  loads the text model alone with logits equal to transformers';
- a packed row (two sequences and padding) equals its sequences run alone (1e-5), and without
  its segment ids it does not (the conv window and the recurrent state do reset);
- ZeRO-3 on 2 x 4 trains 3 steps on packed rows as the unsharded model on one device does
  (in float64: the test says why);
- the export reloads in transformers with equal logits;
- the Hybrid Engine's static path decodes transformers' greedy tokens from prompts of
  different lengths in one batch (the pad case), tp 1, 2 and 4, and the log-probs it draws with
  equal the training forward's (`token_logprobs`, 1e-5);
- "auto" picks continuous batching (the recurrent state in per-sequence slots: its tokens in
  test_qwen3_5_continuous.py), a GRPO iteration rolls out under it, and every config.json
  option not built is refused by its key.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
import family_checkpoints
from family_checkpoints import (assert_export_reloads_in_transformers,
                                assert_packed_row_equals_its_sequences_alone,
                                assert_zero3_logits_and_loss_equal_transformers, packed_loss,
                                packed_row,
                                save_random, token_ids)
from zeroxla import models
from zeroxla.models import hf
from runs import run_steps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 67
# head_dim 32: partial RoPE rotates 8 dims (4 frequencies), which mRoPE's sections (2, 1, 1)
# take from its temporal, height and width rows: the same text position on each.
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=64, rms_norm_eps=1e-5, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A `Qwen3_5ForCausalLM` (model_type qwen3_5_text) checkpoint, every tensor perturbed."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**TEXT))
    return save_random(model, tmp_path_factory.mktemp("qwen3_5"))


def test_zero3_logits_and_loss_equal_transformers_on_2x4(checkpoint):
    assert_zero3_logits_and_loss_equal_transformers(checkpoint, "qwen3_5", 2, VOCAB, ATOL)


def test_a_published_layout_checkpoint_loads_its_text_model(tmp_path):
    """`Qwen3_5ForConditionalGeneration` as the hub's Qwen3.5 checkpoints are: config.json
    nests the text model under text_config (tie_word_embeddings outside it), the tensors are
    under model.language_model., beside model.visual.* and mtp.* (added here, as the released
    files hold them), which are never read."""
    from safetensors.numpy import load_file, save_file

    torch.manual_seed(1)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                  out_hidden_size=48, num_position_embeddings=16)
    text = {**TEXT, "num_hidden_layers": 4}
    reference = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=True))
    save_random(reference, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors and any(n.startswith("model.visual.") for n in tensors)
    tensors["mtp.fc.weight"] = np.ones((48, 96), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config, model = hf.load_hf_model(tmp_path)
    assert config.tie_word_embeddings and config.num_layers == 1
    x = token_ids(VOCAB, (2, 16), seed=1)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(x)), theirs, atol=ATOL, rtol=0)


def test_a_packed_row_equals_its_sequences_run_alone(checkpoint):
    _, model = hf.load_hf_model(checkpoint)
    forward, row, positions, alone_b = assert_packed_row_equals_its_sequences_alone(
        model, VOCAB, padding=3)
    unreset = np.asarray(forward(model, row, positions))     # no segment ids: one sequence
    assert np.abs(unreset[:, 7:13] - alone_b).max() > 1e-3


@pytest.mark.slow
def test_zero3_on_2x4_trains_packed_rows_like_the_unsharded_model(checkpoint):
    """In float64 (`ZeroConfig(compute_dtype="float64")`, as tests/zeroxla/engine/
    test_float64_parity.py), every leaf held to rtol 1e-4 + atol 1e-6 and the losses to 1e-5.
    This tiny random model's updates amplify a perturbation about 50-fold per step at lr 0.01
    (measured on one device in float64: a loss scaled by 1 + 6e-8, the step's float32 loss
    normaliser's rounding, moves the parameters 4e-8, 3e-6, 5e-5 after steps 1-3), and its
    float32 gradients are 2.4e-5 off their float64 values; so float64 and lr 0.002, where the
    parity errors stay at 7e-6 of the update after 3 steps."""
    from reference import flat_params, train_single_device

    rows = [packed_row(VOCAB, 3, seed) for seed in range(0, 16, 2)]      # 8 rows
    seq = np.concatenate([r[0] for r in rows])
    seg = np.concatenate([r[2] for r in rows])
    batch = {"inputs": seq[:, :-1], "targets": seq[:, 1:],
             "positions": np.concatenate([r[1] for r in rows])[:, :-1],
             "segment_ids": seg[:, :-1],
             # a token's target is the next token of its own sequence
             "loss_mask": ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float64)}
    batches = [batch] * 3
    optimizer = optax.sgd(0.002, momentum=0.9)
    with jax.enable_x64(True):
        want, expected = train_single_device(hf.load_hf_model(checkpoint, dtype=jnp.float64)[1],
                                             optimizer, batches, loss_fn=packed_loss)
        step = zeroxla.make_step(hf.load_hf_model(checkpoint, dtype=jnp.float64)[1],
                                 zeroxla.make_mesh(nodes=2, local=4), optimizer=optimizer,
                                 config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                                           compute_dtype="float64"))
        state, losses = run_steps(step, step.init(), batches)
        got = flat_params(zeroxla.gather_params(state))
    assert want[2] < want[1] < want[0]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for path in expected:
        assert got[path].dtype == np.float64, path
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)


def test_export_reloads_in_transformers_with_equal_logits(checkpoint, tmp_path):
    assert_export_reloads_in_transformers(checkpoint, tmp_path, "qwen3_5_text",
                                          "Qwen3_5ForCausalLM", VOCAB, ATOL)


@pytest.fixture(scope="module")
def greedy_case(checkpoint):
    """The ZeRO-3 load, prompts of 5 and 9 tokens and transformers' greedy tokens, made once
    (`family_checkpoints.greedy_case`)."""
    return family_checkpoints.greedy_case(checkpoint, VOCAB, lengths=(5, 9))


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow),
                                pytest.param(4, marks=pytest.mark.slow)])
def test_static_greedy_equals_transformers_generate(greedy_case, tp):
    """From ZeRO-3 partitions on 2 x 4 to tp 1, 2 and 4, 12 new tokens after prompts of 5 and 9
    tokens in one batch (both right-padded to the 16-token bucket): a DeltaNet state that ran
    on past a row's last prompt token would change its tokens. tp 2 splits the KV cache's,
    the conv windows' and the [H, K, V] states' heads; tp 4 replicates the 2 KV heads and the
    2 DeltaNet key heads."""
    family_checkpoints.assert_engine_greedy_equals_transformers(greedy_case, "static", tp)


@pytest.mark.slow    # the static greedy test at tp 2 is the decode's daily representative
def test_decode_logprobs_equal_the_training_forward(greedy_case):
    """Sampled at temperature 1 (tp 2): the log-prob each token was drawn with (the decode's
    logits: prefill, then one-token steps through the recurrent rule) equals the training
    forward's log-prob of it over the whole output (the chunked rule), within 1e-5 relative
    (the two orders of float32 sums; 3.1e-6 relative, 1.2e-5 absolute on log-probs near -4
    measured on the CPU)."""
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    step, state, prompts, _ = greedy_case
    engine = HybridEngine(step.layout, HybridEngineConfig(
        inference_tp_size=2, batching="static", max_out_tokens=32))
    outputs, drawn = engine.generate(state, prompts, max_new_tokens=8, temperature=1.0,
                                     seed=1, return_logprobs=True)
    forward = jax.jit(lambda m, x, y: m.token_logprobs(x, y))
    model = zeroxla.gathered_model(state)
    for prompt, out, logprobs in zip(prompts, outputs, drawn):
        assert out.size == prompt.size + 8
        want = np.asarray(forward(model, out[None, :-1], out[None, 1:]))[0, prompt.size - 1:]
        np.testing.assert_allclose(logprobs, want, rtol=1e-5, atol=0)


def test_auto_picks_continuous_batching_and_a_cache_without_slots_is_refused(checkpoint):
    """The DeltaNet state rides in per-sequence slots beside the pages
    (`models.recurrent_slots`): "auto" picks continuous batching, before anything compiles;
    the model's decode refuses a `PagedKV` without slots naming the family, and the ZeRO-3
    re-gather baseline, which carries a KV cache alone, refuses the model. Its tokens are
    checked in test_qwen3_5_continuous.py."""
    from zeroxla.inference import HybridEngine, HybridEngineConfig, Zero3Generator
    from zeroxla.models.paged_attention import PagedKV

    config = hf.from_hf_config(hf.read_hf_config(checkpoint))
    step = zeroxla.make_step(lambda: models.Qwen3_5(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(nodes=1, local=8),
                             config=zeroxla.ZeroConfig(stage=3))
    engine = HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=32, batching="auto"))
    assert engine.batching == "continuous" and engine.batching_reason is None
    pool = jax.ShapeDtypeStruct((2, 1, 2, 2, 4, 32), jnp.float32)
    pages = PagedKV(pool, pool, jax.ShapeDtypeStruct((1, 2, 1), jnp.int32))
    ids = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(NotImplementedError, match="qwen3_5.*paged.*recurrent state"):
        jax.eval_shape(lambda: step.layout.model_def.abstract_module().decode(ids, ids, pages))
    with pytest.raises(ValueError, match="Qwen3_5.*recurrent state.*does not carry"):
        Zero3Generator(step.layout, 32)


@pytest.mark.slow
def test_grpo_rolls_out_a_qwen3_5_actor_under_continuous_batching(tmp_path, monkeypatch, capsys):
    """`zeroxla grpo` (batching "auto") takes a tiny Qwen3.5 actor: its rollouts and held-out
    greedy answers (256 rows) decode under continuous batching (the DeltaNet state in slots,
    a group's prompt state copied into its answers'; the record carries the rollout engine's
    page statistics), one iteration completes and logs its reward and the train/rollout
    log-prob gap (2.4e-7 measured)."""
    import json

    from zeroxla.app.cli import main
    from zeroxla.app.jobs import grpo as grpo_job
    from zeroxla.app.tokenizers.basic import CharTokenizer
    from zeroxla.rlhf.grpo import arithmetic_task as task

    tokenizer = CharTokenizer.from_text(task.ALPHABET)
    config = models.Qwen3_5Config(
        vocab_size=tokenizer.vocab_size, max_seq_len=64, d_model=16, num_heads=2,
        num_kv_heads=2, explicit_head_dim=8, num_layers=1, mlp_dim=16, attention_interval=2,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
        linear_value_head_dim=4)
    actor = models.Qwen3_5(config, rngs=nnx.Rngs(0))
    monkeypatch.setattr(grpo_job, "load_actor", lambda run: (actor, tokenizer))
    out = tmp_path / "grpo"
    assert main(["grpo", "--actor", "sft", "--iterations", "1", "--num-generations", "2",
                 "--per-iteration-prompts", "4", "--max-completion-length", "6", "--out",
                 str(out), "--no-progress"]) == 0, capsys.readouterr().err
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(record["reward"]) and np.isfinite(record["loss"]), record
    assert "generation/kv_pages_mean" in record, record          # the rollout engine's
    # the rollout's log-probs (the decode) against the actor's training forward
    assert record["gap/max"] < 1e-4, record


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["full_attention", "linear_attention", "linear_attention",
                      "linear_attention"] * 2}, "layer_types"),
    ({"num_hidden_layers": 6, "layer_types": None}, "num_hidden_layers=6"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"model_type": "qwen3_5_moe"}, "num_experts=None"),      # the MoE variant's keys absent
])
def test_options_not_built_are_refused_by_key(checkpoint, change, match):
    source = hf.read_hf_config(checkpoint)
    edited = {k: v for k, v in {**source, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config(edited)
    nested = {"model_type": "qwen3_5", "text_config": edited}         # the published layout
    if "model_type" not in change:
        with pytest.raises(ValueError, match=match):
            hf.from_hf_config(nested)


@pytest.mark.slow
def test_pipelined_over_two_stages_trains_like_one_device():
    """Periods of 3 (2 DeltaNet layers + 1 gated attention layer) as the pipeline's units:
    2 stages, ZeRO-3, against single-device optax."""
    from reference import token_batches, train_single_device
    from zeroxla.models.qwen3_5 import Qwen3_5, Qwen3_5Config

    config = Qwen3_5Config(vocab_size=64, num_layers=2, attention_interval=3)
    _assert_pipeline_equals_one_device(lambda: Qwen3_5(config, rngs=nnx.Rngs(0)),
                                       token_batches(2, 8, 16, 64), train_single_device)


def _assert_pipeline_equals_one_device(build, batches, train_single_device):
    expected, _ = train_single_device(build(), optax.sgd(0.1), batches)
    step = zeroxla.make_step(build(), zeroxla.make_mesh(1, stages=2), optimizer=optax.sgd(0.1),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0),
                             pipeline=zeroxla.PipelineConfig(2))
    _, losses = run_steps(step, step.init(), batches)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
