"""`models.attention`, the one dispatch: every family gives the same logits and parameter
gradients with attention="naive" (the [T, T] reference) as with its default ("auto", blockwise
on this CPU); a packed row (segment ids, positions restarting per sequence) gives each of its
sequences the logits that sequence has alone; the cuDNN route lowers for CUDA to cuDNN's fused
attention (forward and backward) and is refused, by name, where its constraints do not hold;
"auto" picks blockwise off GPUs; unknown names are refused."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla.compat.lowering import lower_for_cuda
from zeroxla.models import GPT, GPTConfig, Gemma2, Gemma2Config, Llama, LlamaConfig, Qwen3Config
from zeroxla.models import attention as attention_module
from zeroxla.models.attention import attention, choose
from zeroxla.models.layers import stack_args
from zeroxla.models.rope import rope

# Tiny configs with every attention option a family has: GQA, sliding window narrower than T,
# Qwen3's q/k norms, Gemma 2's soft-cap, scale and alternating windows. init_std 0.2 so that
# attention is far from uniform.
FAMILIES = {
    "gpt": (GPT, GPTConfig(init_std=0.2)),
    "llama-window": (Llama, LlamaConfig(init_std=0.2, sliding_window=5)),
    "qwen3": (Llama, Qwen3Config(init_std=0.2)),
    "gemma2": (Gemma2, Gemma2Config(init_std=0.2, sliding_window=5)),
}
T = 13                                           # not a multiple of anything


def _model(family, **changes):
    cls, config = FAMILIES[family]
    return cls(config.replace(**changes), rngs=nnx.Rngs(0))


def _logits_and_grads(model, tokens, cotangent, **call):
    """logits [B, T, V] and d sum(logits * cotangent) / d params (a random projection)."""
    def loss(m):
        logits = m(tokens, **call)
        return jnp.sum(logits * cotangent), logits
    (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return logits, grads


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "gemma2" else pytest.mark.slow)
                                    for f in sorted(FAMILIES)])    # daily: every option at once
def test_naive_and_default_attention_give_the_same_logits_and_gradients(family):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 65, (2, T)), jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((2, T, 65)), jnp.float32)
    naive = _logits_and_grads(_model(family, attention="naive"), tokens, cotangent)
    default = _logits_and_grads(_model(family), tokens, cotangent)
    assert _model(family).config.attention == "auto"
    for got, want in zip(jax.tree.leaves(default), jax.tree.leaves(naive)):
        got, want = np.asarray(got), np.asarray(want)     # on the host: no program per leaf
        scale = max(1.0, float(np.max(np.abs(want))))
        assert float(np.max(np.abs(got - want))) / scale < 1e-5


# One packed row: sequences of 6 and 5 tokens, then 2 padding tokens (segment 0).
LENGTHS = (6, 5)


def _one_family_per_implementation():
    """Daily: the naive route on GPT, the blockwise one ("auto") on Llama with a window."""
    daily = {("gpt", "naive"), ("llama-window", "auto")}
    return [pytest.param(f, i, marks=() if (f, i) in daily else pytest.mark.slow, id=f"{f}-{i}")
            for f in sorted(FAMILIES) for i in ("naive", "auto")]


@pytest.mark.parametrize("family,implementation", _one_family_per_implementation())
def test_a_packed_row_gives_each_sequence_its_own_logits(family, implementation):
    model = _model(family, attention=implementation)
    rng = np.random.default_rng(2)
    sequences = [rng.integers(0, 65, (1, n)).astype(np.int32) for n in LENGTHS]
    pad = T - sum(LENGTHS)
    tokens = np.concatenate(sequences + [np.zeros((1, pad), np.int32)], axis=1)      # [1, T]
    segment_ids = np.repeat([1, 2, 0], LENGTHS + (pad,))[None].astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in LENGTHS + (pad,)])[None].astype(np.int32)
    packed = nnx.jit(lambda m: m(jnp.asarray(tokens), jnp.asarray(positions),
                                 jnp.asarray(segment_ids)))(model)
    start = 0
    for seq in sequences:
        alone = nnx.jit(lambda m, s: m(s))(model, jnp.asarray(seq))                    # [1, n, V]
        n = seq.shape[1]
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=2e-5, rtol=0)
        start += n


def test_segment_ids_need_positions_and_no_cache():
    tokens = jnp.zeros((1, 4), jnp.int32)
    segment_ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids given without positions"):
        stack_args(tokens, None, segment_ids)
    with pytest.raises(ValueError, match=r"segment_ids \(1, 3\)"):
        stack_args(tokens, jnp.zeros((1, 4), jnp.int32), segment_ids[:, :3])
    assert stack_args(tokens, None, None)[0].shape == (1, 4)        # positions 0..T-1 only
    q = k = jnp.zeros((1, 4, 2, 8))
    cache = {"k": jnp.zeros((1, 8, 2, 8)), "v": jnp.zeros((1, 8, 2, 8))}
    with pytest.raises(ValueError, match="segment_ids given with a KV cache"):
        attention_module.cached_attention(q, k, k, jnp.zeros((1, 4), jnp.int32), cache,
                                          segment_ids=segment_ids)


def test_unknown_implementations_are_refused_by_name():
    with pytest.raises(ValueError, match=r"LlamaConfig.attention='flash'.*accepted: auto, "
                                         r"naive, blockwise, cudnn"):
        LlamaConfig(attention="flash")
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"attention='splash'"):
        attention(q, q, q, implementation="splash")


def test_auto_is_blockwise_off_gpus():
    assert jax.default_backend() == "cpu"
    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)            # cuDNN's constraints hold
    assert choose(q, q, q) == "blockwise"


# ---- the cuDNN route ------------------------------------------------------------------------

def _bf16(b, t, h, g, d):
    return (jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t, g, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t, g, d), jnp.bfloat16))


@pytest.fixture
def cudnn_version(monkeypatch):
    """jax asks the installed cuDNN its version before it builds the fused attention's custom
    call; this host has none, so the test answers for it (9.10): the lowering is what a GPU
    with cuDNN would compile, and nothing runs."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


@pytest.mark.parametrize("window", [None, 16])
def test_cudnn_lowers_to_the_fused_attention_forward_and_backward(cudnn_version, window):
    """GQA (4 query heads on 2 kv heads), bf16, head dim 128; the gradient lowers to cuDNN's
    backward kernel, not to an XLA softmax."""
    def loss(q, k, v):
        out = attention(q, k, v, window=window, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    text = lower_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                          *_bf16(1, 256, 4, 2, 128)).as_text()
    calls = re.findall(r"custom_call @(\S+)\(", text)
    assert calls == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls


@pytest.mark.parametrize("dtype,options,named", [
    (jnp.float32, {}, "dtype q float32"),
    (jnp.bfloat16, {"softcap": 50.0}, "softcap=50.0"),
    (jnp.bfloat16, {"segment_ids": jnp.ones((1, 16), jnp.int32)}, "segment_ids given"),
])
def test_an_explicit_cudnn_whose_constraints_fail_is_refused_by_name(dtype, options, named):
    q = jnp.zeros((1, 16, 4, 128), dtype)
    k = jnp.zeros((1, 16, 2, 128), dtype)
    with pytest.raises(ValueError, match=re.escape(named)):
        attention(q, k, k, implementation="cudnn", **options)
    assert choose(q, k, k, softcap=options.get("softcap"),
                  segment_ids=options.get("segment_ids")) == "blockwise"


def test_cudnn_refuses_a_head_dim_it_does_not_take():
    q = jnp.zeros((1, 16, 2, 12), jnp.bfloat16)        # not a multiple of 8
    with pytest.raises(ValueError, match=r"head_dim=12 \(cuDNN takes a multiple of 8 up to "):
        attention(q, q, q, implementation="cudnn")


def _rope_reference(x, positions, inv_freq):
    """float64 numpy rotate-half RoPE (HF Llama's convention) of x [B, T, H, K]."""
    angles = positions[..., None] * np.asarray(inv_freq, np.float64)          # [B, T, K/2]
    angles = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def test_float64_rope_and_the_blockwise_route_do_not_round_through_float32():
    """A float64 run checks the algebra, so nothing on it may round to float32. RoPE did (its
    angles and rotation in float32), and XLA kept or dropped that rounding by how it fused the
    layer (excess precision): at T = 600 (two query blocks) a float64 Llama's logits on the
    blockwise route were 2.9e-10 from the naive route's, 3e-16 once RoPE stays in float64."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        cfg = LlamaConfig(init_std=0.2, max_seq_len=640)
        x = rng.standard_normal((1, 600, 2, cfg.head_dim))
        positions = np.arange(600)[None]
        roped = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions), cfg.rope_inv_freq()))
        np.testing.assert_allclose(roped, _rope_reference(x, positions, cfg.rope_inv_freq()),
                                   atol=1e-12, rtol=0)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 600)), jnp.int32)
        logits = {}
        for implementation in ("naive", "blockwise"):
            model = Llama(LlamaConfig(init_std=0.2, max_seq_len=640,
                                      attention=implementation), rngs=nnx.Rngs(0))
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.float64), params))
            logits[implementation] = np.asarray(model(tokens))
        assert logits["blockwise"].dtype == np.float64
        np.testing.assert_allclose(logits["blockwise"], logits["naive"], atol=1e-12, rtol=0)
