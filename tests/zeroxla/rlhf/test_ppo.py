"""The PPO loop (zeroxla/rlhf) against DeepSpeed-Chat's definitions, recomputed here in numpy
float64 from the same rollout arrays: per-token rewards (KL penalty + clipped score on the last
answer token), GAE advantages and returns, the KL and reward records, and every PPO epoch's
losses (3 epochs per rollout: the first at the rollout's weights, where the ratio is 1, the
later ones where ratio and value clipping act, from the weights each epoch's step started at).
The formulas below are written from `dschat/rlhf/ppo_trainer.py` as loops, not by calling the
package's functions. The scores come from a learned-reward stand-in: a `RewardModel` (a GPT trunk
with a random head), read at each answer's last real token as DeepSpeed-Chat does."""

import jax
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models, rlhf
from zeroxla.app import data

CONFIG = rlhf.PPOConfig(kl_ctl=0.2, clip_reward_value=0.25, cliprange=0.2, cliprange_value=0.2,
                        gamma=0.9, lam=0.8, ppo_epochs=3, actor_lr=3e-3, critic_lr=3e-3,
                        prompts_per_iteration=16, prompt_length=8, answer_length=12)


def reward_model():
    """A RewardModel on its own random GPT with a random head: scores of order 1, both signs."""
    model = rlhf.RewardModel(models.build("gpt-tiny", seed=7))
    head = np.random.default_rng(7).standard_normal(model.v_head[...].shape)
    model.v_head[...] = jax.numpy.asarray(head, jax.numpy.float32)
    return model


@nnx.jit
def forward(model, tokens):
    """`model(tokens)` as one program (the references' forwards, not op by op)."""
    return model(tokens)


# ---- numpy float64 references ---------------------------------------------------------------
def np_rewards(logprobs, ref_logprobs, scores, mask, kl_ctl, clip):
    rewards = np.zeros(logprobs.shape)
    for b in range(logprobs.shape[0]):
        n = int(mask[b].sum())
        for t in range(n):
            rewards[b, t] = -kl_ctl * (float(logprobs[b, t]) - float(ref_logprobs[b, t]))
        rewards[b, n - 1] += min(max(float(scores[b]), -clip), clip)
    return rewards


def np_advantages_and_returns(values, rewards, mask, gamma, lam):
    advantages, returns = np.zeros(values.shape), np.zeros(values.shape)
    for b in range(values.shape[0]):
        n = int(mask[b].sum())
        lastgaelam = 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages[b, t] = lastgaelam
            returns[b, t] = lastgaelam + float(values[b, t])
    return advantages, returns


def np_log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# ---- two PPO iterations -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


class EpochRecorder:
    """Stands in for a trainer's `make_step` during `train_rlhf`: before each epoch's step it
    runs the weights that step starts from (gathered, one device) on the rollout's tokens
    [B, P+G-1] -> outputs (actor logits [B, P+G-1, V] / critic values [B, P+G-1]); after it,
    keeps the loss the step reports."""

    def __init__(self, step, tokens):
        self.step, self.tokens, self.outputs, self.losses = step, tokens, [], []
        self.layout = step.layout          # the trainer packs its batches by the step's layout

    def __call__(self, state, batch, **options):
        model = zeroxla.gathered_model(state)        # on the rollout's padded rows (the step
        self.outputs.append(np.asarray(forward(      # itself trains on them packed)
            model, jax.numpy.asarray(self.tokens[:, :-1]))))
        state, metrics = self.step(state, batch, **options)
        self.losses.append(float(metrics["loss"]))
        return state, metrics


@pytest.fixture(scope="module")
def ppo(corpus):
    """Two iterations of `run_ppo`, with each `train_rlhf` call's epochs recorded:
    (run, eos, [(actor EpochRecorder, critic EpochRecorder, returned losses)] per iteration)."""
    eos = int(corpus.tokenizer.encode(" ")[0])      # a random model ends some answers early
    actor = models.build("gpt-tiny", seed=0)
    epochs = []
    train_rlhf = rlhf.PPOTrainer.train_rlhf

    def recorded(trainer, rollout, overlap=None):
        steps = trainer.actor_step, trainer.critic_step
        trainer.actor_step, trainer.critic_step = (EpochRecorder(step, rollout.tokens)
                                                   for step in steps)
        try:
            losses = train_rlhf(trainer, rollout, overlap)
            epochs.append((trainer.actor_step, trainer.critic_step, losses))
        finally:
            trainer.actor_step, trainer.critic_step = steps
        return losses

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rlhf.PPOTrainer, "train_rlhf", recorded)
        run = rlhf.run_ppo(CONFIG, 2, actor, mesh=zeroxla.make_mesh(nodes=2, local=4),
                           tokenizer=corpus.tokenizer, prompt_tokens=corpus.val, eos_id=eos,
                           reward_model=reward_model(), seed=0)
    return run, eos, epochs


def test_two_iterations_match_numpy(ppo, corpus):
    run, eos, epochs = ppo
    assert len(run.records) == len(run.rollouts) == 2
    c, p, g = CONFIG, CONFIG.prompt_length, CONFIG.answer_length
    masks = np.concatenate([r.action_mask for r in run.rollouts])
    scorer = reward_model()
    assert masks.min() == 0, "no answer ended early: the masks are not exercised"
    for record, r, (actor, critic, _) in zip(run.records, run.rollouts, epochs):
        assert r.tokens.shape == (c.prompts_per_iteration, p + g)
        values = np.asarray(forward(scorer, jax.numpy.asarray(r.tokens)))       # [B, P + G]
        for b in range(r.tokens.shape[0]):
            n = int(r.action_mask[b].sum())
            answer = r.tokens[b, p:p + n]
            # the mask is the prefix up to and including the first EOS (or all G tokens)
            assert np.array_equal(r.action_mask[b], np.arange(g) < n)
            assert n == g or answer[-1] == eos
            assert eos not in answer[:-1]
            assert np.all(r.tokens[b, p + n:] == 0)
            text = corpus.tokenizer.decode(answer)
            assert r.texts[b] == text
            # the reward model's value at the answer's last real token (prompt + n - 1)
            np.testing.assert_allclose(r.scores[b], values[b, p + n - 1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(record["reward"], np.mean(r.scores, dtype=np.float64),
                                   rtol=1e-6)
        mask = r.action_mask.astype(np.float64)
        kl = np.sum((r.logprobs.astype(np.float64) - r.ref_logprobs) * mask) / mask.sum()
        np.testing.assert_allclose(record["kl"], kl, rtol=1e-5, atol=1e-7)
        # padding carries nothing
        for name in ("logprobs", "ref_logprobs", "values"):
            assert np.all(getattr(r, name)[mask == 0] == 0), name

        rewards = np_rewards(r.logprobs, r.ref_logprobs, r.scores, mask, c.kl_ctl,
                             c.clip_reward_value)
        np.testing.assert_allclose(r.rewards, rewards, rtol=1e-5, atol=1e-6)
        advantages, returns = np_advantages_and_returns(r.values, rewards, mask, c.gamma, c.lam)
        np.testing.assert_allclose(r.advantages, advantages, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r.returns, returns, rtol=1e-5, atol=1e-5)
        # the first epoch's ZeRO-3 step per model takes its loss at the rollout's own weights,
        # where the ratio is 1 and the values are the old values; a record holds the mean
        # loss over the epochs
        assert len(actor.losses) == len(critic.losses) == c.ppo_epochs
        np.testing.assert_allclose(actor.losses[0],
                                   -np.sum(advantages * mask) / mask.sum(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(critic.losses[0],
                                   0.5 * np.sum((r.values - returns) ** 2 * mask) / mask.sum(),
                                   rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(record["actor_loss"], np.mean(actor.losses), rtol=1e-6)
        np.testing.assert_allclose(record["critic_loss"], np.mean(critic.losses), rtol=1e-6)
    # the score is clipped at +-0.25 somewhere, so the clip is exercised
    assert max(np.abs(r.scores).max() for r in run.rollouts) > CONFIG.clip_reward_value


def test_reference_is_the_initial_actor_and_the_actor_moves(ppo):
    run, _, _ = ppo
    first, second = run.rollouts
    p, g = CONFIG.prompt_length, CONFIG.answer_length
    # reference log-probs, from the initial model (one device) and a float64 log-softmax
    initial = models.build("gpt-tiny", seed=0)
    for r in (first, second):
        tokens = jax.numpy.asarray(r.tokens[:, :-1])
        logits = np.asarray(forward(initial, tokens))[:, p - 1:]                 # [B, G, V]
        logp = np.take_along_axis(np_log_softmax(logits), r.tokens[:, p:, None], -1)[..., 0]
        np.testing.assert_allclose(r.ref_logprobs, logp * r.action_mask, rtol=1e-4, atol=1e-5)
    # before any update the actor is the reference; the critic's zero head gives zero values
    np.testing.assert_allclose(first.logprobs, first.ref_logprobs, rtol=1e-5, atol=1e-6)
    assert np.all(first.values == 0)
    assert run.records[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    # after one PPO iteration both have moved
    assert np.abs(second.logprobs - second.ref_logprobs).max() > 1e-3
    assert np.abs(second.values).max() > 1e-4
    split = rlhf.time_split(run.records)
    assert set(split) >= {"generation_s", "training_s", "generation_share", "training_share"}


def test_later_epochs_clip_the_ratio_and_the_values(ppo):
    """ppo_epochs = 3: from the second epoch on, the actor has moved off the rollout's policy,
    so some ratios leave [1 - eps, 1 + eps] (measured: 36-65% of the answer tokens at epochs
    2-3, none at epoch 1). Each epoch's reported loss is the clipped objective recomputed here
    in float64 from the weights that epoch's step started at, and clipping changes it; the
    critic's clipped value loss is checked the same way."""
    run, _, epochs = ppo
    p, c = CONFIG.prompt_length, CONFIG
    for r, (actor, critic, returned) in zip(run.rollouts, epochs):
        mask = r.action_mask.astype(np.float64)
        adv = r.advantages.astype(np.float64)
        old, old_values = r.logprobs.astype(np.float64), r.values.astype(np.float64)
        returns = r.returns.astype(np.float64)
        for epoch, (logits, values, actor_loss, critic_loss) in enumerate(zip(
                actor.outputs, critic.outputs, actor.losses, critic.losses)):
            logp = np.take_along_axis(np_log_softmax(logits[:, p - 1:]), r.tokens[:, p:, None],
                                      -1)[..., 0]
            ratio = np.exp((logp - old) * mask)
            clipped = np.clip(ratio, 1 - c.cliprange, 1 + c.cliprange)
            objective = np.sum(np.maximum(-adv * ratio, -adv * clipped) * mask) / mask.sum()
            np.testing.assert_allclose(actor_loss, objective, rtol=1e-4, atol=1e-6)
            fraction = np.sum((np.abs(ratio - 1) > c.cliprange) * mask) / mask.sum()
            v = values[:, p - 1:].astype(np.float64)
            v_clipped = np.clip(v, old_values - c.cliprange_value, old_values + c.cliprange_value)
            value_loss = 0.5 * np.sum(np.maximum((v - returns) ** 2, (v_clipped - returns) ** 2)
                                      * mask) / mask.sum()
            np.testing.assert_allclose(critic_loss, value_loss, rtol=1e-4, atol=1e-7)
            if epoch == 0:
                assert fraction == 0
                continue
            assert fraction > 0, (epoch, fraction)                   # the clip acts ...
            unclipped = -np.sum(adv * ratio * mask) / mask.sum()
            assert abs(objective - unclipped) > 1e-3 * abs(objective)   # ... and it changes
        np.testing.assert_allclose(returned, (np.mean(actor.losses), np.mean(critic.losses)),
                                   rtol=1e-6)


# ---- the losses on a hand-built example -------------------------------------------------------
def test_actor_and_critic_losses_match_numpy_with_clipping():
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], np.float32)
    old = np.array([[-1.0, -2.0, -0.5, -1.5, -1.0, -3.0], [-0.2, -1.0, -2.0, -1.0, -1.0, -1.0]],
                   np.float32)
    # log-ratios: inside the clip, above 1.2 and below 0.8, with both signs of advantage
    delta = np.array([[0.05, 0.5, -0.5, 0.5, -0.5, 2.0], [-0.1, 0.3, -0.3, 1.0, 1.0, 1.0]],
                     np.float32)
    adv = np.array([[1.0, 1.0, 1.0, -1.0, -1.0, 5.0], [-2.0, -0.5, 0.5, 3.0, 3.0, 3.0]],
                   np.float32)
    logprobs = old + delta
    expected_terms, hit = np.zeros(mask.shape), set()
    for b in range(2):
        for t in range(6):
            if not mask[b, t]:
                continue
            ratio = np.exp(float(delta[b, t]))
            clipped = min(max(ratio, 0.8), 1.2)
            expected_terms[b, t] = max(-adv[b, t] * ratio, -adv[b, t] * clipped)
            hit.add((ratio > 1.2, ratio < 0.8, adv[b, t] > 0,
                     -adv[b, t] * clipped > -adv[b, t] * ratio))
    assert {(True, False, True, True), (False, True, False, True)} <= hit   # clip binds
    assert {(True, False, False, False), (False, True, True, False)} <= hit  # clip does not
    expected = expected_terms.sum() / mask.sum()
    got = rlhf.actor_loss_fn(logprobs, old, adv, mask, cliprange=0.2)
    np.testing.assert_allclose(got, expected, rtol=1e-6)

    values = np.array([[0.0, 1.0, -1.0, 0.5, 0.3, 9.0], [0.1, 0.2, 0.3, 9.0, 9.0, 9.0]],
                      np.float32)
    old_values = np.array([[0.5, 0.5, -0.5, 0.45, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]],
                          np.float32)
    returns = np.array([[1.0, 0.0, 0.0, 0.6, 2.0, 0.0], [-1.0, 0.1, 0.0, 0.0, 0.0, 0.0]],
                       np.float32)
    total = 0.0
    for b in range(2):
        for t in range(6):
            if mask[b, t]:
                v, o, ret = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
                vc = min(max(v, o - 0.2), o + 0.2)
                total += 0.5 * max((v - ret) ** 2, (vc - ret) ** 2)
    got = rlhf.critic_loss_fn(values, old_values, returns, mask, cliprange_value=0.2)
    np.testing.assert_allclose(got, total / mask.sum(), rtol=1e-6)


def test_loss_fns_for_make_step_return_sum_and_count():
    """The make_step loss_fns read the batch and return (masked sum, real-token count). The
    batch is built around the model's own outputs so that each clip binds on some real tokens
    and not on others: ratios above 1 + eps and below 1 - eps with advantages of both signs,
    values above and below their clip range with returns on either side."""
    actor = models.build("gpt-tiny", seed=1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 65, (2, 10), dtype=np.int32)           # P = 6, G = 4
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.float32)
    logits = np.asarray(forward(actor, jax.numpy.asarray(tokens[:, :-1])))[:, 5:]
    logp = np.take_along_axis(np_log_softmax(logits), tokens[:, 6:, None], -1)[..., 0]
    # log-ratios: above 1.2 (0.5, 0.3), below 0.8 (-0.5, -0.4), inside (0.1); the padded
    # tokens' would bind too if the mask were ignored
    old = logp - np.array([[0.5, -0.5, 0.1, 0.5], [0.3, -0.4, 1.0, -1.0]])
    adv = np.array([[1.0, -1.0, 2.0, -1.0], [-1.0, 1.0, 3.0, -2.0]])
    ratio = np.exp(logp - old)
    unclipped = -adv * ratio
    terms = np.maximum(unclipped, -adv * np.clip(ratio, 0.8, 1.2))
    binds = (terms > unclipped + 1e-3) & (mask > 0)
    assert binds[0, 0] and binds[0, 1] and not binds[1].any()      # A > 0 above, A < 0 below
    s, n = rlhf.make_actor_loss(0.2)(actor, {"tokens": tokens, "old_logprobs": old,
                                             "advantages": adv, "action_mask": mask})
    np.testing.assert_allclose(s, np.sum(terms * mask), rtol=1e-4)
    assert float(n) == 6.0
    assert abs(np.sum(terms * mask) - np.sum(unclipped * mask)) > 0.1     # the clip matters

    critic = rlhf.Critic(actor)
    critic.v_head[...] = jax.numpy.asarray(rng.normal(size=60), jax.numpy.float32)
    values = np.asarray(forward(critic, jax.numpy.asarray(tokens[:, :-1])))[:, 5:].astype(
        np.float64)
    # V - V_old: outside +-0.2 both ways, inside; returns beyond V, or behind it (no bind)
    old_values = values - np.array([[0.5, -0.5, 0.1, 0.5], [-0.5, 0.3, 0.0, 0.0]])
    returns = values + np.array([[1.0, -1.0, 0.5, -1.0], [1.0, 0.5, 0.0, 0.0]])
    clipped = np.clip(values, old_values - 0.2, old_values + 0.2)
    unclipped = 0.5 * (values - returns) ** 2
    expected = np.maximum(unclipped, 0.5 * (clipped - returns) ** 2)
    binds = (expected > unclipped + 1e-3) & (mask > 0)
    assert binds[0, 0] and binds[0, 1] and binds[1, 1] and not binds[0, 3] and not binds[1, 0]
    s, n = rlhf.make_critic_loss(0.2)(critic, {"tokens": tokens, "old_values": old_values,
                                               "returns": returns, "action_mask": mask})
    np.testing.assert_allclose(s, np.sum(expected * mask), rtol=1e-4)
    assert float(n) == 6.0


# ---- reward and config ------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("aeiou", 1.0), ("xyz", 0.0), ("", 0.0), ("Hello world", 3 / 11), ("AEIOUbcdfg", 0.5),
    ("To be, or not to be", 6 / 19), ("\n\n", 0.0)])
def test_vowel_fraction_on_hand_written_strings(text, expected):
    assert rlhf.vowel_fraction(text) == pytest.approx(expected)
    np.testing.assert_allclose(rlhf.reward_scores([text, "a"]), [expected, 1.0], rtol=1e-6)


@pytest.mark.parametrize("field,value", [
    ("kl_ctl", -0.1), ("kl_ctl", "0.1"), ("clip_reward_value", 0), ("cliprange", -1),
    ("cliprange_value", None), ("gamma", 1.5), ("lam", -0.1), ("ppo_epochs", 0),
    ("ppo_epochs", 1.0), ("actor_lr", 0.0), ("critic_lr", -1e-3), ("prompts_per_iteration", 0),
    ("prompt_length", True), ("answer_length", 0), ("ppo_max_token_len_per_gpu", 0)])
def test_ppo_config_refuses_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=rf"PPOConfig\.{field}=.*accepted"):
        rlhf.PPOConfig(**{field: value})
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=64 .*packing=True"):
        rlhf.PPOConfig(packing=False, ppo_max_token_len_per_gpu=64)


def test_run_ppo_refuses_bad_iterations():
    with pytest.raises(ValueError, match="iterations=0"):
        rlhf.run_ppo(CONFIG, 0, None, mesh=None, tokenizer=None, prompt_tokens=np.zeros(100))


@pytest.mark.parametrize("iterations", [0, True, 1.5])
@pytest.mark.parametrize("run", ["grpo", "ppo"])
def test_a_run_refuses_an_iteration_count_that_is_not_a_positive_integer(run, iterations):
    """GRPO's and PPO's runs (`rlhf.iterations.check_iterations`), before anything is built."""
    inputs = {"prompts": []} if run == "grpo" else {"prompt_tokens": None}
    with pytest.raises(ValueError, match=rf"iterations={iterations!r} is invalid; accepted: "
                                         r"an integer >= 1"):
        getattr(rlhf, f"run_{run}")(None, iterations, None, mesh=None, tokenizer=None, **inputs)
