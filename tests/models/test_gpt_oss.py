"""gpt-oss (`models.gpt_oss`, `models.families.gpt_oss`, `models.mxfp4`) against transformers
itself, from a tiny random checkpoint transformers writes here (4 layers: sliding (window 4)
and full alternating; YaRN RoPE; attention sinks, q/k/v/o biases, a router bias and expert
biases, the SwiGLU clamp at 0.5 so that it bites; every tensor perturbed, no network):

- loaded straight into ZeRO-3 partitions on 2 x 4: logits within 1e-4 of transformers'
  `GptOssForCausalLM` (float32) on sequences longer than the window, the loss equal to its
  `labels=` loss (rtol 1e-5);
- a packed row (two sequences and padding) equals its sequences run alone (1e-5);
- the export reloads in transformers with equal logits; every config.json option not built is
  refused by its key; the defaults are transformers' `GptOssConfig`'s;
- MXFP4: tensors written by a numpy encoder of the format decode bit for bit to a float64
  decode of the E2M1 bits (every byte, scales 0..252), and a checkpoint whose experts are
  stored so loads them as transformers dequantizes them, its logits within 1e-4 of
  transformers', straight into ZeRO-3 partitions too;
- routing records per MoE layer ([.., 2L, k], two per pair): `router_choices` equals
  transformers' router's top-k at every token and layer, replaying it is the live forward bit
  for bit, a changed record's mismatches are counted per (token, layer);
- slow: the rollout engine's record (static and continuous, tp 1 and 2, EP 2 storage) equals
  transformers' router over each sampled output; the replayed MoE MLP's gradients equal a
  float64 dense reference; the Hybrid Engine's greedy tokens equal transformers'
  `generate(do_sample=False)` past the window at tp 1 and 2; ZeRO-3 2 x 4 on packed rows,
  expert parallelism (EP = 2), sequence parallelism (SP = 2: Ulysses, ring, all-gather) and
  LoRA train 3 steps as the unsharded model does on one device; USP refuses the sinks by name.
"""

import functools
import json
import shutil

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
                                assert_zero3_logits_and_loss_equal_transformers,
                                packed_row, save_random, token_ids, torch_causal_lm)
from zeroxla import models
from zeroxla.models import hf, mxfp4

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 67
ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 1000.0}
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
              swiglu_limit=0.5, rope_parameters=ROPE, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A `GptOssForCausalLM` checkpoint, every tensor perturbed."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG))
    return save_random(model, tmp_path_factory.mktemp("gpt_oss"))


def test_zero3_logits_and_loss_equal_transformers_on_2x4(checkpoint):
    assert_zero3_logits_and_loss_equal_transformers(checkpoint, "gpt_oss", 2, VOCAB, ATOL)


def test_a_packed_row_equals_its_sequences_run_alone(checkpoint):
    _, model = hf.load_hf_model(checkpoint)
    assert_packed_row_equals_its_sequences_alone(model, VOCAB, padding=4)


def test_export_reloads_in_transformers_with_equal_logits(checkpoint, tmp_path):
    assert_export_reloads_in_transformers(checkpoint, tmp_path, "gpt_oss", "GptOssForCausalLM",
                                          VOCAB, ATOL)


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"num_hidden_layers": 3, "layer_types": None}, "num_hidden_layers=3"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method='fp8'"),
    ({"rope_parameters": {**ROPE, "rope_type": "dynamic"}},
     "rope_parameters.rope_type='dynamic'"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
])
def test_options_not_built_are_refused_by_key(checkpoint, change, match):
    source = hf.read_hf_config(checkpoint)
    edited = {k: v for k, v in {**source, **change}.items() if v is not None}
    if change.get("sliding_window", 0) is None:
        edited["sliding_window"] = None
    with pytest.raises(ValueError, match=match):
        hf.from_hf_config(edited)


def test_defaults_and_parameter_count_equal_transformers(checkpoint):
    """A config.json of transformers' defaults (gpt-oss-20b's shape: YaRN factor 32 from
    4096 positions, theta 150000, window 128, alpha 1.702, limit 7) reads as transformers
    reads it, and the checkpoint's model holds as many parameters as transformers'."""
    defaults = transformers.GptOssConfig().to_dict()
    config = hf.from_hf_config({k: v for k, v in defaults.items() if k != "rope_parameters"})
    assert config == hf.from_hf_config(defaults)
    assert (config.rope_type, config.rope_factor, config.rope_theta) == ("yarn", 32.0, 150000.0)
    assert (config.rope_original_max_len, config.rope_truncate) == (4096, False)
    assert (config.sliding_window, config.num_layers, config.num_experts) == (128, 18, 128)
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    tiny = hf.from_hf_config(hf.read_hf_config(checkpoint))
    ours = sum(np.size(v) for v in hf.param_dict(models.GptOss(tiny, rngs=nnx.Rngs(0))).values())
    assert ours == sum(p.numel() for p in torch_causal_lm(checkpoint).parameters())


# ------------------------------------------------------------------------------------- MXFP4

def encode_mxfp4(w):
    """A numpy encoder of the format (OCP MX v1.0): w [E, in, out] -> (blocks uint8
    [E, out, in / 32, 16], scales uint8 [E, out, in / 32]): each group of 32 along `in` scaled
    by the smallest power of two that brings its largest magnitude within 6, each element
    rounded to the nearest E2M1 value, element 2j in the low nibble."""
    groups = np.swapaxes(np.asarray(w, np.float64), -1, -2)
    groups = groups.reshape(*groups.shape[:-1], -1, 32)                       # [E, out, G, 32]
    amax = np.abs(groups).max(-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-300) / 6.0)), -127)
    exponent = exponent.astype(np.int64)
    table = np.array([float64_e2m1(code) for code in range(16)])
    codes = np.argmin(np.abs(groups[..., None] / 2.0 ** exponent[..., None, None] - table), -1)
    return ((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8),
            (exponent + 127).astype(np.uint8))


def float64_e2m1(code):
    """The E2M1 value of a 4-bit code from its bits: sign, 2 exponent bits (bias 1), 1
    mantissa bit; exponent 0 is subnormal (m x 0.5)."""
    sign, exponent, mantissa = (code >> 3) & 1, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def float64_decode(blocks, scales):
    """The reference: blocks [E, out, G, 16], scales [E, out, G] -> float64 [E, in, out], each
    element decoded from its bits and multiplied by 2^(scale - 127) in float64."""
    table = np.array([float64_e2m1(code) for code in range(16)])
    values = np.stack([table[blocks & 15], table[blocks >> 4]], axis=-1)     # [.., G, 16, 2]
    values = values.reshape(*blocks.shape[:-1], 32) * 2.0 ** (scales.astype(np.int64)[..., None]
                                                               - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


def test_mxfp4_decode_equals_a_float64_decode_of_the_format_bit_for_bit():
    """Every byte in every nibble position, scales 0..252 (the float32 range: 6 x 2^125), and a
    float tensor through the encoder: float32 bits equal the float64 reference rounded (which
    it is exactly), signed zeros included; a NaN scale and an overflow are refused by name."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 40, 4, 16)).astype(np.uint8)
    blocks[0, 0].flat[:256] = np.arange(256)
    scales = rng.integers(0, 253, size=(3, 40, 4)).astype(np.uint8)
    scales[0, 0, :2] = (0, 252)
    want = float64_decode(blocks, scales)                                    # [3, 128, 40]
    got = mxfp4.decode(blocks, scales, "w")
    assert got.dtype == np.float32 and got.shape == (3, 128, 40)
    assert np.array_equal(want.astype(np.float32).astype(np.float64), want)
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert np.array_equal(mxfp4.decode(blocks, scales, "w", np.float64), want)
    w = rng.normal(size=(2, 64, 24)) * np.exp(rng.normal(size=(2, 1, 24)) * 4)
    encoded = encode_mxfp4(w)
    np.testing.assert_array_equal(mxfp4.decode(*encoded, "w"), float64_decode(*encoded))
    # nearest rounding: within half the widest E2M1 gap (2) times the group's scale
    bound = np.swapaxes(np.repeat(2.0 ** (encoded[1].astype(np.int64) - 127), 32, axis=-1),
                        -1, -2)
    assert np.all(np.abs(float64_decode(*encoded) - w) <= bound)
    with pytest.raises(ValueError, match="down_proj_scales holds 255"):
        mxfp4.decode(blocks, np.full_like(scales, 255), "down_proj")
    with pytest.raises(ValueError, match="gate_up_proj: an MXFP4 value .* overflows float32"):
        mxfp4.decode(np.full_like(blocks, 0x77), np.full_like(scales, 254), "gate_up_proj")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory):
    """The checkpoint with its experts' two weights per layer stored as MXFP4 (`encode_mxfp4`)
    and `quantization_config` {"quant_method": "mxfp4"}, as the released gpt-oss are."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    shutil.copy(checkpoint / "config.json", directory / "config.json")
    tensors = {}
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = encode_mxfp4(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    hf_json = json.loads((directory / "config.json").read_text())
    hf_json["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(hf_json))
    return directory


@pytest.mark.slow
def test_an_mxfp4_checkpoint_loads_its_experts_decoded(mxfp4_checkpoint):
    """The experts equal the float64 decode of their blocks and scales bit for bit (and
    transformers' own dequantized weights), straight into ZeRO-3 partitions on 2 x 4 as well;
    the logits are within 1e-4 of transformers' model of the same checkpoint."""
    from reference import flat_params
    from safetensors.numpy import load_file

    stored = load_file(mxfp4_checkpoint / "model.safetensors")
    config, model = hf.load_hf_model(mxfp4_checkpoint)
    _, state = zeroxla.load_pretrained(mxfp4_checkpoint, zeroxla.make_mesh(nodes=2, local=4),
                                       progress=False,
                                       config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    params, partitioned = hf.param_dict(model), flat_params(zeroxla.gather_params(state))
    reference = torch_causal_lm(mxfp4_checkpoint)
    for i in range(2 * config.num_layers):
        name = f"model.layers.{i}.mlp.experts."
        gate_up = float64_decode(stored[name + "gate_up_proj_blocks"],
                                 stored[name + "gate_up_proj_scales"])        # [E, D, 2F]
        down = float64_decode(stored[name + "down_proj_blocks"], stored[name + "down_proj_scales"])
        ours = f"blocks/layers/{('local', 'glob')[i % 2]}/moe/"
        for path, want in (("w_gate", gate_up[..., ::2]), ("w_up", gate_up[..., 1::2]),
                           ("w_down", down)):
            for got in (params[ours + path], partitioned[ours + path]):
                np.testing.assert_array_equal(np.asarray(got)[i // 2], want, err_msg=path)
        experts = reference.model.layers[i].mlp.experts
        np.testing.assert_array_equal(experts.gate_up_proj.detach().numpy(), gate_up)
        np.testing.assert_array_equal(experts.down_proj.detach().numpy(), down)
    x = token_ids(VOCAB, (2, 17))
    with torch.no_grad():
        theirs = reference(torch.tensor(x, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(x)), theirs, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- routing records

K = CONFIG["num_experts_per_tok"]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return torch_causal_lm(checkpoint)


def transformers_choices(reference, tokens):
    """The experts transformers' router picks, per token and HF layer: tokens [B, T] -> int
    [B, T, 2L, k], each k sorted: the k largest of its `router_logits` (output_router_logits),
    every k-th largest at least 1e-4 above the next (no near tie float32 could flip)."""
    b, t = tokens.shape
    with torch.no_grad():
        out = reference(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    logits = np.stack([r.numpy().reshape(b, t, -1) for r in out.router_logits], axis=2)
    order = np.argsort(-logits, axis=-1)                                      # [B, T, 2L, E]
    ranked = np.take_along_axis(logits, order, axis=-1)
    assert np.min(ranked[..., K - 1] - ranked[..., K]) > 1e-4
    return np.sort(order[..., :K], axis=-1)


def test_routing_records_hold_every_moe_layer_as_transformers_routes(checkpoint, reference):
    """`router_choices` is [2L, B, T, k], one entry per MoE layer (two per pair): at HF layer
    i's index the experts transformers' router picks at every token. Replaying that record
    gives `routed_token_logprobs`' log-probs and router statistics bit for bit with 0
    mismatches; a record changed at (token, layer) pairs of a pair's sliding layer (HF layer
    2) and of a full one (HF layer 1), only compared (`follow_record=False`), counts each
    changed pair once; replayed, it moves the log-probs."""
    _, model = hf.load_hf_model(checkpoint)
    x = token_ids(VOCAB, (2, 17))
    inputs, labels = jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])
    choices, _ = jax.jit(model.router_choices)(inputs)                       # [2L, B, T, k]
    record = np.moveaxis(np.asarray(choices), 0, 2)                          # [B, T, 2L, k]
    assert record.shape == (2, 16, CONFIG["num_hidden_layers"], K)
    np.testing.assert_array_equal(np.sort(record, -1), transformers_choices(reference, x[:, :-1]))

    @functools.partial(jax.jit, static_argnames="follow")
    def replayed(record, follow):
        return model.replayed_token_logprobs(inputs, labels, record, follow_record=follow)

    logp, stats = jax.jit(model.routed_token_logprobs)(inputs, labels)
    got, got_stats, mismatches = replayed(jnp.asarray(record), True)
    np.testing.assert_array_equal(got, logp)
    for a, b in zip(got_stats, stats):
        np.testing.assert_array_equal(a, b)
    assert int(jnp.sum(mismatches)) == 0
    family_checkpoints.assert_a_changed_record_is_counted_and_replayed(
        replayed, record, logp, [(0, 3, 2), (1, 9, 2), (1, 9, 1), (0, 15, 1)],
        CONFIG["num_local_experts"])


MLP_PARAMS = ("router", "b_router", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down")


def dense_replayed_mlp(p, x, chosen, alpha, limit, cotangent):
    """sum(out * cotangent) of gpt-oss' MoE MLP written out in float64, every expert computed
    for every token: the selection `chosen` int [N, k] fixed, its weights the softmax over the
    live router's logits (bias included) at those experts; each expert a clamped SwiGLU with
    biases: (clip(up, -limit, limit) + 1) g sigmoid(alpha g), g = min(gate, limit)."""
    logits = x @ p["router"] + p["b_router"]                                   # [N, E]
    onehot = jax.nn.one_hot(chosen, logits.shape[-1], dtype=x.dtype)          # [N, k, E]
    picked = jnp.einsum("NE,NKE->NK", logits, onehot)
    weights = jnp.exp(picked - picked.max(-1, keepdims=True))
    weights = weights / weights.sum(-1, keepdims=True)
    gate = jnp.minimum(jnp.einsum("ND,EDF->NEF", x, p["w_gate"]) + p["b_gate"], limit)
    up = jnp.clip(jnp.einsum("ND,EDF->NEF", x, p["w_up"]) + p["b_up"], -limit, limit)
    inner = (up + 1) * gate / (1 + jnp.exp(-alpha * gate))
    y = jnp.einsum("NEF,EFD->NED", inner, p["w_down"]) + p["b_down"]         # [N, E, D]
    return jnp.sum(jnp.einsum("NK,NKE,NED->ND", weights, onehot, y) * cotangent)


@pytest.mark.slow
def test_the_replayed_mlp_gradients_equal_a_float64_dense_reference():
    """gpt-oss' MoE MLP sending tokens to a recorded selection (two tokens without a record
    route live): every gradient (router and its bias, experts and their biases, the input)
    within 1e-6 of the largest of `dense_replayed_mlp`'s; the router's is not zero (the
    weights come from the live router); the clamp bites (limit 0.5)."""
    from zeroxla.models.gpt_oss import GptOssMLP

    cfg = models.GptOssConfig(d_model=16, num_heads=4, num_kv_heads=2, num_experts=6,
                              experts_per_token=2, mlp_dim=8, expert_mlp_dim=8, expert_tile=4,
                              swiglu_limit=0.5)
    rng = np.random.default_rng(0)
    n, k, e = 12, cfg.experts_per_token, cfg.num_experts
    with jax.enable_x64(True):
        graphdef, params, rest = nnx.split(GptOssMLP(cfg, rngs=nnx.Rngs(1)), nnx.Param, ...)
        params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5,
                                                    jnp.float64), params)
        p = {name: params[name][...] for name in MLP_PARAMS}
        x = jnp.asarray(rng.normal(size=(2, n // 2, cfg.d_model)), jnp.float64)
        record = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])    # [N, k]
        record[[1, 7]] = -1
        cotangent = jnp.asarray(rng.normal(size=(n, cfg.d_model)), jnp.float64)

        def replayed(params, x):
            out, _, _ = nnx.merge(graphdef, params, rest)(
                x, replay=jnp.asarray(record.reshape(2, n // 2, k), jnp.int32))
            return jnp.sum(out.reshape(n, -1) * cotangent)

        grads, g_x = jax.jit(jax.grad(replayed, argnums=(0, 1)))(params, x)
        logits = np.asarray(x.reshape(n, -1) @ p["router"] + p["b_router"])
        live = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        chosen = np.where(record[:, :1] >= 0, record, live)
        want, want_x = jax.jit(jax.grad(dense_replayed_mlp, argnums=(0, 1)),
                               static_argnums=(3, 4))(p, x.reshape(n, -1), chosen,
                                                      cfg.swiglu_alpha, cfg.swiglu_limit,
                                                      cotangent)
        gate = np.einsum("ND,EDF->NEF", x.reshape(n, -1), p["w_gate"]) + p["b_gate"]
    assert np.mean(np.asarray(gate) > cfg.swiglu_limit) > 0.1
    for name in MLP_PARAMS:
        scale = np.abs(want[name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(grads[name][...], want[name], rtol=0, atol=1e-6 * scale,
                                   err_msg=name)
    np.testing.assert_allclose(g_x.reshape(n, -1), want_x, rtol=0,
                               atol=1e-6 * np.abs(want_x).max())


@pytest.fixture(scope="module")
def ep2_partitions(checkpoint):
    """The checkpoint in ZeRO-3 partitions at EP 2, loaded once for every engine below
    (`family_checkpoints.expert_parallel_partitions`)."""
    return family_checkpoints.expert_parallel_partitions(checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["static", "continuous"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_rollout_records_every_moe_layer_as_transformers_routes(ep2_partitions, reference,
                                                                    batching, tp):
    """From ZeRO-3 partitions at EP 2 (2 x 2, expert 2) to tp 1 and 2, static and continuous
    batching (pages of 4 slots): sampled answers (temperature 1) of prompts of 3, 7 and 11
    tokens, past the sliding window. Each output's record [len, 2L, k] holds at every fed
    token and MoE layer the experts transformers' router picks over the output (-1 on the last
    token, never fed); asking for it changes no token."""
    family_checkpoints.assert_engine_records_the_routing(
        ep2_partitions, VOCAB, batching, tp, CONFIG["num_hidden_layers"], K,
        lambda tokens: transformers_choices(reference, tokens))


# ------------------------------------------------------------------------------- slow paths

@pytest.fixture(scope="module")
def greedy_case(checkpoint):
    return family_checkpoints.greedy_case(checkpoint, VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["static", "continuous"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_engine_greedy_equals_transformers_generate(greedy_case, batching, tp):
    """From ZeRO-3 partitions on 2 x 4 (every leaf partitioned) to tp 1 and 2 (at tp 2 the
    heads, their sinks and biases split over the tensor axis), static and continuous batching
    (pages of 4 slots, sinks and the window in paged attention); 7-token prompts and 12 new
    tokens: past the sliding window of 4."""
    family_checkpoints.assert_engine_greedy_equals_transformers(greedy_case, batching, tp)


def _packed_batch():
    """8 packed rows [8, 16] with their positions, segment ids and a float64 loss mask."""
    rows = [packed_row(VOCAB, 4, seed) for seed in range(0, 16, 2)]
    seq = np.concatenate([r[0] for r in rows])
    seg = np.concatenate([r[2] for r in rows])
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:],
            "positions": np.concatenate([r[1] for r in rows])[:, :-1],
            "segment_ids": seg[:, :-1],
            # a token's target is the next token of its own sequence
            "loss_mask": ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float64)}


TRAINING_OPTIMIZER = optax.sgd(0.01, momentum=0.9)
LORA = dict(dim=4, alpha=8.0, module_name=r"blocks/.*(wq|wv|w_up)$")
# name -> (mesh (nodes, local, expert, sequence), sequence_parallel_strategy, LoRA adapters)
TRAINING = {"zero3-2x4-packed": ((2, 4, 1, 1), "ulysses", False),
            "zero3-ep2-packed": ((2, 2, 2, 1), "ulysses", False),
            "zero3-sp2-ulysses-packed": ((2, 2, 1, 2), "ulysses", False),
            "zero3-sp2-ring-packed": ((2, 2, 1, 2), "ring", False),
            "zero3-sp2-allgather-packed": ((2, 2, 1, 2), "allgather", False),
            "zero3-2x4-lora": ((2, 4, 1, 1), "ulysses", True)}


def _float64_model(checkpoint, lora):
    """The checkpoint's float64 model, with `LORA`'s adapters if `lora`."""
    return family_checkpoints.float64_model(checkpoint, LORA if lora else None)


def _one_device_run(checkpoint, lora):
    """`family_checkpoints.one_device_run` over 3 x `_packed_batch()`."""
    return family_checkpoints.one_device_run(checkpoint, LORA if lora else None,
                                             TRAINING_OPTIMIZER, [_packed_batch()] * 3)


@pytest.fixture(scope="module")
def one_device():
    """`_one_device_run`, once per checkpoint and adapters: every layout without adapters
    compares with one run of it."""
    return functools.cache(_one_device_run)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINING))
def test_zero3_trains_packed_rows_like_the_unsharded_model(checkpoint, one_device, name):
    """3 steps of SGD with momentum on packed rows, every leaf partitioned (with EP = 2 the
    experts and their biases split over the expert axis; with SP = 2 each row's 16 tokens split
    over the sequence axis, the sinks and the sliding window of 4 in Ulysses', the ring's and
    all-gather's attention; with LoRA adapters on wq, wv and the experts' w_up, the base
    frozen), against single-device optax on the same model (`reference.train_single_device`;
    with LoRA the base masked out of its optimizer): losses rtol 1e-5, every leaf rtol 1e-4 +
    atol 1e-6; float64, as tests/models/test_gemma3.py says why. The checkpoint's
    output_router_logits is false: no auxiliary loss, as transformers trains it."""
    from reference import flat_params
    from runs import run_steps
    from zeroxla.lora import LoRAConfig, lora_trainable

    (nodes, local, expert, sequence), strategy, lora = TRAINING[name]
    want, expected, trained = one_device(checkpoint, lora)
    with jax.enable_x64(True):
        step = zeroxla.make_step(
            _float64_model(checkpoint, lora),
            zeroxla.make_mesh(nodes, local, expert=expert, sequence=sequence),
            optimizer=TRAINING_OPTIMIZER,
            config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0, compute_dtype="float64",
                                      sequence_parallel_strategy=strategy),
            trainable=lora_trainable(LoRAConfig(**LORA, only_optimize_lora=True))
            if lora else None)
        state, losses = run_steps(step, step.init(), [_packed_batch()] * 3)
        got = flat_params(zeroxla.gather_params(state))
    assert want[2] < want[1] < want[0]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert not lora or trained == {leaf.path for leaf in step.layout.plan.trainable_leaves}
    assert not lora or any("/moe/w_up/lora_a" in path for path in trained)
    for path in expected:
        assert got[path].dtype == np.float64, path
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.slow
def test_usp_refuses_the_sinks_by_name(checkpoint):
    """USP regroups the heads into Ulysses groups, which the per-head sinks are not cut for:
    the step is refused at its first trace, naming the strategy and the accepted ones."""
    step = zeroxla.make_step(hf.load_hf_model(checkpoint)[1],
                             zeroxla.make_mesh(2, 2, sequence=2), optimizer=TRAINING_OPTIMIZER,
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0,
                                                       sequence_parallel_strategy="usp"))
    batch = {k: v.astype(np.float32) if k == "loss_mask" else v
             for k, v in _packed_batch().items()}
    with pytest.raises(ValueError, match="sinks under sequence_parallel_strategy='usp'.*'ring'"):
        step(step.init(), batch)


@pytest.mark.slow
def test_a_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """`GptOssForSequenceClassification` with one label: the base and `score` as our
    RewardModel, its score at every position equal to transformers' `score(base(x))`."""
    family_checkpoints.assert_sequence_classifier_scores_as_transformers(
        transformers.GptOssConfig(**CONFIG, num_labels=1), tmp_path, token_ids(VOCAB, (2, 16)),
        ATOL)
