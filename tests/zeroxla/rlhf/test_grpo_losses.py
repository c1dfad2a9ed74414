"""The GRPO family's advantages and loss (zeroxla/rlhf/grpo/group_advantages.py, losses.py)
against float64 numpy written here from TRL's `GRPOTrainer` definitions, as loops: every
--loss-type x --scale-rewards (and RLOO's baseline), clip-higher binding, the k3 KL, and mu = 2
policy updates of a free-logits policy (the second update is where the clip binds), loss and
gradient at rtol 1e-5."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroxla import rlhf
from zeroxla.rlhf.grpo.group_advantages import group_advantages
from zeroxla.rlhf.grpo.losses import clip_fractions, grpo_loss

G = 4                           # answers per prompt
B, T = 3 * G, 6                 # rows, answer tokens
EPS, EPS_HIGH = 0.2, 0.28
RTOL, ATOL = 1e-5, 1e-7


# ---- numpy float64 references -----------------------------------------------------------------
def np_advantages(rewards, g, scale, baseline):
    out = np.zeros(len(rewards))
    for p in range(len(rewards) // g):
        group = [float(r) for r in rewards[p * g:(p + 1) * g]]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            base = sum(others) / (g - 1) if baseline == "rloo" else sum(group) / g
            out[p * g + i] = r - base
        if scale == "group":
            mean = sum(group) / g
            std = (sum((r - mean) ** 2 for r in group) / (g - 1)) ** 0.5
            out[p * g:(p + 1) * g] /= std + 1e-4
    if scale == "batch":
        r = np.asarray(rewards, np.float64)
        out /= np.sqrt(np.sum((r - r.mean()) ** 2) / (len(r) - 1)) + 1e-4
    return out


def np_loss_and_grad(logp, old, adv, mask, ref, loss_type, eps, eps_high, beta):
    """(loss, d loss / d logp [B, T]) in float64."""
    rows, cols = logp.shape
    terms, dterms = np.zeros((rows, cols)), np.zeros((rows, cols))
    for b, t in itertools.product(range(rows), range(cols)):
        r = np.exp(logp[b, t] - old[b, t])
        c = min(max(r, 1 - eps), 1 + eps_high)
        a = adv[b]
        if r * a <= c * a:               # the unclipped branch is the smaller: it carries the grad
            terms[b, t], dterms[b, t] = -r * a, -r * a
        else:
            terms[b, t], dterms[b, t] = -c * a, 0.0
        if beta:
            d = ref[b, t] - logp[b, t]
            terms[b, t] += beta * (np.exp(d) - d - 1)
            dterms[b, t] += beta * (1 - np.exp(d))
    weights = np.zeros((rows, cols))
    for b, t in itertools.product(range(rows), range(cols)):
        if mask[b, t]:
            weights[b, t] = {"grpo": 1 / (rows * mask[b].sum()),
                             "dr_grpo": 1 / (rows * cols),
                             "dapo": 1 / mask.sum()}[loss_type]
    return float(np.sum(terms * weights)), dterms * weights


# ---- a fixed rollout ----------------------------------------------------------------------------
def rollout():
    """Rewards with one all-equal group; ratios on a grid from 0.6 to 1.5 (some in (1.2, 1.28),
    where only clip-higher lets the gradient through); answers of different lengths."""
    rng = np.random.default_rng(0)
    rewards = np.concatenate([[1.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5],
                              rng.standard_normal(G)])
    old = -rng.uniform(0.1, 3.0, (B, T))
    ratios = np.linspace(0.6, 1.5, B * T).reshape(B, T)
    ratios = rng.permuted(ratios.ravel()).reshape(B, T)
    ratios[0, 0] = 1.25          # row 0 has A > 0 (reward 1 in [1, 0, 1, 1]) and >= 1 token
    logp = old + np.log(ratios)
    ref = logp + rng.normal(0, 0.3, (B, T))
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)
    return rewards, logp, old, ref, mask


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["grpo", "rloo"])
def test_advantages_match_numpy(scale, baseline):
    rewards = rollout()[0]
    got = group_advantages(jnp.asarray(rewards, jnp.float32), G, scale_rewards=scale,
                           advantage=baseline)
    np.testing.assert_allclose(np.asarray(got), np_advantages(rewards, G, scale, baseline),
                               rtol=RTOL, atol=1e-6)
    assert np.all(np.asarray(got)[G:2 * G] == 0.0)        # the equal group: exactly 0, no NaN


def test_equal_rewards_everywhere_give_zero_advantage():
    for scale in ("group", "batch", "none"):
        got = np.asarray(group_advantages(jnp.full((8,), 0.3), 4, scale_rewards=scale))
        assert np.all(got == 0.0), (scale, got)


def test_one_generation_is_refused():
    with pytest.raises(ValueError, match="num_generations=1 is invalid.*>= 2"):
        rlhf.GRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="num_generations=1 is invalid"):
        group_advantages(jnp.zeros(4), 1)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_match_numpy(loss_type, scale, beta):
    rewards, logp, old, ref, mask = rollout()
    adv = np_advantages(rewards, G, scale, "grpo")
    want, want_grad = np_loss_and_grad(logp, old, adv, mask, ref, loss_type, EPS, EPS_HIGH, beta)
    f32 = lambda x: jnp.asarray(x, jnp.float32)          # noqa: E731

    def loss(lp):
        return grpo_loss(lp, f32(old), group_advantages(f32(rewards), G, scale_rewards=scale),
                         f32(mask), loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH,
                         beta=beta, ref_logprobs=f32(ref))

    got, grad = jax.value_and_grad(loss)(f32(logp))
    np.testing.assert_allclose(float(got), want, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=RTOL, atol=ATOL)


def test_clip_higher_binds():
    """Tokens with A > 0 and a ratio in (1 + epsilon, 1 + epsilon_high] keep their gradient only
    with clip-higher: the two losses and gradients differ, and each matches numpy."""
    rewards, logp, old, ref, mask = rollout()
    adv = np_advantages(rewards, G, "group", "grpo")
    ratio = np.exp(logp - old)
    assert np.any((ratio > 1 + EPS) & (ratio <= 1 + EPS_HIGH) & (adv[:, None] > 0) & (mask > 0))
    grads = {}
    for high in (EPS, EPS_HIGH):
        want, want_grad = np_loss_and_grad(logp, old, adv, mask, ref, "dapo", EPS, high, 0.0)
        got, grads[high] = jax.value_and_grad(lambda lp: grpo_loss(
            lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
            jnp.asarray(mask, jnp.float32), loss_type="dapo", epsilon=EPS,
            epsilon_high=high))(jnp.asarray(logp, jnp.float32))
        np.testing.assert_allclose(float(got), want, rtol=RTOL)
        np.testing.assert_allclose(np.asarray(grads[high]), want_grad, rtol=RTOL, atol=ATOL)
    assert not np.allclose(grads[EPS], grads[EPS_HIGH])
    fractions = clip_fractions(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                               jnp.asarray(mask), epsilon=EPS, epsilon_high=EPS_HIGH)
    real = mask > 0
    want_high = np.sum((ratio > 1 + EPS_HIGH) & (adv[:, None] > 0) & real) / real.sum()
    want_low = np.sum((ratio < 1 - EPS) & (adv[:, None] < 0) & real) / real.sum()
    np.testing.assert_allclose(float(fractions["clip_high"]), want_high, rtol=RTOL)
    np.testing.assert_allclose(float(fractions["clip_low"]), want_low, rtol=RTOL)


def np_log_softmax(logits):
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_two_policy_updates_match_numpy(loss_type):
    """mu = 2: a policy of free logits [B, T, V] takes two SGD steps on one rollout, the old
    log-probs fixed at the rollout's. At the first step the ratio is 1 and nothing clips; the
    step is large enough that the second one clips (checked)."""
    rewards, _, _, ref, mask = rollout()
    vocab, lr, beta = 5, 40.0, 0.04
    rng = np.random.default_rng(1)
    logits0 = rng.standard_normal((B, T, vocab))
    tokens = rng.integers(0, vocab, (B, T))
    onehot = np.eye(vocab)[tokens]                                        # [B, T, V]
    adv = np_advantages(rewards, G, "group", "rloo")
    old = np.sum(np_log_softmax(logits0) * onehot, -1)

    def np_step(logits):
        logp = np.sum(np_log_softmax(logits) * onehot, -1)
        loss, dlogp = np_loss_and_grad(logp, old, adv, mask, ref, loss_type, EPS, EPS_HIGH, beta)
        probs = np.exp(np_log_softmax(logits))
        return loss, dlogp[..., None] * (onehot - probs), logp

    def jax_loss(logits):
        logp = jnp.sum(jax.nn.log_softmax(logits) * jnp.asarray(onehot, jnp.float32), -1)
        return grpo_loss(logp, jnp.asarray(old, jnp.float32),
                         group_advantages(jnp.asarray(rewards, jnp.float32), G, advantage="rloo"),
                         jnp.asarray(mask, jnp.float32), loss_type=loss_type, epsilon=EPS,
                         epsilon_high=EPS_HIGH, beta=beta,
                         ref_logprobs=jnp.asarray(ref, jnp.float32))

    np_logits, jax_logits = logits0, jnp.asarray(logits0, jnp.float32)
    for update in range(2):
        want, want_grad, logp = np_step(np_logits)
        got, grad = jax.value_and_grad(jax_loss)(jax_logits)
        np.testing.assert_allclose(float(got), want, rtol=RTOL)
        np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4 if update else RTOL,
                                   atol=1e-6)
        ratio = np.exp(logp - old)[mask > 0]
        clipped = np.any((ratio < 1 - EPS) | (ratio > 1 + EPS_HIGH))
        assert clipped == (update == 1), (update, ratio.min(), ratio.max())
        np_logits, jax_logits = np_logits - lr * want_grad, jax_logits - lr * grad
