"""The train/rollout log-prob gap and truncated importance sampling
(zeroxla/rlhf/rollout_correction.py), and the log-probs the rollout engine reports
(`sampling.sampled_logprobs`), against float64 numpy written here: the TIS weights
min(exp(train_old - rollout), cap) (TRL's `vllm_importance_sampling_cap`), the gap metrics
over the real tokens, the GRPO loss and gradient with the weights, and the log-probability of
a drawn token under the temperature-scaled, vocabulary-limited, top-k / top-p filtered
distribution."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla.inference.sampling import Sampling, next_token, sampled_logprobs
from zeroxla.rlhf.grpo.losses import grpo_loss
from zeroxla.rlhf.rollout_correction import logprob_gap, tis_clipped_fraction, tis_weights

RNG = np.random.default_rng(0)
B, T = 6, 5
TRAIN = -RNG.uniform(0.05, 3.0, (B, T)).astype(np.float32)
# rollout = train + a gap: mostly ulp-sized, a few over 1e-3, two large (ratios past the cap)
GAP = RNG.choice([0.0, 2e-7, -4e-7, 5e-3, -2e-3], (B, T)).astype(np.float32)
GAP[0, 0], GAP[1, 2] = -1.2, 0.9                     # exp(1.2) = 3.3 > cap; exp(-0.9) < 1
ROLLOUT = TRAIN + GAP
MASK = (np.arange(T)[None] < RNG.integers(1, T + 1, B)[:, None]).astype(np.float32)
MASK[0, 0] = MASK[1, 2] = 1.0
CAP = 2.0


def test_tis_weights_match_float64_numpy():
    want = np.minimum(np.exp(TRAIN.astype(np.float64) - ROLLOUT.astype(np.float64)), CAP)
    got = np.asarray(tis_weights(TRAIN, ROLLOUT, CAP))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0, 0] == np.float32(CAP) and got[1, 2] < 1       # the cap binds / a ratio < 1
    np.testing.assert_allclose(float(tis_clipped_fraction(TRAIN, ROLLOUT, MASK, CAP)),
                               np.mean([np.exp(float(TRAIN[b, t]) - float(ROLLOUT[b, t])) > CAP
                                        for b, t in zip(*np.nonzero(MASK))]), rtol=1e-6)
    with pytest.raises(ValueError, match="cap=0 is invalid"):
        tis_weights(TRAIN, ROLLOUT, 0)


def test_logprob_gap_matches_numpy():
    real = [abs(float(TRAIN[b, t]) - float(ROLLOUT[b, t])) for b, t in zip(*np.nonzero(MASK))]
    got = {k: float(v) for k, v in logprob_gap(TRAIN, ROLLOUT, MASK).items()}
    np.testing.assert_allclose(got["max"], max(real), rtol=1e-6)
    np.testing.assert_allclose(got["mean_abs"], np.mean(real), rtol=1e-5)
    np.testing.assert_allclose(got["frac_over_1e-3"], np.mean([g > 1e-3 for g in real]),
                               rtol=1e-6)
    padded = np.where(MASK > 0, ROLLOUT, 50.0)       # padding's values never count
    assert {k: float(v) for k, v in logprob_gap(TRAIN, padded, MASK).items()} == got
    zero = logprob_gap(TRAIN, TRAIN, MASK)
    assert all(float(v) == 0.0 for v in zero.values())


def test_grpo_loss_with_tis_weights_matches_numpy():
    """The dapo loss (beta 0.04) with every token's term, KL included, times its weight: loss
    and gradient against float64 loops."""
    old = TRAIN.astype(np.float64)
    logp = old + RNG.uniform(-0.3, 0.3, (B, T))
    ref = logp + RNG.normal(0, 0.3, (B, T))
    adv = RNG.standard_normal(B)
    w = np.minimum(np.exp(old - ROLLOUT.astype(np.float64)), CAP)
    eps, eps_high, beta = 0.2, 0.28, 0.04
    loss, grad = 0.0, np.zeros((B, T))
    for b, t in itertools.product(range(B), range(T)):
        if not MASK[b, t]:
            continue
        r = np.exp(logp[b, t] - old[b, t])
        c = min(max(r, 1 - eps), 1 + eps_high)
        term, dterm = (-r * adv[b], -r * adv[b]) if r * adv[b] <= c * adv[b] \
            else (-c * adv[b], 0.0)
        d = ref[b, t] - logp[b, t]
        term, dterm = term + beta * (np.exp(d) - d - 1), dterm + beta * (1 - np.exp(d))
        loss += w[b, t] * term / MASK.sum()
        grad[b, t] = w[b, t] * dterm / MASK.sum()
    f32 = lambda x: jnp.asarray(x, jnp.float32)          # noqa: E731
    got, got_grad = jax.value_and_grad(lambda lp: grpo_loss(
        lp, f32(old), f32(adv), f32(MASK), loss_type="dapo", epsilon=eps, epsilon_high=eps_high,
        beta=beta, ref_logprobs=f32(ref), is_weights=tis_weights(TRAIN, ROLLOUT, CAP)))(f32(logp))
    np.testing.assert_allclose(float(got), loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_grad), grad, rtol=1e-5, atol=1e-7)


def np_sampled_logprob(logits, token, temperature, top_k, top_p, limit):
    """float64: log p(token) under softmax(logits / temperature) over the ids below `limit`,
    restricted to the top_k largest (ties kept) and then to the nucleus of mass top_p."""
    z = logits.astype(np.float64)[:limit]
    keep = np.ones(limit, bool)
    if top_k is not None:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp((z - z[keep].max()) / temperature), 0.0)
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(-z, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        cutoff = z[order][np.sum(before < top_p) - 1]
        p = np.where(z >= cutoff, p, 0.0)
        p /= p.sum()
    return np.log(p[token])


@pytest.mark.parametrize("temperature,top_k,top_p,limit", [
    (1.0, None, None, None), (0.7, None, None, 20), (1.3, 5, None, 20), (0.8, None, 0.9, None),
    (1.0, 6, 0.8, 24)])
def test_sampled_logprobs_match_numpy(temperature, top_k, top_p, limit):
    """The log-probability the engine reports for a drawn token is the one of the distribution
    the draw used; greedy reports 0."""
    v = 32
    logits = RNG.normal(size=(8, v)).astype(np.float32) * 2
    sampling = Sampling(temperature, top_k, top_p, limit)
    tokens = next_token(jnp.asarray(logits), jax.random.split(jax.random.key(1), 8), sampling)
    got = np.asarray(sampled_logprobs(jnp.asarray(logits), tokens, sampling))
    want = [np_sampled_logprob(logits[b], int(tokens[b]), temperature, top_k, top_p, limit or v)
            for b in range(8)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    greedy = sampled_logprobs(jnp.asarray(logits), jnp.argmax(logits, -1), Sampling(0.0))
    assert np.all(np.asarray(greedy) == 0.0)
