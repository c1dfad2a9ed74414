"""Sampling follows its definitions: top-k=1 is greedy; temperature and top-p frequencies over
many draws match the analytic distribution on a toy vocabulary; the distribution and the tokens
top-k / top-p keep match a float64 numpy reference, on both sides of the temperatures float32
cannot carry (below 2**-126: greedy; beyond float32's max: uniform over the kept tokens)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.inference.sampling import Sampling, log_weights, next_token
from zeroxla.inference.sampling import FLOAT32_MAX, FLOAT32_TINY

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


# ---- the distribution against a float64 reference --------------------------------------------

LOGITS = (np.random.default_rng(0).normal(size=(16, 100)) * 2).astype(np.float32)   # [B, V]
BELOW_TINY = float(np.nextafter(FLOAT32_TINY, 0))
ABOVE_MAX = float(np.nextafter(FLOAT32_MAX, np.inf))
E_SWITCH = 2.0 ** 127            # `scaled_logits` changes its power-of-two split here


def reference(logits, temperature, top_k=None, top_p=None):
    """float64 numpy, Hugging Face's order (temperature, top-k, top-p), row by row: (probs
    [B, V], the tokens the filters keep [B, V], the smallest distance of a cumulative mass to
    top_p [B]). Ties are kept, at the k-th logit and at the nucleus cutoff."""
    probs, kept, margins = [], [], []
    for row in np.asarray(logits, np.float64):
        keep = np.ones(row.shape, bool)
        if top_k is not None:
            keep = row >= np.sort(row)[::-1][min(top_k, row.size) - 1]
        with np.errstate(over="ignore"):             # -inf: a probability of 0
            z = np.where(keep, (row - row.max()) / temperature, -np.inf)
        margin = np.inf
        if top_p is not None:
            order = np.argsort(-row, kind="stable")
            mass = np.exp(z[order]) / np.exp(z[order]).sum()
            before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
            keep &= row >= row[order][np.sum(before < top_p) - 1]
            z = np.where(keep, z, -np.inf)
            margin = np.min(np.abs(before - top_p))
        p = np.exp(z - z.max())
        probs.append(p / p.sum())
        kept.append(keep)
        margins.append(margin)
    return np.array(probs), np.array(kept), np.array(margins)


def ours(logits, sampling):
    """(probs float64 [B, V] = softmax of our float32 log-weights, the tokens kept [B, V])."""
    weights = np.asarray(log_weights(jnp.asarray(logits), sampling), np.float64)    # eager
    p = np.exp(weights - weights.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True), np.isfinite(weights)


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 3.0, 1e3])
@pytest.mark.parametrize("top_k,top_p", [(None, None), (5, None), (1, None), (None, 0.3),
                                         (None, 0.9), (12, 0.6)])
def test_distribution_and_kept_tokens_match_float64(temperature, top_k, top_p):
    expected, kept, margins = reference(LOGITS, temperature, top_k, top_p)
    # a cumulative mass within float32's cumsum error of top_p (100 terms: < 100 * 2**-24)
    # could flip a token either way: the inputs keep clear of it, so the keep sets must agree
    assert margins.min() > 100 * 2.0 ** -24
    probs, our_kept = ours(LOGITS, Sampling(temperature, top_k, top_p))
    np.testing.assert_array_equal(our_kept, kept)
    np.testing.assert_allclose(probs, expected, rtol=2e-5, atol=1e-30)


TINY_GAPS = np.array([[0.0, -2.0 ** -125, -1.5 * 2.0 ** -124, -2.0 ** -123]], np.float32)


@pytest.mark.parametrize("temperature", [FLOAT32_TINY, 1.5 * FLOAT32_TINY, 2.0 ** -120])
def test_smallest_computed_temperature_matches_float64(temperature):
    """Logits 2**-125 apart: at T = 2**-126 the distribution is far from greedy (probabilities
    e^0, e^-2, e^-3, e^-4), and float32 computes it, no inf, no NaN."""
    expected, _, _ = reference(TINY_GAPS, temperature)
    assert expected[0, 1] > 0.05 or temperature > FLOAT32_TINY
    probs, _ = ours(TINY_GAPS, Sampling(temperature))
    np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("temperature", [BELOW_TINY, 1e-39, 1e-45, 5e-324])
def test_below_float32_normals_is_greedy_and_float64_agrees(temperature):
    """Below 2**-126 the draw is greedy (the rule); for logits whose gaps exceed 745 T (any
    model's) float64's softmax(logits / T) is the same one-hot."""
    expected, _, _ = reference(LOGITS, temperature)
    greedy = np.argmax(LOGITS, axis=-1)
    np.testing.assert_array_equal(expected, np.eye(LOGITS.shape[1])[greedy])
    probs, _ = ours(LOGITS, Sampling(temperature))
    np.testing.assert_array_equal(probs, expected)
    keys = jax.random.split(jax.random.key(5), LOGITS.shape[0])
    np.testing.assert_array_equal(next_token(jnp.asarray(LOGITS), keys, Sampling(temperature)),
                                  greedy)


HUGE = np.array([[3e38, -3e38, 0.0, 1e38, -1e38]], np.float32)   # spread 6e38 > float32's max


@pytest.mark.parametrize("logits", [LOGITS, HUGE], ids=["ordinary", "huge"])
@pytest.mark.parametrize("temperature", [1e30, 1e38, E_SWITCH, float(np.nextafter(E_SWITCH,
                                                                                np.inf)),
                                         3e38, FLOAT32_MAX])
def test_largest_computed_temperatures_match_float64(logits, temperature):
    """Up to float32's max the distribution is computed, on both sides of the switch of the
    power-of-two split, even for logits whose spread no float32 holds."""
    expected, _, _ = reference(logits, temperature)
    probs, _ = ours(logits, Sampling(temperature))
    np.testing.assert_allclose(probs, expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("temperature", [ABOVE_MAX, 1e300, 1.7e308])
@pytest.mark.parametrize("top_k,top_p,kept", [(None, None, 100), (3, None, 3), (None, 0.455, 46),
                                              (10, 0.45, 5)])
def test_beyond_float32_is_uniform_over_the_kept_and_float64_agrees(temperature, top_k, top_p,
                                                                     kept):
    expected, expected_kept, margins = reference(LOGITS, temperature, top_k, top_p)
    assert margins.min() > 1e-3 and np.all(expected_kept.sum(axis=-1) == kept)
    np.testing.assert_array_equal(expected, expected_kept / kept)        # float64: uniform too
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no NumPy overflow casting T to float32
        probs, our_kept = ours(LOGITS, Sampling(temperature, top_k, top_p))
    np.testing.assert_array_equal(our_kept, expected_kept)
    np.testing.assert_allclose(probs, expected, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1e-45, FLOAT32_TINY, 1e-3, 1.0, 1e4, 1e38,
                                         FLOAT32_MAX, ABOVE_MAX, 1e300])
def test_top_k_one_is_argmax_at_any_temperature(temperature):
    keys = jax.random.split(jax.random.key(11), LOGITS.shape[0])
    tokens = jax.jit(lambda x, k: next_token(x, k, Sampling(temperature, top_k=1)))(
        jnp.asarray(LOGITS), keys)
    np.testing.assert_array_equal(tokens, np.argmax(LOGITS, axis=-1))


def test_draws_at_the_smallest_temperature_follow_float64():
    """Drawn, not only computed: at T = 2**-126 the tokens of TINY_GAPS come with the float64
    frequencies (e^0 : e^-2 : e^-3 : e^-4), where the unshifted logits / T would overflow."""
    expected, _, _ = reference(TINY_GAPS, FLOAT32_TINY)
    np.testing.assert_allclose(frequencies(Sampling(FLOAT32_TINY), TINY_GAPS[0]), expected[0],
                               atol=0.015)


def test_draws_beyond_float32_are_uniform_over_top_k():
    """The issue's temperature=1e300 (and 1e38 with top_k=1 drew from every token): uniform
    over the 3 kept tokens, nothing else."""
    expected = np.where(np.isin(np.arange(6), [0, 1, 2]), 1 / 3, 0)
    np.testing.assert_allclose(frequencies(Sampling(1e300, top_k=3)), expected, atol=0.015)
