"""Sampling follows its definitions: top-k=1 is greedy; temperature and top-p frequencies over
many draws match the analytic distribution on a toy vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.inference.sampling import Sampling, next_token

DRAWS = 20000
TOY = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))     # logits of a known distribution


def frequencies(sampling, logits=TOY, seed=0):
    batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (DRAWS, len(logits)))
    # logits passed as an argument, not closed over: XLA would constant-fold the whole draw
    tokens = jax.jit(lambda x, k: next_token(x, k, sampling))(batch, jax.random.key(seed))
    return np.bincount(np.asarray(tokens), minlength=len(logits)) / DRAWS


def test_top_k_one_is_greedy():
    logits = jax.random.normal(jax.random.key(3), (64, 50))
    greedy = next_token(logits, jax.random.key(0), Sampling())
    top1 = next_token(logits, jax.random.key(7), Sampling(temperature=1.3, top_k=1))
    np.testing.assert_array_equal(top1, greedy)
    np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies(temperature):
    expected = np.exp(TOY / temperature)
    expected /= expected.sum()
    np.testing.assert_allclose(frequencies(Sampling(temperature=temperature)), expected,
                               atol=0.015)


@pytest.mark.parametrize("top_p,kept", [(0.5, 2), (0.65, 2), (0.66, 3), (0.95, 5), (1.0, 6)])
def test_top_p_frequencies(top_p, kept):
    # nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p
    probs = np.exp(TOY)
    expected = np.where(np.arange(len(TOY)) < kept, probs, 0)
    expected /= expected.sum()
    assert np.cumsum(probs)[kept - 1] >= top_p - 1e-9 and (kept == 1 or
                                                             np.cumsum(probs)[kept - 2] < top_p)
    np.testing.assert_allclose(frequencies(Sampling(temperature=1.0, top_p=top_p)), expected,
                               atol=0.015)


def test_top_k_frequencies():
    probs = np.exp(TOY)
    expected = np.where(np.arange(len(TOY)) < 3, probs, 0)
    expected /= expected.sum()
    np.testing.assert_allclose(frequencies(Sampling(temperature=1.0, top_k=3)), expected,
                               atol=0.015)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1.0}, "temperature=-1.0"), ({"top_k": 0}, "top_k=0"),
    ({"top_p": 0.0}, "top_p=0.0"), ({"top_p": 1.5}, "top_p=1.5")])
def test_bad_knobs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + ".*accepted"):
        Sampling(**kwargs)
