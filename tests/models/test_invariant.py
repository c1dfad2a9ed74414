"""The batch-invariant kernels (`models.invariant`): each row's bits do not depend on how many
rows are computed with it (M = 1, 3, 64), and the values equal a float64 numpy computation
within float32 rounding; a batch-invariant Llama's KV-cached decode gives the training
forward's log-probs bit for bit, and so does a batch-invariant MoE Llama's (Qwen3-MoE; Qwen2-MoE
with its shared expert and OLMoE with its projection-wide q/k norms, slow), whose training
log-probs equal the default mode's within float32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.models import invariant, invariant_moe
from zeroxla.models.expert_parallel import ExpertParallel
from zeroxla.models.llama import Llama, LlamaConfig
from zeroxla.inference.sampling import Sampling, sampled_logprobs

ROWS = (1, 3, 64)


def _rows_agree(fn, *arrays):
    """fn's rows computed with M rows, for each M in ROWS, equal the M = 64 rows bit for bit."""
    full = np.asarray(jax.jit(fn)(*arrays))
    for m in ROWS[:-1]:
        part = np.asarray(jax.jit(fn)(*(a[:m] for a in arrays)))
        assert np.array_equal(part, full[:m]), m
    return full


def test_ops_are_row_count_invariant_and_match_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 60)).astype(np.float32)                   # [M, K]
    w = rng.standard_normal((60, 65)).astype(np.float32)                   # [K, N]
    labels = rng.integers(0, 65, 64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)

    out = _rows_agree(lambda a: invariant.matmul(a, w), x)
    ref = x64 @ w64
    bound = 60 * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64))   # K ulps of |x||w|
    assert np.all(np.abs(out - ref) <= bound)

    out = _rows_agree(lambda a: invariant.rms_norm(a, 1e-5), x)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)

    logits = x @ w
    out = _rows_agree(invariant.logprobs_at, logits, labels)
    l64 = logits.astype(np.float64)
    ref = l64 - l64.max(-1, keepdims=True)
    ref = (ref - np.log(np.exp(ref).sum(-1, keepdims=True)))[np.arange(64), labels]
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_attention_over_a_longer_cache_equals_the_whole_sequence():
    """A query alone against keys padded to 32 slots (the decode step) gives the bits of the
    same query among all 9 (the training forward), and both equal float64 attention."""
    rng = np.random.default_rng(1)
    b, t, h, g, k, s = 2, 9, 4, 2, 8, 32
    q = rng.standard_normal((b, t, h, k)).astype(np.float32)
    keys, values = (rng.standard_normal((b, t, g, k)).astype(np.float32) for _ in range(2))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    full = np.asarray(jax.jit(invariant.attention)(q, keys, values, causal))
    pad = ((0, 0), (0, s - t), (0, 0), (0, 0))
    for pos in (0, 4, 8):
        visible = np.broadcast_to(np.arange(s) <= pos, (b, 1, s))
        one = jax.jit(invariant.attention)(q[:, pos:pos + 1], np.pad(keys, pad),
                                           np.pad(values, pad), visible)
        assert np.array_equal(np.asarray(one)[:, 0], full[:, pos]), pos
    qg = q.astype(np.float64).reshape(b, t, g, h // g, k)
    scores = np.einsum("btgrk,bsgk->bgrts", qg, keys.astype(np.float64)) / np.sqrt(k)
    scores = np.where(causal[:, None, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bgrts,bsgk->btgrk", p, values.astype(np.float64)).reshape(b, t, h, k)
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-6)


def _decoded_logprobs(model, tokens, prefill=5):
    """A prefill of `prefill` tokens of tokens [B, T], then one token per step into a 32-slot
    cache: each next token's log-prob (`sampled_logprobs`) -> [B, T - prefill]."""
    b, t = tokens.shape
    decode = jax.jit(lambda m, t, p, c: m.decode(t, p, c))
    drawn = jax.jit(lambda lg, tk: sampled_logprobs(lg, tk, Sampling(temperature=1.0), True))
    positions = jnp.broadcast_to(jnp.arange(prefill, dtype=jnp.int32), (b, prefill))
    logits, cache = decode(model, tokens[:, :prefill], positions, model.init_cache(b, 32))
    rollout = [drawn(logits[:, -1], tokens[:, prefill])]
    for i in range(prefill, t - 1):
        logits, cache = decode(model, tokens[:, i:i + 1], jnp.full((b, 1), i, jnp.int32), cache)
        rollout.append(drawn(logits[:, 0], tokens[:, i + 1]))
    return np.stack(rollout, 1)


def _train_logprobs(model, tokens):
    """The training forward's log-probs of tokens [B, T] -> [B, T - 1]."""
    return np.asarray(jax.jit(lambda m, t: m.token_logprobs(t[:, :-1], t[:, 1:]))(model, tokens))


MOE = dict(vocab_size=65, max_seq_len=32, d_model=32, num_heads=4, num_kv_heads=2,
           explicit_head_dim=8, num_layers=2, mlp_dim=16, num_experts=8, experts_per_token=2,
           expert_mlp_dim=16, init_std=0.2)


# slow: the fusion-emitters tests run in a child pytest of their own (about 18 s); the kernels'
# row invariance and the attention over a longer cache stay daily
@pytest.mark.slow
@pytest.mark.fusion_emitters      # bit-identity across shapes: XLA:CPU's fusion emitters only
@pytest.mark.parametrize("family,extra", [
    ("qwen3_moe", {}),
    pytest.param("qwen2_moe", {"shared_expert_mlp_dim": 24}, marks=pytest.mark.slow),
    pytest.param("olmoe", {}, marks=pytest.mark.slow)])
def test_moe_decode_logprobs_equal_the_training_forward(family, extra):
    """A tiny MoE Llama (8 experts, top 2; head dim 8, so RoPE's rotation and the attention's
    sums are one CHUNK long) in the mode: the decode's log-probs equal the [4, 20] training
    forward's bit for bit; the training forward equals the default mode's (grouped expert
    matmul, XLA's dots) with the same weights within float32 rounding."""
    spec = models.REGISTRY[family]
    config = spec.config_class(**MOE, **extra)
    model = spec.model_class(config.replace(batch_invariant=True), rngs=nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 65, (4, 21)), jnp.int32)
    train = _train_logprobs(model, tokens)
    assert np.array_equal(_decoded_logprobs(model, tokens), train[:, 4:])
    default = _train_logprobs(spec.model_class(config, rngs=nnx.Rngs(3)), tokens)
    np.testing.assert_allclose(train, default, rtol=0, atol=1e-5)


def test_moe_mode_refusals_name_the_option():
    """Expert parallelism (outputs summed over devices) and gpt-oss (sinks, expert biases)."""
    invariant_moe.check_unsplit(None)
    invariant_moe.check_unsplit(ExpertParallel("expert", 1))
    with pytest.raises(ValueError, match="batch_invariant=True with expert parallelism"):
        invariant_moe.check_unsplit(ExpertParallel("expert", 2))
    with pytest.raises(ValueError, match="GptOssConfig.batch_invariant=True"):
        models.GptOssConfig(batch_invariant=True)


@pytest.mark.slow                 # a child pytest of its own (see above)
@pytest.mark.fusion_emitters      # bit-identity across shapes: XLA:CPU's fusion emitters only
def test_llama_decode_logprobs_equal_the_training_forward():
    """Prefill of 5 tokens, then one token per step into a 32-slot cache: every drawn token's
    log-prob (`sampled_logprobs`) equals the [4, 20] training forward's bit for bit."""
    model = Llama(LlamaConfig.tiny().replace(batch_invariant=True), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 65, (4, 21)), jnp.int32)
    assert np.array_equal(_decoded_logprobs(model, tokens), _train_logprobs(model, tokens)[:, 4:])
