"""`Sampling.vocab_limit`: a model vocabulary padded past its tokenizer's never yields a padded id.

The reference is float64 numpy on the logits cut to the tokenizer's ids ([:, :limit]): the
distribution with the limit must be that one, padded with zeros, for every knob (greedy,
temperature, top-k, top-p, the uniform limit beyond float32), and the padded ids are given the
largest logits, so a sampler that ignored the limit would pick them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.inference.decode import check_request
from zeroxla.inference.sampling import FLOAT32_MAX, Sampling, log_weights, next_token

LIMIT, VOCAB = 40, 64
LOGITS = (np.random.default_rng(1).normal(size=(8, VOCAB)) * 2).astype(np.float32)   # [B, V]
LOGITS[:, LIMIT:] += 10.0             # the padded ids are each row's most likely
ABOVE_MAX = float(np.nextafter(FLOAT32_MAX, np.inf))


def reference(logits, temperature, top_k=None, top_p=None):
    """float64 probs [B, LIMIT] of the draw over the first LIMIT ids alone (Hugging Face's
    order: temperature, top-k, top-p; ties kept; beyond float32's max: uniform)."""
    out = []
    for row in np.asarray(logits, np.float64)[:, :LIMIT]:
        keep = np.ones(row.shape, bool)
        if top_k is not None:
            keep = row >= np.sort(row)[::-1][min(top_k, row.size) - 1]
        z = np.zeros_like(row) if temperature > FLOAT32_MAX else (row - row.max()) / temperature
        z = np.where(keep, z, -np.inf)
        if top_p is not None:
            order = np.argsort(-row, kind="stable")
            mass = np.exp(z[order]) / np.exp(z[order]).sum()
            before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
            z = np.where(row >= row[order][np.sum(before < top_p) - 1], z, -np.inf)
        p = np.exp(z - z.max())
        out.append(p / p.sum())
    return np.array(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, 5, None), (2.0, None, 0.9), (1.0, 50, None), (ABOVE_MAX, None, None),
    (ABOVE_MAX, 50, None)])
def test_distribution_is_the_tokenizers_ids_alone(temperature, top_k, top_p):
    weights = np.asarray(log_weights(jnp.asarray(LOGITS),
                                     Sampling(temperature, top_k, top_p, vocab_limit=LIMIT)),
                         np.float64)                                            # [B, V]
    assert np.all(weights[:, LIMIT:] == -np.inf)
    p = np.exp(weights - weights.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(p[:, :LIMIT], reference(LOGITS, temperature, top_k, top_p),
                               rtol=2e-5, atol=1e-30)
    unlimited = np.asarray(log_weights(jnp.asarray(LOGITS), Sampling(temperature, top_k, top_p)))
    assert np.isfinite(unlimited[:, LIMIT:]).any()      # without the limit they would be drawn


def test_greedy_and_draws_never_pick_a_padded_id():
    greedy = np.asarray(next_token(jnp.asarray(LOGITS), jax.random.key(0),
                                   Sampling(vocab_limit=LIMIT)))
    np.testing.assert_array_equal(greedy, np.argmax(LOGITS[:, :LIMIT], axis=-1))
    assert np.all(np.asarray(next_token(jnp.asarray(LOGITS), jax.random.key(0), Sampling()))
                  >= LIMIT)
    batch = jnp.asarray(np.repeat(LOGITS[:1], 4096, axis=0))
    keys = jax.random.split(jax.random.key(1), 4096)
    drawn = np.asarray(jax.jit(lambda x, k: next_token(x, k, Sampling(1.0, vocab_limit=LIMIT)))(
        batch, keys))
    assert drawn.max() < LIMIT and len(np.unique(drawn)) > 5


def test_a_limit_of_the_whole_vocabulary_changes_nothing():
    np.testing.assert_array_equal(
        np.asarray(log_weights(jnp.asarray(LOGITS), Sampling(0.8, 7, vocab_limit=VOCAB))),
        np.asarray(log_weights(jnp.asarray(LOGITS), Sampling(0.8, 7))))


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "40"])
def test_bad_vocab_limit_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"vocab_limit=.*accepted: None or an integer >= 1"):
        Sampling(vocab_limit=value)


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both_sizes():
    with pytest.raises(ValueError, match=r"vocab_limit=600 .* at most the model's vocab_size=512"):
        check_request([np.array([1, 2])], 4, 16, 512, temperature=0.0, top_k=None, top_p=None,
                      eos_id=None, seed=0, vocab_limit=600)


def test_the_jobs_sampler_refuses_a_tokenizer_larger_than_the_model():
    from types import SimpleNamespace

    from zeroxla.app.sampling import sample_with_engine
    from zeroxla.app.tokenizers.basic import ByteTokenizer

    step = SimpleNamespace(layout=SimpleNamespace(vocab_size=200))     # no compute is reached
    with pytest.raises(ValueError, match=r"the tokenizer has 256 ids but the model's vocab_size "
                       r"is 200: it has no logits for ids 200..255"):
        sample_with_engine(step, None, ByteTokenizer(), np.array([1]), num_tokens=4, max_len=8)
