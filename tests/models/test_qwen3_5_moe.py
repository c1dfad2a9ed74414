"""Qwen3.5 MoE (`models.qwen3_5_moe`, `models.families.qwen3_5_moe`) against transformers itself,
from tiny random checkpoints transformers writes here (3 layers: one period of two Gated
DeltaNet layers and one gated attention layer, each with an MoE MLP of 8 experts, top-2, and a
gated shared expert; every tensor perturbed, no network):

- loaded straight into ZeRO-3 partitions on 2 x 4: logits within 1e-4 of transformers'
  `Qwen3_5MoeForCausalLM` (float32), the loss equal to its `labels=` loss (rtol 1e-5);
- the auxiliary load-balancing loss of our router statistics equal to transformers' `aux_loss`
  (`output_router_logits=True`) within 1e-5, from the per-expert layout transformers writes and
  from the fused one (`experts.gate_up_proj`) it also reads;
- a published-layout checkpoint (`Qwen3_5MoeForConditionalGeneration`: `text_config` nesting,
  the language model under `model.language_model.` with fused experts, a vision tower, `mtp.*`)
  loads the text model alone with logits equal to transformers';
- a packed row (two sequences and padding) equals its sequences run alone (1e-5);
- the export reloads in transformers with equal logits;
- EP = 2 on 2 x 4 (experts split over the expert axis, ZeRO-3 over the rest) trains 3 steps as
  the unsharded model on one device does, the auxiliary loss weighed in (slow);
- the Hybrid Engine's static path and its continuous batching (the DeltaNet state in
  per-sequence slots beside the pages) decode transformers' greedy tokens from prompts of
  different lengths, tp 1 (slow); a paged cache without slots is refused by name, and
  config.json options not built are refused by key.
"""

import functools

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
                                assert_zero3_logits_and_loss_equal_transformers, save_random,
                                token_ids, torch_causal_lm)
from zeroxla import models
from zeroxla.models import hf
from zeroxla.models.moe import aux_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 67
EXPERTS = 8
# A period of 3 (transformers' default is 4): shorter to compile, still several DeltaNet layers.
TEXT = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=64, rms_norm_eps=1e-5, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, num_experts=EXPERTS,
            num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A `Qwen3_5MoeForCausalLM` (model_type qwen3_5_moe_text) checkpoint, every tensor
    perturbed, its experts saved one tensor per expert (transformers' `save_pretrained`)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3_5MoeTextConfig(**TEXT))
    return save_random(model, tmp_path_factory.mktemp("qwen3_5_moe"))


def fuse_experts(path, prefix="model."):
    """Rewrites `path`'s safetensors with every layer's per-expert tensors fused as transformers
    holds them in memory (`experts.gate_up_proj` [E, 2F, D], gate rows first; `down_proj`
    [E, D, F]); `prefix`: where the layers are."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for i in range(TEXT["num_hidden_layers"]):
        experts = f"{prefix}layers.{i}.mlp.experts."
        parts = {p: np.stack([tensors.pop(f"{experts}{e}.{p}.weight") for e in range(EXPERTS)])
                 for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[experts + "gate_up_proj"] = np.concatenate([parts["gate_proj"],
                                                            parts["up_proj"]], axis=1)
        tensors[experts + "down_proj"] = parts["down_proj"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.mark.slow
def test_zero3_logits_and_loss_equal_transformers_on_2x4(checkpoint):
    assert_zero3_logits_and_loss_equal_transformers(checkpoint, "qwen3_5_moe", 1, VOCAB, ATOL)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_aux_loss_equals_transformers(checkpoint, tmp_path, layout):
    """E x sum_e f_e P_e over all 3 layers' routers (transformers' `load_balancing_loss_func`
    of its router logits) from our `RouterStats`; the fused layout read through the loader's
    name fallbacks gives the same model."""
    import shutil

    path = checkpoint
    if layout == "fused":
        path = shutil.copytree(checkpoint, tmp_path / "fused")
        assert "model.layers.0.mlp.experts.gate_up_proj" in fuse_experts(path)
    config, model = hf.load_hf_model(path)
    assert config.norm_topk_prob and config.shared_expert_mlp_dim == 40
    x = token_ids(VOCAB, (2, 17), seed=2)
    with torch.no_grad():
        out = torch_causal_lm(checkpoint)(torch.tensor(x, dtype=torch.long),
                                          output_router_logits=True)
    logp, stats = model.routed_token_logprobs(x, x)
    assert float(stats.rows) == TEXT["num_hidden_layers"] * x.size   # every token, every layer
    np.testing.assert_allclose(float(aux_loss(stats)), float(out.aux_loss), rtol=0, atol=1e-5)
    theirs = torch.log_softmax(out.logits, -1).gather(-1, torch.tensor(x, dtype=torch.long)[
        ..., None])[..., 0].numpy()
    np.testing.assert_allclose(np.asarray(logp), theirs, atol=ATOL, rtol=0)


def test_a_published_layout_checkpoint_loads_its_text_model(tmp_path):
    """`Qwen3_5MoeForConditionalGeneration` as the hub's checkpoints are: config.json nests the
    text model under text_config, the tensors are under model.language_model. (the experts
    fused here, as transformers holds them), beside model.visual.* and mtp.* (added here),
    which are never read."""
    from safetensors.numpy import save_file

    torch.manual_seed(1)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                  out_hidden_size=48, num_position_embeddings=16)
    reference = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
        text_config=TEXT, vision_config=vision))
    save_random(reference, tmp_path)
    tensors = fuse_experts(tmp_path, prefix="model.language_model.")
    assert any(n.startswith("model.visual.") for n in tensors)
    tensors["mtp.fc.weight"] = np.ones((48, 96), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config, model = hf.load_hf_model(tmp_path)
    assert config.family == "qwen3_5_moe" and config.num_experts == EXPERTS
    x = token_ids(VOCAB, (2, 16), seed=1)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(x)), theirs, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_a_packed_row_equals_its_sequences_run_alone(checkpoint):
    _, model = hf.load_hf_model(checkpoint)
    assert_packed_row_equals_its_sequences_alone(model, VOCAB, padding=3)


def test_export_reloads_in_transformers_with_equal_logits(checkpoint, tmp_path):
    assert_export_reloads_in_transformers(checkpoint, tmp_path, "qwen3_5_moe_text",
                                          "Qwen3_5MoeForCausalLM", VOCAB, ATOL)


COEF = 0.05
# 8 experts of 16, top-2, a shared expert of 24; one period (2 DeltaNet layers + attention)
EP_CONFIG = models.Qwen3_5MoeConfig(
    vocab_size=64, max_seq_len=32, d_model=32, num_heads=4, num_kv_heads=2,
    explicit_head_dim=16, num_layers=1, attention_interval=3, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
    experts_per_token=2, expert_mlp_dim=16, shared_expert_mlp_dim=24,
    router_aux_loss_coef=COEF, output_router_logits=True, expert_tile=4)


def written_out_loss(model, batch):
    """Next-token cross-entropy over the batch plus COEF x E x sum_e (assignments_e / rows) x
    (mean probability_e) over every layer's router (transformers' load_balancing_loss_func)."""
    logp, stats = model.routed_token_logprobs(batch["inputs"], batch["targets"])
    rows = stats.rows
    aux = EP_CONFIG.num_experts * jnp.sum(stats.counts / rows * stats.prob_sum / rows)
    return -jnp.mean(logp) + COEF * aux


@pytest.mark.slow
def test_expert_parallel_on_2x4_trains_like_one_device():
    """EP = 2 (2 nodes x 2 local x 2 expert): the experts split over the expert axis (4 per
    device) and ZeRO-3-partitioned over the rest, every other leaf over all 8; 3 SGD steps
    against single-device optax on the written-out loss: losses rtol 1e-6 and every leaf atol
    1e-6, as tests/zeroxla/engine/test_expert_parallel.py holds the other MoE families."""
    from reference import flat_params, token_batches, train_single_device
    from runs import run_steps

    batches = token_batches(3, 16, 16, 64, seed=3)
    optimizer = optax.sgd(0.1)
    want_losses, want = train_single_device(
        models.Qwen3_5Moe(EP_CONFIG, rngs=nnx.Rngs(0)), optimizer, batches,
        loss_fn=written_out_loss)
    step = zeroxla.make_step(models.Qwen3_5Moe(EP_CONFIG, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(2, 2, expert=2), optimizer=optimizer,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    w_gate = step.layout.plan["blocks/layers/linear/0/moe/w_gate"]
    assert w_gate.expert_size == 2 and w_gate.shard_shape[0] == 4      # E / EP experts
    state, losses = run_steps(step, step.init(), batches)
    assert want_losses[2] < want_losses[0]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    got = flat_params(nnx.state(step.gathered_model(state), nnx.Param))
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=0, atol=1e-6, err_msg=path)


@pytest.fixture(scope="module")
def greedy_case(checkpoint):
    """The ZeRO-3 load on 2 x 4, prompts of 5 and 9 tokens and transformers' greedy tokens both
    engines below start from, made once (`family_checkpoints.greedy_case`)."""
    return family_checkpoints.greedy_case(checkpoint, VOCAB, lengths=(5, 9))


@pytest.mark.slow
def test_static_greedy_equals_transformers_generate(greedy_case):
    """From ZeRO-3 partitions on 2 x 4 to tp 1, 12 new tokens after prompts of 5 and 9 tokens
    in one batch (both right-padded to the 16-token bucket)."""
    family_checkpoints.assert_engine_greedy_equals_transformers(greedy_case, "static", 1)


@pytest.mark.slow
def test_continuous_greedy_equals_transformers_generate(greedy_case):
    """Under continuous batching (the DeltaNet state in per-sequence slots), tp 1: the same
    12 new tokens after prompts of 5 and 9 tokens as transformers'."""
    family_checkpoints.assert_engine_greedy_equals_transformers(greedy_case, "continuous", 1)


def test_a_paged_cache_without_slots_is_refused_and_continuous_is_built(checkpoint):
    """The model's decode refuses a paged KV cache without recurrent slots naming the family;
    the Hybrid Engine builds batching="continuous" (the slots beside the pages) before it
    compiles."""
    from zeroxla.inference import HybridEngine, HybridEngineConfig
    from zeroxla.models.paged_attention import PagedKV

    config, model = hf.load_hf_model(checkpoint)
    pool = jax.ShapeDtypeStruct((1, 1, 2, 2, 4, 32), jnp.float32)
    pages = PagedKV(pool, pool, jax.ShapeDtypeStruct((1, 2, 1), jnp.int32),
                    jax.ShapeDtypeStruct((), jnp.int32))
    ids = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(NotImplementedError, match="qwen3_5_moe.*paged.*recurrent state"):
        model.decode(ids, ids, pages)
    step = zeroxla.make_step(lambda: models.Qwen3_5Moe(config, rngs=nnx.Rngs(0)),
                             zeroxla.make_mesh(nodes=1, local=8),
                             config=zeroxla.ZeroConfig(stage=3))
    engine = HybridEngine(step.layout, HybridEngineConfig(max_out_tokens=32,
                                                          batching="continuous"))
    assert engine.batching == "continuous"


@pytest.mark.parametrize("change,match", [
    ({"num_experts": None}, "num_experts=None"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size=None"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ({"num_hidden_layers": 6, "layer_types": None}, "num_hidden_layers=6"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_options_not_built_are_refused_by_key(checkpoint, change, match):
    source = hf.read_hf_config(checkpoint)
    edited = {k: v for k, v in {**source, **change}.items() if v is not None}
    for hf_config in (edited, {"model_type": "qwen3_5_moe", "text_config": edited}):
        with pytest.raises(ValueError, match=match):
            hf.from_hf_config(hf_config)



# ---------------------------------------------------------------------------- routing records

K = TEXT["num_experts_per_tok"]


def transformers_choices(reference, tokens):
    """The experts transformers' router picks per token and HF layer: tokens [B, T] -> int
    [B, T, L, k], each k sorted: the k largest of its `router_logits`, every k-th largest at
    least 1e-4 above the next (no near tie float32 could flip)."""
    b, t = tokens.shape
    with torch.no_grad():
        out = reference(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    logits = np.stack([r.numpy().reshape(b, t, -1) for r in out.router_logits], axis=2)
    order = np.argsort(-logits, axis=-1)                                      # [B, T, L, E]
    ranked = np.take_along_axis(logits, order, axis=-1)
    assert np.min(ranked[..., K - 1] - ranked[..., K]) > 1e-4
    return np.sort(order[..., :K], axis=-1)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return torch_causal_lm(checkpoint)


@pytest.mark.slow
def test_routing_records_hold_every_layer_as_transformers_routes(checkpoint, reference):
    """`router_choices` is [L, B, T, k] over every HF layer (2 DeltaNet layers and the
    attention layer of the period): the experts transformers' router picks at every token.
    Replaying that record gives `routed_token_logprobs`' log-probs and router statistics bit
    for bit with 0 mismatches; a record changed at (token, layer) pairs of a DeltaNet layer
    and of the attention layer, only compared (`follow_record=False`), counts each changed
    pair once; replayed, it moves the log-probs."""
    _, model = hf.load_hf_model(checkpoint)
    x = token_ids(VOCAB, (2, 17))
    inputs, labels = jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])
    choices, _ = jax.jit(model.router_choices)(inputs)                       # [L, B, T, k]
    record = np.moveaxis(np.asarray(choices), 0, 2)                          # [B, T, L, k]
    assert record.shape == (2, 16, TEXT["num_hidden_layers"], K)
    np.testing.assert_array_equal(np.sort(record, -1), transformers_choices(reference, x[:, :-1]))

    @functools.partial(jax.jit, static_argnames="follow")
    def replayed(record, follow):
        return model.replayed_token_logprobs(inputs, labels, record, follow_record=follow)

    @jax.jit
    def both(record):     # one program (test_routing_replay.py's): compiled apart, the two
        # forwards differ by float32 round-off the DeltaNet recurrence carries to 6e-5
        return model.routed_token_logprobs(inputs, labels), replayed(record, True)

    (logp, stats), (got, got_stats, mismatches) = both(jnp.asarray(record))
    np.testing.assert_array_equal(got, logp)
    for a, b in zip(got_stats, stats):
        np.testing.assert_array_equal(a, b)
    assert int(jnp.sum(mismatches)) == 0
    family_checkpoints.assert_a_changed_record_is_counted_and_replayed(
        replayed, record, logp, [(0, 3, 1), (1, 9, 1), (1, 9, 2), (0, 15, 2)], EXPERTS)


@pytest.fixture(scope="module")
def ep2_partitions(checkpoint):
    """The checkpoint in ZeRO-3 partitions at EP 2, loaded once for every engine below
    (`family_checkpoints.expert_parallel_partitions`)."""
    return family_checkpoints.expert_parallel_partitions(checkpoint)


@pytest.fixture(scope="module")
def live_choices(ep2_partitions):
    return family_checkpoints.live_router_choices(ep2_partitions)


@pytest.mark.slow
@pytest.mark.parametrize("batching,tp", [("static", 1), ("continuous", 1),
                                         ("static", 2), ("continuous", 2)])
def test_the_rollout_records_every_layers_experts_as_transformers_routes(
        ep2_partitions, live_choices, reference, batching, tp):
    """From ZeRO-3 partitions at EP 2 (2 x 2, expert 2) to tp 1 and 2, static (a right-padded
    prefill: the DeltaNet state skips the pads) and continuous batching (pages of 4 slots, the
    DeltaNet state in slots): sampled answers of prompts of 3, 7 and 11 tokens. Each output's
    record [len, L, k] holds at every fed token and HF layer the experts transformers' router
    picks over the output (and the training forward's `router_choices`), -1 on the last token;
    asking for it changes no token."""
    family_checkpoints.assert_engine_records_the_routing(
        ep2_partitions, VOCAB, batching, tp, TEXT["num_hidden_layers"], K,
        lambda tokens: transformers_choices(reference, tokens), live_choices=live_choices)
