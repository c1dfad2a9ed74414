"""LoRA (`zeroxla.lora`) on our Llama (stacked layers, einsum weights) and on a user's model of
plain `nnx.Linear`s.

References: the base model's own logits (step 0, exact), W + (alpha / r) A @ B in float64 numpy
(the fused weights), and single-device optax training of the same LoRA model with the frozen
base masked (`optax.multi_transform`, the trainable leaves chosen by nnx's `nnx.LoRAParam`
filter, not by the engine); with int8 frozen storage the reference starts from the base
dequantized here in float64 numpy from the codes and steps the step stored.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import flat_params, masked_optimizer, token_batches, train_single_device
from runs import run_steps
from zeroxla.lora import (LoRAConfig, LoRAWeight, convert_linear_layer_to_lora, fuse_lora_weight,
                          lora_parameter_count, lora_trainable)
from zeroxla.models.llama import Llama, LlamaConfig

VOCAB, D, HIDDEN, RANK = 64, 256, 512, 8
STEPS, BATCH, SEQ = 4, 16, 8
THRESHOLD = 3000   # up/kernel/lora_a [256, 8] stays replicated, lora_b [8, 512] is partitioned
USER_LORA = LoRAConfig(dim=RANK, alpha=16.0, module_name=r"^(up|down)/",
                       only_optimize_lora=True)
LLAMA_LORA = LoRAConfig(dim=4, alpha=8.0, module_name=r"blocks/layers/(wq|wv|wo|w_up|w_down)",
                        only_optimize_lora=True)


class UserMLP(nnx.Module):
    """A user's model: nnx.Embed and nnx.Linear layers, no logical axis names."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.up = nnx.Linear(D, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:                # [B, T] -> [B, T, V]
        x = self.embed(tokens)
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


def _user_model(lora=True):
    model = UserMLP(nnx.Rngs(0))
    if lora:
        convert_linear_layer_to_lora(model, USER_LORA, rngs=nnx.Rngs(7))
    return model


def _llama(lora=True):
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    if lora:
        convert_linear_layer_to_lora(model, LLAMA_LORA, rngs=nnx.Rngs(7))
    return model


MODELS = {"user": (_user_model, USER_LORA, VOCAB), "llama": (_llama, LLAMA_LORA, 65)}


def _tokens(vocab):
    return jnp.asarray(np.random.default_rng(3).integers(0, vocab, (2, 8)), jnp.int32)


# ---------------------------------------------------------------------------------------------
# The transformation

@pytest.mark.parametrize("name", ["user", "llama"])
def test_step_zero_logits_equal_the_base_models_exactly(name):
    build, config, vocab = MODELS[name]
    base, adapted = build(lora=False), build()
    tokens = _tokens(vocab)
    np.testing.assert_array_equal(np.asarray(adapted(tokens)), np.asarray(base(tokens)))
    # The base weights are the model's, now at '<path>/base'; the adapters are all LoRAParams.
    base_params = flat_params(nnx.state(base, nnx.Param))
    adapted_params = flat_params(nnx.state(adapted, nnx.Param))
    lora = flat_params(nnx.state(adapted, nnx.LoRAParam))
    for path, value in base_params.items():
        where = path + "/base" if path + "/base" in adapted_params else path
        np.testing.assert_array_equal(adapted_params[where], value)
    assert {p.removesuffix("/base") for p in adapted_params if "/lora_" not in p} == set(
        base_params)
    assert all(np.all(v == 0) for p, v in lora.items() if p.endswith("lora_b"))
    assert lora_parameter_count(adapted) == sum(v.size for v in lora.values())


def test_adapter_shapes_and_scaling_on_stacked_layers():
    model = _llama()
    cfg = LlamaConfig.tiny()
    L, Dm, H, K, F, r = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, 4
    wq, wo, down = model.blocks.layers.wq, model.blocks.layers.wo, model.blocks.layers.w_down
    assert isinstance(model.blocks.layers.wk, nnx.Param)                 # not matched
    assert wq.lora_a.shape == (L, Dm, r) and wq.lora_b.shape == (L, r, H, K)
    assert wo.lora_a.shape == (L, H, K, r) and wo.lora_b.shape == (L, r, Dm)
    assert down.lora_a.shape == (L, F, r) and down.lora_b.shape == (L, r, Dm)
    # A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in the input dims' size.
    assert 0.5 / np.sqrt(H * K) < float(jnp.abs(wo.lora_a[...]).max()) <= 1 / np.sqrt(H * K)
    # Fused weights, given nonzero B: W + (alpha / r) A @ B per layer, in float64 numpy.
    rng = np.random.default_rng(0)
    for w in (wq, wo, down):
        w.lora_b[...] = jnp.asarray(rng.normal(size=w.lora_b.shape), jnp.float32)
    fused = fuse_lora_weight(model)
    assert isinstance(model.blocks.layers.wq, LoRAWeight)               # the original keeps them
    for name, w in (("wq", wq), ("wo", wo), ("w_down", down)):
        a = np.asarray(w.lora_a[...], np.float64)
        b = np.asarray(w.lora_b[...], np.float64)
        a = a.reshape(L, -1, r)
        expected = np.asarray(w.base[...], np.float64) + (8.0 / 4) * (
            a @ b.reshape(L, r, -1)).reshape(w.base.shape)
        got = getattr(fused.blocks.layers, name)
        assert isinstance(got, nnx.Param)
        np.testing.assert_allclose(np.asarray(got[...]), expected, rtol=1e-5, atol=1e-6)
    tokens = _tokens(65)
    np.testing.assert_allclose(fused(tokens), model(tokens), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="LoRAConfig.dim"):
        LoRAConfig(dim=-1)
    with pytest.raises(ValueError, match="only_optimize_lora"):
        LoRAConfig(only_optimize_lora=True)
    # A pattern or a scaling without adapters would be ignored: every weight would train.
    with pytest.raises(ValueError, match=r"^LoRAConfig\.module_name='wq' needs dim > 0 .*full "
                                         r"fine-tune"):
        LoRAConfig(module_name="wq")
    with pytest.raises(ValueError, match=r"^LoRAConfig\.alpha=16\.0 needs dim > 0"):
        LoRAConfig(alpha=16.0)
    with pytest.raises(ValueError, match="not a regular expression"):
        LoRAConfig(dim=2, module_name="(")
    with pytest.raises(ValueError, match="matches none .*up/kernel"):
        convert_linear_layer_to_lora(_user_model(False), LoRAConfig(dim=2, module_name="nope"),
                                     rngs=nnx.Rngs(0))
    model = _user_model(False)
    model.head.kernel = model.up.kernel                                  # a tied weight
    with pytest.raises(ValueError, match="shared weights"):
        convert_linear_layer_to_lora(model, LoRAConfig(dim=2, module_name="up/kernel"),
                                     rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        convert_linear_layer_to_lora(_user_model(), USER_LORA, rngs=nnx.Rngs(0))
    assert lora_trainable(LoRAConfig(dim=2)) is None
    assert lora_trainable(USER_LORA) is nnx.LoRAParam


# ---------------------------------------------------------------------------------------------
# Training under ZeRO-3

def _optimizer():
    # eps 1e-4: see tests/zeroxla/engine/test_frozen_params.py (Adam's step on near-zero grads).
    return optax.adam(1e-2, eps=1e-4)


def _batches(vocab):
    return token_batches(STEPS, BATCH, SEQ, vocab=vocab)


VARIANTS = {"": {}, "hpz": {"hpz_partition_size": 4}, "offload": {"offload_optimizer": "cpu"}}


@functools.cache
def _zero3_run(name, bits=0, variant=""):
    """STEPS steps at stage 3 on 2x4: (step, final state, stored params at init, losses).
    `bits`: the frozen base stored as codes; `variant`: ZeRO++'s hpZ, or ZeRO-Offload."""
    build, config, vocab = MODELS[name]
    extra = ({"quantized_nontrainable_weights": True, "weight_quantization_bits": bits}
             if bits else {})
    extra |= VARIANTS[variant]
    step = zeroxla.make_step(build(), zeroxla.make_mesh(2, 4), optimizer=_optimizer(),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD,
                                                       **extra),
                             trainable=lora_trainable(config))
    state = step.init()
    initial = jax.tree.map(np.asarray, state.params)
    state, losses = run_steps(step, state, _batches(vocab))
    return step, state, initial, losses


def _dequantized_codes(leaf, stored):
    """float64 numpy, from the format (`StoredCodes`, int8): device d's rows hold the groups of
    partition d (the zero-padded leaf split into 8 equal blocks along the shard dim, flattened);
    a group's values are code * step."""
    codes = np.asarray(stored.data).astype(np.int64)                   # [8 * G, group]
    values = (codes * np.asarray(stored.scales, np.float64)[:, None]).reshape(8, -1)
    shape, dim = leaf.shape, leaf.shard_dim
    block = list(shape)
    block[dim] = -(-shape[dim] // 8)
    size = int(np.prod(block))
    padded = np.concatenate([values[d, :size].reshape(block) for d in range(8)], axis=dim)
    return np.take(padded, np.arange(shape[dim]), axis=dim)


def _set_param(model, path, value):
    *parents, name = path.split("/")
    for parent in parents:
        model = getattr(model, parent)
    getattr(model, name)[...] = jnp.asarray(value, jnp.float32)


def _reference(name, bits=0):
    """Single-device optax, the base masked: (losses, final params, the base it started from)."""
    build, _, vocab = MODELS[name]
    model = build()
    if bits:
        step, _, stored, _ = _zero3_run(name, bits)
        for leaf in step.layout.plan.leaves:
            if leaf.params_quantized:
                _set_param(model, leaf.path, _dequantized_codes(leaf, stored[leaf.path]))
    start = flat_params(nnx.state(model, nnx.Param))
    trained = set(flat_params(nnx.state(model, nnx.LoRAParam)))

    return (*train_single_device(model, masked_optimizer(_optimizer(), trained), _batches(vocab)),
            start)


@pytest.mark.slow
@pytest.mark.parametrize("name,bits,variant", [("user", 0, ""), ("user", 8, ""), ("llama", 0, ""),
                                               ("llama", 0, "hpz"), ("user", 0, "offload")])
def test_zero3_lora_training_equals_single_device(name, bits, variant):
    step, state, _, losses = _zero3_run(name, bits, variant)
    if bits:
        assert {leaf.path for leaf in step.layout.plan.leaves if leaf.params_quantized} >= {
            "up/kernel/base", "down/kernel/base"}
    expected_losses, expected, start = _reference(name, bits)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    # int8 codes come back dequantized: the base is checked by the losses
    _assert_adapters_alone_trained(step, state, expected, start, base_kept=not bits)


def _assert_adapters_alone_trained(step, state, expected, start, base_kept=True):
    """The plan trains the adapters alone; they equal the reference's and moved from `start`;
    with `base_kept`, every other leaf is `start`'s bit for bit."""
    got = flat_params(zeroxla.gather_params(state))
    trained = {leaf.path for leaf in step.layout.plan.trainable_leaves}
    assert trained == {p for p in got if "/lora_" in p}
    for path in trained:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6,
                                   err_msg=path)
        assert not np.allclose(got[path], start[path]), path               # it trained
    for path in set(got) - trained:
        if base_kept:
            np.testing.assert_array_equal(got[path], start[path], err_msg=path)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipelined_lora_training_equals_single_device(schedule):
    """Llama with adapters, the base frozen, 2 pipeline stages x 1 node x 4 local, M = 4, ZeRO-3
    inside the stages (per-micro-batch gathers): the losses and adapters of the single-device
    reference, the base bitwise unchanged. ZB-H1's weight pass of adapted blocks falls back to
    the blocks' whole vjp (warned), the same gradients."""
    build, config, vocab = MODELS["llama"]
    step = zeroxla.make_step(build(), zeroxla.make_mesh(1, stages=2), optimizer=_optimizer(),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=THRESHOLD),
                             trainable=lora_trainable(config),
                             pipeline=zeroxla.PipelineConfig(4, schedule=schedule))
    state, losses = run_steps(step, step.init(), _batches(vocab))
    expected_losses, expected, start = _reference("llama")
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    _assert_adapters_alone_trained(step, state, expected, start)


@pytest.mark.slow
def test_optimizer_state_is_the_adapters_alone():
    step, state, _, _ = _zero3_run("llama")
    plan = step.layout.plan
    trainable = plan.trainable_leaves
    assert {leaf.path for leaf in trainable} == {
        leaf.path for leaf in plan.leaves if "/lora_" in leaf.path}
    # Per device, by the plan: a partition of each partitioned adapter, the whole of each one
    # under the persistence threshold; Adam's mu and nu in float32, plus its int32 step count.
    elements = sum(leaf.local_layers * (leaf.chunk if leaf.optimizer_partitioned
                                        else leaf.unit_numel) for leaf in trainable)
    report = zeroxla.memory_report(step.compile(state, _batches(65)[0]), state,
                                   layout=step.layout)
    assert report.optimizer == 2 * 4 * elements + 4
    adapters = lora_parameter_count(_llama())
    assert sum(leaf.numel for leaf in trainable) == adapters
    assert report.optimizer < 2 * 4 * sum(leaf.numel for leaf in plan.leaves) / 8


def test_only_linear_weights_are_adapted_not_gpt_per_head_biases():
    """GPT's bq / bk / bv are [H, K] per layer, rank 2 like a matrix, but no linear layer's
    weight (no `embed` axis): PEFT and DeepSpeed-Chat adapt the projections alone."""
    from zeroxla import models

    model = models.build("gpt-tiny")
    adapted = convert_linear_layer_to_lora(model, LoRAConfig(dim=2, module_name="blocks/layers/"),
                                           rngs=nnx.Rngs(0))
    names = {path.rsplit("/", 1)[-1] for path in adapted}
    assert not names & {"bq", "bk", "bv", "b_fc", "b_proj", "bo"}, adapted
    assert {"wq", "wk", "wv"} <= names, adapted
