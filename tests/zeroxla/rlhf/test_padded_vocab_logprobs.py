"""PPO's policy over a padded vocabulary is the distribution its rollouts draw from: with
`vocab_limit`, `answer_logprobs` is the float64 log-softmax over the tokenizer's ids alone, and
its gradient is finite and zero on the padded logits (which the -inf mask cuts off)."""

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.rlhf.ppo.losses import answer_logprobs

LIMIT, VOCAB, B, P, G = 24, 32, 3, 4, 5
RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(B, P + G - 1, VOCAB)).astype(np.float32)         # [B, P+G-1, V]
LOGITS[..., LIMIT:] += 3.0                 # the padded ids hold most of the unmasked mass
TOKENS = RNG.integers(0, LIMIT, size=(B, P + G)).astype(np.int32)


def reference():
    """float64 log pi(token) over the first LIMIT ids: [B, G]."""
    z = LOGITS[:, -G:, :LIMIT].astype(np.float64)
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - z.max(-1, keepdims=True)
    return np.take_along_axis(logp, TOKENS[:, -G:, None], axis=-1)[..., 0]


def test_limited_logprobs_are_the_tokenizers_softmax():
    got = np.asarray(answer_logprobs(lambda t: jnp.asarray(LOGITS), TOKENS, G, LIMIT))
    np.testing.assert_allclose(got, reference(), rtol=1e-5, atol=1e-6)
    full = np.asarray(answer_logprobs(lambda t: jnp.asarray(LOGITS), TOKENS, G))
    assert np.all(full < got - 0.5)          # without the limit: the padded ids' mass counts


def test_gradient_is_finite_and_zero_on_padded_logits():
    grad = np.asarray(jax.grad(lambda x: answer_logprobs(lambda t: x, TOKENS, G, LIMIT).sum())(
        jnp.asarray(LOGITS)))
    assert np.all(np.isfinite(grad))
    assert np.all(grad[..., LIMIT:] == 0) and np.any(grad[:, -G:, :LIMIT] != 0)
