"""The chunked head (`models.chunked_logits`): log-probs, entropies and their gradients equal the
whole-logits computation, in every family, for a sequence that is not a multiple of the chunk;
and, compiled at Qwen's vocabulary (151,936) and T = 32K, no buffer of T x V elements exists,
where the whole-logits loss has one (so the check can fail)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla import models
from zeroxla.engine.loss import token_logprobs
from zeroxla.models import chunked_logits as cl

TOL = 1e-6            # float32: the bound for the loss and every gradient


def project(weight, h):                                    # h [B, C, D] @ weight [D, V]
    return jnp.einsum("BTD,DV->BTV", h, weight, preferred_element_type=jnp.float32)


def _head_inputs(b=2, t=13, d=8, v=11, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(b, t, d)).astype(dtype)
    weight = rng.normal(size=(d, v)).astype(dtype)
    labels = rng.integers(0, v, (b, t)).astype(np.int32)
    return jnp.asarray(h), labels, jnp.asarray(weight)


def _chunk_sweep():
    """Daily: chunk 4 (three chunks and a remainder of T = 13) of each option, and a chunk
    longer than T; the rest slow."""
    return [pytest.param(chunk, softcap, limit, id=f"{softcap}-{limit}-{chunk}",
                         marks=() if chunk == 4 or (chunk, softcap, limit) == (64, None, None)
                         else pytest.mark.slow)
            for softcap, limit in ((None, None), (2.0, None), (None, 7))
            for chunk in (1, 4, 13, 64)]


@pytest.mark.parametrize("chunk,softcap,vocab_limit", _chunk_sweep())
def test_chunked_logprobs_and_gradients_equal_whole_logits(chunk, softcap, vocab_limit):
    h, labels, weight = _head_inputs()
    kw = dict(softcap=softcap, vocab_limit=vocab_limit)
    weights = np.random.default_rng(1).uniform(size=labels.shape).astype(np.float32)
    ok = labels < (vocab_limit or 99)                    # -inf log-probs are masked out

    def loss(fn, h, weight):
        return -jnp.sum(jnp.where(ok, fn(h, weight), 0.0) * weights)

    chunked = lambda h, w: cl.chunked_token_logprobs(h, labels, w, project, chunk=chunk, **kw)
    whole = lambda h, w: cl.token_logprobs_reference(h, labels, w, project, **kw)
    np.testing.assert_allclose(chunked(h, weight), whole(h, weight), atol=TOL, rtol=0)
    got = jax.jit(jax.grad(lambda h, w: loss(chunked, h, w), argnums=(0, 1)))(h, weight)
    want = jax.jit(jax.grad(lambda h, w: loss(whole, h, w), argnums=(0, 1)))(h, weight)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(w)).max() > 1e-2
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)


def test_reference_is_log_softmax_of_the_logits_in_float64():
    h, labels, weight = _head_inputs()
    logits = np.einsum("btd,dv->btv", np.float64(h), np.float64(weight))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    got = cl.chunked_token_logprobs(h, labels, weight, project, chunk=4)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("vocab_limit", [pytest.param(None, marks=pytest.mark.slow), 7])
def test_chunked_entropy_and_its_gradient_equal_whole_logits(vocab_limit):
    h, _, weight = _head_inputs()
    chunked = lambda h, w: cl.chunked_token_entropy(h, w, project, chunk=4, softcap=3.0,
                                                    vocab_limit=vocab_limit)
    whole = lambda h, w: cl.token_entropy_reference(h, w, project, softcap=3.0,
                                                    vocab_limit=vocab_limit)
    logits = 3.0 * np.tanh(np.einsum("btd,dv->btv", np.float64(h), np.float64(weight)) / 3.0)
    if vocab_limit:
        logits = logits[..., :vocab_limit]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(whole(h, weight), -(p * np.log(p)).sum(-1), atol=2e-6, rtol=0)
    np.testing.assert_allclose(chunked(h, weight), whole(h, weight), atol=TOL, rtol=0)
    got = jax.jit(jax.grad(lambda h, w: jnp.sum(chunked(h, w)), argnums=(0, 1)))(h, weight)
    want = jax.jit(jax.grad(lambda h, w: jnp.sum(whole(h, w)), argnums=(0, 1)))(h, weight)
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)


def test_float64_stays_float64():
    h, labels, weight = _head_inputs(dtype=np.float64)
    with jax.enable_x64(True):
        project64 = lambda w, h: jnp.einsum("BTD,DV->BTV", h, w,
                                            preferred_element_type=jnp.float64)
        out = cl.chunked_token_logprobs(jnp.asarray(h, jnp.float64), labels,
                                        jnp.asarray(weight, jnp.float64), project64, chunk=4)
        assert out.dtype == jnp.float64


def test_a_chunk_that_is_not_a_positive_integer_is_refused():
    h, labels, weight = _head_inputs()
    with pytest.raises(ValueError, match="chunk=0"):
        cl.chunked_token_logprobs(h, labels, weight, project, chunk=0)


# ---- every family --------------------------------------------------------------------------------

FAMILY_CONFIGS = {
    "llama": lambda: models.LlamaConfig.tiny(),
    "llama_tied": lambda: models.LlamaConfig.tiny().replace(tie_word_embeddings=True),
    "gpt2": lambda: models.GPTConfig.tiny(),
    "gemma2_softcap": lambda: models.Gemma2Config(final_softcap=1.5),   # the cap bites
}


def _chunked_model(name, chunk=4):
    config = FAMILY_CONFIGS[name]()
    model = models.model_class(config)(config, rngs=nnx.Rngs(0))
    for module in (model.embed, getattr(model, "head", None)):
        if hasattr(module, "logits_chunk"):
            module.logits_chunk = chunk                  # T = 13: three chunks and a remainder
    return model


# Daily: llama, the untied head (the tied embedding's chunking: the vocab_limit test below).
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "llama" else pytest.mark.slow)
                                  for n in sorted(FAMILY_CONFIGS)])
def test_family_logprobs_and_every_gradient_equal_whole_logits(name):
    model = _chunked_model(name)
    rng = np.random.default_rng(2)
    vocab = model.config.vocab_size
    tokens = rng.integers(0, vocab, (2, 13)).astype(np.int32)
    labels = rng.integers(0, vocab, (2, 13)).astype(np.int32)
    mask = (rng.uniform(size=(2, 13)) < 0.7).astype(np.float32)
    graphdef, params = nnx.split(model)

    def loss(params, tokens, labels, mask, chunked):
        m = nnx.merge(graphdef, params)
        logp = m.token_logprobs(tokens, labels) if chunked else token_logprobs(m(tokens), labels)
        return -jnp.sum(logp * mask) / jnp.sum(mask), logp        # the masked mean loss

    # one program per route, not op by op
    loss_and_grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=4)
    (_, got), g_got = loss_and_grads(params, tokens, labels, mask, True)
    (_, want), g_want = loss_and_grads(params, tokens, labels, mask, False)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    flat_got, flat_want = nnx.to_flat_state(g_got), nnx.to_flat_state(g_want)
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=TOL, rtol=0,
                                   err_msg="/".join(map(str, path)))


def test_family_vocab_limit_and_positions_equal_whole_logits():
    model = _chunked_model("llama_tied")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 60, (2, 9)).astype(np.int32)
    positions = np.tile(np.arange(3, 12, dtype=np.int32), (2, 1))
    got = model.token_logprobs(tokens, tokens, positions=positions, vocab_limit=60)
    logits = model(tokens, positions)
    logits = jnp.where(jnp.arange(logits.shape[-1]) < 60, logits, -jnp.inf)
    np.testing.assert_allclose(got, token_logprobs(logits, tokens), atol=TOL, rtol=0)


# ---- the Must-show: V = 151,936 at T = 32K, compiled from shapes only ----------------------------

VOCAB, SEQ = 151_936, 32_768
BUFFER = re.compile(r"(?:f32|f64|bf16|f16)\[([\d,]+)\]")


def _largest_buffer(compiled) -> int:
    """The element count of the largest floating array any instruction of `compiled` makes."""
    return max(int(np.prod([int(d) for d in dims.split(",")]))
               for dims in BUFFER.findall(compiled.as_text()))


def _compiled_loss_and_grad(chunked: bool):
    config = models.LlamaConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=16, num_heads=1,
                                num_kv_heads=1, num_layers=1, mlp_dim=32)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: models.Llama(config,
                                                                     rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        labels = jnp.roll(tokens, -1, axis=1)
        logp = (model.token_logprobs(tokens, labels) if chunked
                else token_logprobs(model(tokens), labels))
        return -jnp.mean(logp)
    return jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()


@pytest.mark.parametrize("chunked", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_no_buffer_of_t_times_v_elements_at_qwen_vocabulary_and_32k_tokens(chunked):
    """The chunked loss + gradient holds no T x V buffer (its largest logits buffer is one
    chunk's); the whole-logits one does, so the check can fail."""
    compiled = _compiled_loss_and_grad(chunked)
    largest = _largest_buffer(compiled)
    if chunked:
        assert largest < SEQ * VOCAB
        assert compiled.memory_analysis().temp_size_in_bytes < SEQ * VOCAB * 4
    else:
        assert largest >= SEQ * VOCAB
