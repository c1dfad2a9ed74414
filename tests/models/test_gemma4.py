"""Gemma 4 text (`models.gemma4`, `models.families.gemma4`) against transformers itself, from
tiny random checkpoints transformers writes here (6 layers: two periods of two sliding layers,
window 4, and one global layer with its own head dim 32 (the sliding layers' 16), its own
key-value heads and keys equal to values, proportional RoPE rotating half its head dim; the
final logits soft-capped; every tensor and every `layer_scalar` perturbed, no network), dense
and with the MoE block (4 experts, top 2, beside the dense MLP):

- loaded straight into ZeRO-3 partitions on 2 x 4: logits within 1e-4 of transformers'
  `Gemma4ForCausalLM` (float32) on sequences longer than the window, the loss equal to its
  `labels=` loss (rtol 1e-5);
- a packed row (two sequences and padding) equals its sequences run alone (1e-5);
- ZeRO-3 on 2 x 4 with packed rows, with SP = 2 (Ulysses, ring, all-gather; layers of
  different head dims), with EP = 2 (the MoE block's experts split over the expert axis) and
  with LoRA adapters trains 3 steps as the unsharded model does on one device;
- the Hybrid Engine's greedy tokens equal transformers' `generate`, static and continuous, tp
  1 and 2, with the global layer's own head dim and key-value heads in the KV cache, dense
  and with the MoE block (and a MoE checkpoint whose global layer keeps the sliding layers'
  shape);
- the export reloads in transformers with equal logits, a `text_config`-nested config reads
  as the flat one, and every config.json option not built is refused by its key;
- the MoE block's routing records (slow): `router_choices` equals transformers' router top-k
  at every token and HF layer, replaying it gives the unreplayed log-probs bit for bit, and
  the rollout's record (static and continuous, tp 1 and 2, from EP 2 partitions) equals it at
  every fed token and layer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroxla
import family_checkpoints
from family_checkpoints import (assert_export_reloads_in_transformers,
                                assert_packed_row_equals_its_sequences_alone,
                                assert_zero3_logits_and_loss_equal_transformers, packed_row,
                                save_random, token_ids, torch_causal_lm)
from zeroxla.models import hf
from runs import run_steps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 67
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 5000.0,
                           "partial_rotary_factor": 0.5}}
TEXT = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, max_position_embeddings=64,
            rms_norm_eps=1e-5, sliding_window=4, final_logit_softcapping=3.0,
            hidden_size_per_layer_input=0, rope_parameters=ROPE,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(TEXT, attention_k_eq_v=False, enable_moe_block=True, num_experts=4, top_k_experts=2,
           moe_intermediate_size=24)
CASES = {"dense": TEXT, "moe": MOE}


def _save(keys, directory, seed):
    """A `Gemma4ForCausalLM` checkpoint of `keys`: every parameter perturbed
    (`save_random`), every layer's `layer_scalar` buffer drawn from [0.5, 1.5)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Gemma4TextConfig(**keys))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(torch.rand_like(buffer) + 0.5)
    return save_random(model, directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: _save(keys, tmp_path_factory.mktemp(f"gemma4_{name}"), seed)
            for seed, (name, keys) in enumerate(CASES.items())}


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero3_logits_and_loss_equal_transformers_on_2x4(checkpoints, case):
    assert_zero3_logits_and_loss_equal_transformers(checkpoints[case], "gemma4", 2, VOCAB, ATOL)


def test_the_checkpoints_have_what_the_test_means(checkpoints):
    """The global layer's own head dim and key-value heads, k = v, partial RoPE and the MoE
    block reach our configs (so the logits above hold them to transformers')."""
    dense = hf.from_hf_config(hf.read_hf_config(checkpoints["dense"]))
    assert (dense.head_dim, dense.global_head_dim, dense.global_kv_heads) == (16, 32, 1)
    assert dense.attention_k_eq_v and dense.rope_partial == 0.5 and dense.num_experts == 0
    moe = hf.from_hf_config(hf.read_hf_config(checkpoints["moe"]))
    assert (moe.num_experts, moe.experts_per_token, moe.expert_mlp_dim) == (4, 2, 24)
    assert not moe.attention_k_eq_v and moe.global_kv_heads == 2


def test_a_packed_row_equals_its_sequences_run_alone(checkpoints):
    _, model = hf.load_hf_model(checkpoints["dense"])
    assert_packed_row_equals_its_sequences_alone(model, VOCAB, padding=4)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "moe" else c
                                  for c in sorted(CASES)])
def test_export_reloads_in_transformers_with_equal_logits(checkpoints, case, tmp_path):
    assert_export_reloads_in_transformers(checkpoints[case], tmp_path, "gemma4_text",
                                          "Gemma4ForCausalLM", VOCAB, ATOL)


def _packed_batches():
    """3 x 8 packed rows [8, 16] with their positions, segment ids and loss mask (float64)."""
    rows = [packed_row(VOCAB, 4, seed) for seed in range(0, 16, 2)]
    seq = np.concatenate([r[0] for r in rows])
    seg = np.concatenate([r[2] for r in rows])
    batch = {"inputs": seq[:, :-1], "targets": seq[:, 1:],
             "positions": np.concatenate([r[1] for r in rows])[:, :-1],
             "segment_ids": seg[:, :-1],
             # a token's target is the next token of its own sequence
             "loss_mask": ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float64)}
    return [batch] * 3


TRAINING_OPTIMIZER = optax.sgd(0.01, momentum=0.9)
LORA = dict(dim=4, alpha=8.0, module_name=r"blocks/.*(wq|wv|w_up)$")
# name -> (checkpoint, mesh (nodes, local, expert, sequence), sequence_parallel_strategy, LoRA)
TRAINING = {"dense-zero3-2x4-packed": ("dense", (2, 4, 1, 1), "ulysses", False),
            "moe-zero3-2x4-packed": ("moe", (2, 4, 1, 1), "ulysses", False),
            "dense-zero3-sp2-ulysses-packed": ("dense", (2, 2, 1, 2), "ulysses", False),
            "dense-zero3-sp2-ring-packed": ("dense", (2, 2, 1, 2), "ring", False),
            "dense-zero3-sp2-allgather-packed": ("dense", (2, 2, 1, 2), "allgather", False),
            "moe-zero3-sp2-ulysses-packed": ("moe", (2, 2, 1, 2), "ulysses", False),
            "moe-zero3-ep2-packed": ("moe", (2, 2, 2, 1), "ulysses", False),
            "dense-zero3-2x4-lora": ("dense", (2, 4, 1, 1), "ulysses", True),
            "moe-zero3-2x4-lora": ("moe", (2, 4, 1, 1), "ulysses", True)}


def _one_device_run(checkpoint, lora):
    """`family_checkpoints.one_device_run` over `_packed_batches()`."""
    return family_checkpoints.one_device_run(checkpoint, LORA if lora else None,
                                             TRAINING_OPTIMIZER, _packed_batches())


@pytest.fixture(scope="module")
def one_device():
    """`_one_device_run`, once per checkpoint and adapters: the layouts without adapters
    compare with one run of it."""
    import functools

    return functools.cache(_one_device_run)


# slow, every case: a case costs 10-22 worker-seconds (a float64 MoE reference and a 2 x 4
# compile), and the daily tier holds Gemma 4's logits on ZeRO-3 2 x 4 (dense and MoE) and the
# expert-parallel FFN itself (tests/zeroxla/engine/test_expert_parallel.py)
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINING))
def test_zero3_trains_packed_rows_like_the_unsharded_model(checkpoints, one_device, name):
    """3 steps of SGD with momentum on packed rows, every leaf partitioned (with SP = 2 each
    row's 16 tokens split over the sequence axis, the sliding window of 4 and both layers'
    head dims in Ulysses', the ring's and all-gather's attention; with EP = 2 the experts
    split over the expert axis; with LoRA adapters on wq, wv and the dense and expert w_up,
    the base frozen), against single-device optax on the same float64 model
    (`reference.train_single_device`; with LoRA the base masked out of its optimizer): losses
    rtol 1e-5, every leaf rtol 1e-4 + atol 1e-6 (tests/models/test_gemma3.py says why
    float64)."""
    from reference import flat_params
    from zeroxla.lora import LoRAConfig, lora_trainable

    case, (nodes, local, expert, sequence), strategy, lora = TRAINING[name]
    want, expected, trained = one_device(checkpoints[case], lora)
    with jax.enable_x64(True):
        step = zeroxla.make_step(
            family_checkpoints.float64_model(checkpoints[case], LORA if lora else None),
            zeroxla.make_mesh(nodes, local, expert=expert, sequence=sequence),
            optimizer=TRAINING_OPTIMIZER,
            config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0, compute_dtype="float64",
                                      sequence_parallel_strategy=strategy),
            trainable=lora_trainable(LoRAConfig(**LORA, only_optimize_lora=True))
            if lora else None)
        assert expert == 1 or any(leaf.expert_split for leaf in step.layout.plan.leaves)
        state, losses = run_steps(step, step.init(), _packed_batches())
        got = flat_params(zeroxla.gather_params(state))
    assert want[2] < want[1] < want[0]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert not lora or trained == {leaf.path for leaf in step.layout.plan.trainable_leaves}
    assert not lora or case == "dense" or any("/moe/w_up/lora_a" in p for p in trained)
    for path in expected:
        assert got[path].dtype == np.float64, path
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)


def test_a_config_nested_under_text_config_reads_as_the_flat_one(checkpoints):
    """`Gemma4ForConditionalGeneration`'s config.json nests the text model under
    text_config; transformers' older spelling of the global layer's shape
    (`global_head_dim`, `num_global_key_value_heads`) reads as `per_layer_config` does."""
    flat = hf.read_hf_config(checkpoints["dense"])
    want = hf.from_hf_config(flat)
    assert hf.from_hf_config({"model_type": "gemma4", "text_config": flat}) == want
    older = {k: v for k, v in flat.items() if k != "per_layer_config"}
    older.update(global_head_dim=32, num_global_key_value_heads=1)
    assert hf.from_hf_config(older) == want


@pytest.mark.parametrize("change,match", [
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input=256"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers=2"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]},
     "layer_types"),
    ({"num_hidden_layers": 5, "layer_types": None, "per_layer_config": None},
     "layer_types"),
    ({"per_layer_config": {"2": {"head_dim": 32}, "5": {"head_dim": 64}}}, "per_layer_config"),
    ({"per_layer_config": {"2": {"head_dim": 32, "sliding_window": 8},
                           "5": {"head_dim": 32, "sliding_window": 8}}}, "per_layer_config"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "yarn", "factor": 4.0}}},
     "rope_parameters.full_attention.rope_type='yarn'"),
    ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": None},
     "top_k_experts=None"),
])
def test_options_not_built_are_refused_by_key(checkpoints, change, match):
    source = hf.read_hf_config(checkpoints["dense"])
    edited = {k: v for k, v in {**source, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config(edited)
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config({"model_type": "gemma4", "text_config": edited})


@pytest.fixture(scope="module")
def mixed_shapes_greedy(checkpoints):
    """`greedy_case` of the dense checkpoint: its global layer's head dim 32 and 1 key-value
    head, the sliding layers' 16 and 2, in one KV cache (`models.kv_groups`)."""
    return family_checkpoints.greedy_case(checkpoints["dense"], VOCAB)


@pytest.mark.parametrize("batching,tp", [
    ("continuous", 2), pytest.param("static", 1, marks=pytest.mark.slow),
    pytest.param("continuous", 1, marks=pytest.mark.slow),
    pytest.param("static", 2, marks=pytest.mark.slow)])
def test_hybrid_engine_greedy_with_layers_of_different_shapes(mixed_shapes_greedy, batching,
                                                              tp):
    """Layers of different key-value shapes in one period (global head dim 32 and 1 key-value
    head, sliding 16 and 2; keys equal to values): from ZeRO-3 partitions on 2 x 4 the Hybrid
    Engine's greedy tokens (pages of 4 slots; tp 2 replicates the global layer's one head)
    equal transformers' `generate(do_sample=False)`, 7-token prompts and 12 new tokens, past
    the sliding window of 4."""
    family_checkpoints.assert_engine_greedy_equals_transformers(mixed_shapes_greedy, batching,
                                                                tp)


@pytest.fixture(scope="module")
def moe_mixed_shapes_greedy(checkpoints):
    """`greedy_case` of the MoE checkpoint: its global layer's head dim 32 and the sliding
    layers' 16, 2 key-value heads each (k = v off: the global layer has its value projection),
    in one KV cache (`models.kv_groups`)."""
    return family_checkpoints.greedy_case(checkpoints["moe"], VOCAB)


# slow, all four: the dense mixed-shape test above is the engines' daily representative
@pytest.mark.slow
@pytest.mark.parametrize("batching,tp", [("continuous", 2), ("static", 1), ("continuous", 1),
                                         ("static", 2)])
def test_hybrid_engine_greedy_with_the_moe_block_and_layers_of_different_shapes(
        moe_mixed_shapes_greedy, batching, tp):
    """The MoE block (4 experts, top 2, beside the dense MLP) in layers of different key-value
    shapes (global head dim 32, sliding 16): from ZeRO-3 partitions on 2 x 4 the Hybrid
    Engine's greedy tokens (pages of 4 slots) equal transformers' `generate(do_sample=False)`,
    7-token prompts and 12 new tokens, past the sliding window of 4."""
    family_checkpoints.assert_engine_greedy_equals_transformers(moe_mixed_shapes_greedy,
                                                                batching, tp)


@pytest.fixture(scope="module")
def one_shape_greedy(tmp_path_factory):
    """`greedy_case` of a MoE checkpoint whose global layer keeps the sliding layers' head dim
    and key-value heads (seed 5), saved and loaded once for both batchings below."""
    keys = dict(MOE, global_head_dim=16, num_global_key_value_heads=2, attention_k_eq_v=True)
    checkpoint = _save(keys, tmp_path_factory.mktemp("gemma4_one_shape"), seed=5)
    return family_checkpoints.greedy_case(checkpoint, VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("batching", [pytest.param("static", marks=pytest.mark.slow),
                                      "continuous"])
def test_hybrid_engine_greedy_equals_transformers_generate(one_shape_greedy, batching):
    """A checkpoint whose global layer keeps the sliding layers' head dim and key-value heads
    (the KV cache's one layer shape; keys equal to values, proportional RoPE, the MoE block):
    from ZeRO-3 partitions on 2 x 4 the Hybrid Engine's greedy tokens (tp 1, pages of 4 slots)
    equal transformers' `generate(do_sample=False)`, 7-token prompts and 12 new tokens, past
    the sliding window of 4."""
    family_checkpoints.assert_engine_greedy_equals_transformers(one_shape_greedy, batching)


# ---------------------------------------------------------------------------- routing records

K, EXPERTS, HF_LAYERS = MOE["top_k_experts"], MOE["num_experts"], MOE["num_hidden_layers"]


def transformers_choices(reference, tokens):
    """The experts transformers' router (`Gemma4TextRouter`, read by a forward hook: its
    probabilities) picks per token and HF layer: tokens [B, T] -> int [B, T, L, k], each k
    sorted: the k most probable, every k-th at least 2e-6 above the next in log-probability
    (the tiny checkpoint's router is near uniform, its gaps from 4e-5; ours and transformers'
    router log-probabilities differ by at most 3.6e-7 here, so no such gap can flip)."""
    b, t = tokens.shape
    probs, hooks = [], [layer.router.register_forward_hook(
        lambda module, args, out: probs.append(out[0].detach().numpy()))
        for layer in reference.model.layers]
    try:
        with torch.no_grad():
            reference(torch.tensor(tokens, dtype=torch.long))
    finally:
        for hook in hooks:
            hook.remove()
    logp = np.log(np.stack([p.reshape(b, t, -1) for p in probs], axis=2))     # [B, T, L, E]
    order = np.argsort(-logp, axis=-1)
    ranked = np.take_along_axis(logp, order, axis=-1)
    assert logp.shape[2] == HF_LAYERS and np.min(ranked[..., K - 1] - ranked[..., K]) > 2e-6
    return np.sort(order[..., :K], axis=-1)


@pytest.fixture(scope="module")
def moe_reference(checkpoints):
    return torch_causal_lm(checkpoints["moe"])


@pytest.mark.slow
def test_routing_records_hold_every_layer_as_transformers_routes(checkpoints, moe_reference):
    """`router_choices` is [L, B, T, k] over every HF layer (the sliding layers and the global
    one of both periods, their KV shapes apart): the experts transformers' scaled router picks
    at every token. Replaying that record gives `token_logprobs`' log-probs bit for bit with 0
    mismatches; a record changed at (token, layer) pairs of a sliding and of a global layer,
    only compared (`follow_record=False`), counts each changed pair once; replayed, it moves
    the log-probs."""
    _, model = hf.load_hf_model(checkpoints["moe"])
    x = token_ids(VOCAB, (2, 17))
    inputs, labels = jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])
    choices, _ = jax.jit(model.router_choices)(inputs)                       # [L, B, T, k]
    record = np.moveaxis(np.asarray(choices), 0, 2)                          # [B, T, L, k]
    assert record.shape == (2, 16, HF_LAYERS, K)
    np.testing.assert_array_equal(np.sort(record, -1),
                                  transformers_choices(moe_reference, x[:, :-1]))

    @functools.partial(jax.jit, static_argnames="follow")
    def replayed(record, follow):
        return model.replayed_token_logprobs(inputs, labels, record, follow_record=follow)

    @jax.jit
    def both(record):                        # one program, as test_routing_replay.py's
        return model.token_logprobs(inputs, labels), replayed(record, True)

    logp, (got, stats, mismatches) = both(jnp.asarray(record))
    np.testing.assert_array_equal(got, logp)
    assert stats is None and int(jnp.sum(mismatches)) == 0
    family_checkpoints.assert_a_changed_record_is_counted_and_replayed(
        replayed, record, logp, [(0, 3, 1), (1, 9, 1), (1, 9, 2), (0, 15, 5)], EXPERTS)


@pytest.fixture(scope="module")
def moe_partitions(checkpoints):
    """The MoE checkpoint in ZeRO-3 partitions at EP 2, loaded once for every engine below
    (`family_checkpoints.expert_parallel_partitions`)."""
    return family_checkpoints.expert_parallel_partitions(checkpoints["moe"])


@pytest.fixture(scope="module")
def moe_live_choices(moe_partitions):
    return family_checkpoints.live_router_choices(moe_partitions)


@pytest.mark.slow
@pytest.mark.parametrize("batching,tp", [("static", 1), ("continuous", 1),
                                         ("static", 2), ("continuous", 2)])
def test_the_rollout_records_every_layers_experts_as_transformers_routes(
        moe_partitions, moe_live_choices, moe_reference, batching, tp):
    """From ZeRO-3 partitions at EP 2 (2 x 2, expert 2) to tp 1 and 2, static and continuous
    batching (pages of 4 slots; the global layer's head dim 32 beside the sliding layers' 16
    in one cache): sampled answers of prompts of 3, 7 and 11 tokens. Each output's record
    [len, L, k] holds at every fed token and HF layer the experts transformers' router picks
    over the output (and the training forward's `router_choices`), -1 on the last token;
    asking for it changes no token."""
    family_checkpoints.assert_engine_records_the_routing(
        moe_partitions, VOCAB, batching, tp, HF_LAYERS, K,
        lambda tokens: transformers_choices(moe_reference, tokens), live_choices=moe_live_choices)
