"""A user's model through the pipeline: what its `__call__` computes, or a refusal by name.

The models are written the way the Flax examples and nanoGPT write them, not for zeroxla:
`nnx.Embed` embeddings (positions from a second `nnx.Embed`), blocks of plain `nnx.Linear` /
`nnx.LayerNorm` / `nnx.RMSNorm` with no logical axes, a final norm applied in `__call__` (not in a
`head`), Gemma's sqrt(D) embedding scale, Gemma 2's logit soft-capping, untied and tied heads.
Only the repeated blocks are a `LayerStack` (the pipeline splits that). Each pipelined run is
compared with plain single-device optax from the same initial parameters on the same batches
(`reference.train_single_device`): losses rtol 1e-5, SGD parameters rtol 1e-4 + atol 1e-6, and
`eval_loss` on the initial state equals the first training loss (rtol 1e-5).

Cases (stages x data, micro-batches, schedule, ZeRO stage): every model runs at 2 and 4 stages,
ZeRO 0 and 3, 1F1B and GPipe or ZB-H1 between its cases; plus a custom masked and weighted
`loss_fn` (under ZB-H1 with ZeRO-3, and GPipe), a loss_fn returning a mean, nanoGPT unpipelined
with the optimizer or the parameters offloaded (ZeRO-3), and the refusals, which happen in `make_step`
before any compute.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from reference import (cross_entropy, flat_params, masked_optimizer, token_batches,
                       train_single_device)
from runs import run_steps
from zeroxla.models.layers import LayerStack

V, D, H, SEQ, BATCH, STEPS, LAYERS = 30, 16, 2, 8, 16, 3, 4


# ------------------------------------------------------------------------------------------------
# Models, as users write them.
def causal_attention(q, k, v):                        # [B, T, H, K] each -> [B, T, H, K]
    t = q.shape[1]
    scores = jnp.einsum("BTHK,BSHK->BHTS", q, k) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    return jnp.einsum("BHTS,BSHK->BTHK", jax.nn.softmax(scores, axis=-1), v)


class NanoBlock(nnx.Module):
    """nanoGPT's Block: x + attn(ln_1(x)), x + mlp(ln_2(x)), all `nnx.Linear`."""

    def __init__(self, rngs):
        self.ln_1 = nnx.LayerNorm(D, rngs=rngs)
        self.c_attn = nnx.Linear(D, 3 * D, rngs=rngs)
        self.c_proj = nnx.Linear(D, D, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(D, rngs=rngs)
        self.c_fc = nnx.Linear(D, 4 * D, rngs=rngs)
        self.mlp_proj = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, H, D // H) for a in jnp.split(self.c_attn(self.ln_1(x)), 3, -1))
        x = x + self.c_proj(causal_attention(q, k, v).reshape(b, t, D))
        return x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nnx.Module):
    """nanoGPT: wte + wpe (`nnx.Embed`), blocks, ln_f in `__call__`, head tied to wte."""

    def __init__(self, rngs):
        self.wte = nnx.Embed(V, D, rngs=rngs)
        self.wpe = nnx.Embed(SEQ, D, rngs=rngs)
        self.blocks = LayerStack(NanoBlock, LAYERS, rngs)
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        x, _ = self.blocks(x)
        return self.wte.attend(self.ln_f(x))


def rope(x, positions):                               # x [B, T, H, K], positions [B, T]
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (jnp.arange(half) / half))
    angle = positions[..., None, None] * freq                                  # [B, T, 1, K/2]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x1 * jnp.sin(angle) + x2 * jnp.cos(angle)], -1)


class GemmaBlock(nnx.Module):
    """RMSNorm, rotary attention (positions passed to every block), gated MLP."""

    def __init__(self, rngs):
        self.norm_1 = nnx.RMSNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.norm_2 = nnx.RMSNorm(D, rngs=rngs)
        self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, x, positions):
        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, H, D // H) for a in jnp.split(self.qkv(self.norm_1(x)), 3, -1))
        a = causal_attention(rope(q, positions), rope(k, positions), v)
        x = x + self.out(a.reshape(b, t, D))
        h = self.norm_2(x)
        return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


class GemmaLike(nnx.Module):
    """Gemma: the embedding scaled by sqrt(D), a final RMSNorm, an untied `nnx.Linear` head;
    `softcap` > 0 adds Gemma 2's logit soft-capping, cap * tanh(logits / cap)."""

    def __init__(self, rngs, softcap=0.0):
        self.embedder = nnx.Embed(V, D, rngs=rngs)
        self.blocks = LayerStack(GemmaBlock, LAYERS, rngs)
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, rngs=rngs)
        self.softcap = softcap

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embedder(tokens) * jnp.sqrt(D).astype(jnp.float32)
        x, _ = self.blocks(x, positions)
        logits = self.lm_head(self.final_norm(x))
        if self.softcap:
            logits = self.softcap * jnp.tanh(logits / self.softcap)
        return logits


MODELS = {
    "nanogpt": lambda: NanoGPT(nnx.Rngs(0)),
    "gemma-scale": lambda: GemmaLike(nnx.Rngs(1)),
    "softcap": lambda: GemmaLike(nnx.Rngs(2), softcap=1.5),
}


# ------------------------------------------------------------------------------------------------
# Pipelined vs single device.
def _batches(weighted=False):
    batches = token_batches(STEPS, BATCH, SEQ, vocab=V, seed=3)
    rng = np.random.default_rng(4)
    for b in batches if weighted else ():    # masks and per-token weights: the custom loss's
        b["loss_mask"] = (rng.random((BATCH, SEQ)) < 0.7).astype(np.float32)
        b["weights"] = rng.uniform(0.5, 2.0, (BATCH, SEQ)).astype(np.float32)
    return batches


def _masked_weighted(model, batch):
    """A user's loss: cross-entropy weighted per token and masked, as (sum, count)."""
    logp = jax.nn.log_softmax(model(batch["inputs"]), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["loss_mask"] * batch["weights"]
    return jnp.sum(nll * w), jnp.sum(w)


def _masked_weighted_mean(model, batch):
    """`_masked_weighted` as the mean over the whole batch: its single-device reference."""
    total, count = _masked_weighted(model, batch)
    return total / count


def _mean_loss(model, batch):
    """A user's loss returning the mean over its piece of the batch (equal pieces)."""
    return cross_entropy(model, batch)


def _run(name, stages, pipeline, zero_stage, loss_fn=None, **config):
    mesh = zeroxla.make_mesh(1, stages=stages)
    step = zeroxla.make_step(MODELS[name](), mesh, optimizer=optax.sgd(0.3, momentum=0.9),
                             config=zeroxla.ZeroConfig(stage=zero_stage, persistence_threshold=0,
                                                       **config),
                             loss_fn=loss_fn, pipeline=pipeline)
    state = step.init()
    if config.get("offload_optimizer") == "cpu":       # the momentum lives in host memory
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {
            "unpinned_host"}
    if config.get("offload_param") == "cpu":           # so do the partitions (threshold 0)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {
            "pinned_host"}
    batches = _batches(weighted=loss_fn is _masked_weighted)
    eval_first = float(step.eval_loss(state, batches[0]))
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return eval_first, losses, flat_params(zeroxla.gather_params(state))


def _one_device_run(name, weighted, reference_loss):
    """The single-device reference of MODELS[name] over `_batches(weighted)` with plain optax
    and `reference_loss`: (losses, parameters)."""
    return train_single_device(MODELS[name](), optax.sgd(0.3, momentum=0.9),
                               _batches(weighted=weighted), loss_fn=reference_loss)


@pytest.fixture(scope="module")
def one_device():
    """`_one_device_run`, each set of arguments run once per test file: every schedule, ZeRO
    stage and offload of one model and loss compares with one run of it."""
    return functools.cache(_one_device_run)


def _check(one_device, name, stages, pipeline, zero_stage, loss_fn=None,
           reference_loss=cross_entropy, **config):
    """`one_device`: the fixture's cached `_one_device_run`."""
    expected_losses, expected = one_device(name, loss_fn is _masked_weighted, reference_loss)
    eval_first, losses, got = _run(name, stages, pipeline, zero_stage, loss_fn, **config)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(eval_first, losses[0], rtol=1e-5)
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
    initial = flat_params(nnx.state(MODELS[name](), nnx.Param))
    moved = [p for p in expected if np.abs(expected[p] - initial[p]).max() > 1e-4]
    assert len(moved) > len(expected) * 3 // 4, sorted(set(expected) - set(moved))


ONE_F_ONE_B, GPIPE, ZB_H1 = "1f1b", "gpipe", "zb-h1"
CASES = [      # model, stages, micro-batches, schedule, ZeRO stage
    ("nanogpt", 2, 4, ONE_F_ONE_B, 0),
    ("nanogpt", 4, 8, GPIPE, 3),
    ("gemma-scale", 2, 2, GPIPE, 3),
    ("gemma-scale", 4, 4, ZB_H1, 0),
    ("nanogpt", 2, 4, ZB_H1, 3),      # the weight-only W through per-micro-batch gathers
    ("softcap", 4, 4, ONE_F_ONE_B, 3),
    ("softcap", 2, 4, GPIPE, 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,stages,micro,schedule,zero_stage", CASES,
                         ids=[f"{c[0]}-s{c[1]}-m{c[2]}-{c[3]}-z{c[4]}" for c in CASES])
def test_user_model_pipelined_matches_single_device(name, stages, micro, schedule, zero_stage,
                                                   one_device):
    _check(one_device, name, stages, zeroxla.PipelineConfig(micro, schedule=schedule), zero_stage)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_user_model_unpipelined_matches_single_device(name, one_device):
    # The same models through the plain step (ZeRO-3 over 8 data devices, each layer of the
    # nnx.Linear LayerStack gathered in the scan): the path eval_loss takes above.
    _check(one_device, name, 1, None, 3)


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["offload_optimizer", "offload_param"])
def test_user_model_with_offload_matches_single_device(offload, one_device):
    # nanoGPT, ZeRO-3 over 8 data devices with ZeRO-Offload (the optimizer state in host
    # memory, SGD's update run there: `zeroxla.engine.host_update`) or ZeRO-Infinity's parameter
    # offload (each nnx.Linear's partition fetched from pinned host memory before its gather;
    # `zeroxla.engine.offload`).
    _check(one_device, "nanogpt", 1, None, 3, **{offload: "cpu"})


@pytest.mark.slow
@pytest.mark.fusion_emitters
def test_user_model_16bit_partitions_with_optimizer_offload_train_as_without():
    # nanoGPT at stage 3 under bf16 with ZeRO-Offload: each nnx.Linear's partition is a bf16
    # copy on the device (what its gathers read) beside its float32 master in host memory,
    # where without offload the float32 partition itself stays on the device. The forward reads
    # the same bf16 values either way, so losses are bit-identical and the masters equal.
    resident = _run("nanogpt", 1, None, 3, compute_dtype="bfloat16")
    offloaded = _run("nanogpt", 1, None, 3, compute_dtype="bfloat16", offload_optimizer="cpu")
    assert offloaded[:2] == resident[:2]
    assert offloaded[2].keys() == resident[2].keys()
    for path, value in resident[2].items():
        np.testing.assert_array_equal(offloaded[2][path], value, err_msg=path)


@pytest.mark.slow
def test_user_model_pipelined_with_optimizer_offload_matches_single_device(one_device):
    # The pipelined step shares the plain step's update, so ZeRO-Offload runs there unchanged:
    # nanoGPT, 2 stages x 4 data devices, 1F1B over 4 micro-batches, ZeRO-3, float32.
    _check(one_device, "nanogpt", 2, zeroxla.PipelineConfig(4), 3, offload_optimizer="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,schedule", [(3, ZB_H1), (0, GPIPE)])
def test_custom_masked_weighted_loss_pipelined(zero_stage, schedule, one_device):
    _check(one_device, "nanogpt", 2, zeroxla.PipelineConfig(4, schedule=schedule), zero_stage,
           loss_fn=_masked_weighted, reference_loss=_masked_weighted_mean)


@pytest.mark.slow
def test_custom_mean_loss_pipelined(one_device):
    # A mean per micro-batch piece, averaged over equal pieces: the single-device mean.
    _check(one_device, "gemma-scale", 2, zeroxla.PipelineConfig(2), 3, loss_fn=_mean_loss)


# ------------------------------------------------------------------------------------------------
# Refusals, by name, in make_step (nothing compiled).
class TwiceThroughStack(NanoGPT):
    def __call__(self, tokens):
        x = self.wte(tokens)
        x, _ = self.blocks(x)
        x, _ = self.blocks(x)
        return self.wte.attend(x)


class ReadsStack(NanoGPT):
    def __call__(self, tokens):
        x = self.wte(tokens) * self.blocks.layers.ln_1.scale[...].mean()
        return self.wte.attend(self.blocks(x)[0])


class LearnedArgument(NanoGPT):
    def __call__(self, tokens):
        x = self.wte(tokens)
        x, _ = self.blocks(x, self.wpe.embedding[...][: tokens.shape[1]])
        return self.wte.attend(x)


class KeywordArgument(NanoGPT):
    def __call__(self, tokens):
        x, _ = self.blocks(self.wte(tokens), mask=tokens > 0)
        return self.wte.attend(x)


class ListOfBlocks(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([NanoBlock(rngs) for _ in range(LAYERS)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(x)


@pytest.mark.parametrize("model_class,message", [
    (TwiceThroughStack, "calls model.blocks 2 times"),
    (ReadsStack, "reads an attribute of self.blocks"),
    (LearnedArgument, "depends on its parameters"),
    (KeywordArgument, "keyword arguments ['mask']"),
    (ListOfBlocks, "must be a models.LayerStack"),
])
def test_unsplittable_models_are_refused_by_name(model_class, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        zeroxla.make_step(model_class(nnx.Rngs(0)), zeroxla.make_mesh(1, stages=2),
                          optimizer=optax.sgd(0.1), pipeline=zeroxla.PipelineConfig(2))


def test_a_batch_longer_than_the_model_is_refused_as_without_pipeline():
    mesh = zeroxla.make_mesh(1, stages=2)
    long = token_batches(1, 8, 40, vocab=65)[0]            # gpt-tiny-4: max_seq_len 32
    model = zeroxla.models.build("gpt-tiny", num_layers=2, max_seq_len=32)
    for pipeline in (None, zeroxla.PipelineConfig(2)):
        step = zeroxla.make_step(model, mesh if pipeline else zeroxla.make_mesh(1),
                                 optimizer=optax.sgd(0.1), pipeline=pipeline)
        with pytest.raises(ValueError, match="sequence length 40 exceeds"):
            step.lower(jax.eval_shape(step.init), long)


def test_unnamed_dims_take_the_default_rule_shown_in_describe():
    step = zeroxla.make_step(NanoGPT(nnx.Rngs(0)), zeroxla.make_mesh(1, stages=2),
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=3),
                             pipeline=zeroxla.PipelineConfig(2))
    text = step.layout.plan.describe()
    assert "logical axis '-': a dim the model does not name" in text
    row = next(line for line in text.splitlines() if line.startswith("blocks/layers/c_attn/kernel"))
    assert "layers,-,-" in row                # stacked by the LayerStack, the rest unnamed
    # The embedding (its input) and the head are what the stack's input does / does not read.
    assert step.pipeline.cut.embed_paths == ("wpe/embedding", "wte/embedding")
    assert step.pipeline.cut.head_paths == ("ln_f/bias", "ln_f/scale")


def test_token_ids_outside_the_vocabulary_are_refused_as_without_pipeline():
    batch = token_batches(1, 16, SEQ, vocab=V)[0]
    batch["inputs"][3, 2] = V                                 # one id past the vocabulary
    for mesh, pipeline in ((zeroxla.make_mesh(1), None),
                           (zeroxla.make_mesh(1, stages=2), zeroxla.PipelineConfig(2))):
        step = zeroxla.make_step(NanoGPT(nnx.Rngs(0)), mesh, optimizer=optax.sgd(0.1),
                                 pipeline=pipeline)
        with pytest.raises(ValueError, match="vocab"):
            step.lower(jax.eval_shape(step.init), batch)


@pytest.mark.slow
def test_user_model_with_lora_adapters_alone_pipelined_matches_single_device():
    """nanoGPT as users write it, LoRA adapters (rank 4) on each block's `c_attn` and `c_fc`
    `nnx.Linear`, the rest frozen (`only_optimize_lora`): 2 stages x 4 data devices, 1F1B over
    4 micro-batches, ZeRO-3, against single-device optax with the frozen leaves' updates set to
    zero; the frozen leaves stay bitwise as they started."""
    from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora, lora_trainable

    lora = LoRAConfig(dim=4, alpha=8.0, module_name=r"blocks/.*(c_attn|c_fc)/kernel",
                      only_optimize_lora=True)

    def build():
        model = NanoGPT(nnx.Rngs(0))
        convert_linear_layer_to_lora(model, lora, rngs=nnx.Rngs(5))
        return model

    start = flat_params(nnx.state(build(), nnx.Param))
    adapters = set(flat_params(nnx.state(build(), nnx.LoRAParam)))
    assert adapters and all("/lora_" in p for p in adapters)

    optimizer = lambda: optax.sgd(0.3, momentum=0.9)                     # noqa: E731
    expected_losses, expected = train_single_device(
        build(), masked_optimizer(optimizer(), adapters), _batches())
    step = zeroxla.make_step(build(), zeroxla.make_mesh(1, stages=2), optimizer=optimizer(),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0),
                             trainable=lora_trainable(lora), pipeline=zeroxla.PipelineConfig(4))
    state, losses = run_steps(step, step.init(), _batches())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    got = flat_params(zeroxla.gather_params(state))
    assert {leaf.path for leaf in step.layout.plan.trainable_leaves} == adapters
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-4, atol=1e-6, err_msg=path)
        if path in adapters:
            assert not np.allclose(got[path], start[path]), path         # it trained
        else:
            np.testing.assert_array_equal(got[path], start[path], err_msg=path)
