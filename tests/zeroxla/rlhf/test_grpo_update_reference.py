"""One GRPO update (`GRPOTrainer.train_grpo`) against a float64 reference of the whole update,
written here from the definitions of TRL's `GRPOTrainer` and the papers, not from zeroxla's
loss code:

- advantages: (r - group mean) / (group std + 1e-4) (Shao et al. 2024; TRL's
  `scale_rewards="group"`), `np_advantages` of test_grpo_losses.py;
- ratio r = exp(logp - old), the clipped objective -min(r A, clip(r, 1 - eps, 1 + eps_high) A)
  (PPO eq. 7; DAPO's clip-higher);
- the KL against the frozen REFERENCE: Schulman's k3, exp(ref - logp) - (ref - logp) - 1 (TRL's
  `per_token_kl`), times beta, added to the clipped term;
- truncated importance sampling: each token's term times min(exp(old - rollout), cap), the
  ratio of the trainer's "old" policy to the policy the rollout engine sampled from (TRL's
  `vllm_importance_sampling_correction`: `exp(old_per_token_logps - sampling_per_token_logps)`
  clamped at the cap, applied after the KL term is added);
- AReaL's decoupled PPO (`rollout_correction="decoupled"`, `ppo_actor_loss_fn` of
  inclusionAI/AReaL): the ratio against the proximal policy ("old": the trainer's forward),
  each token's clipped term times pi_prox / pi_behav of the version that drew it, a weight
  above `behav_imp_weight_cap` set to 0 (the token still counted), the KL term unweighted;
- DAPO's token-level mean, and one SGD step on the float64 gradient (`jax.grad` of this file's
  loss on a float64 copy of the model, one device).

The rollout is fixed here (tokens of prompts of different lengths, masks, rewards) with a
rollout gap injected by a known amount per token: the engine's log-probs sit 0.2 to 1.1 from
the trainer's (importance weights 0.33 to 3.0, cap 2: some truncated), the "old" log-probs
0.05 to 0.5 from the actor's (ratios on both sides of the clip), and the reference's 0.3 from
the actor's (KL on, beta 0.1). Each wiring bug planted by hand fails here: the KL taken
against the rollout's log-probs instead of the reference's, and the TIS weights with their
arguments swapped."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from test_grpo_losses import np_advantages
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.group_advantages import group_advantages
from zeroxla.rlhf.grpo.trainer import GRPORollout, GRPOTrainer

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
PROMPTS = [{"prompt": "12"}, {"prompt": "Mia has 4 pens?"}]       # 2 and 15 tokens
CONFIG = GRPOConfig(num_generations=4, prompts_per_iteration=2, prompt_length=15,
                    max_completion_length=5, beta=0.1, epsilon=0.2, epsilon_high=0.28,
                    loss_type="dapo", rollout_correction="tis", tis_cap=2.0)
LR = 0.5


def tiny_actor():
    """gpt-tiny with one block: the update's wiring, not depth, is under test (and it compiles
    in a few seconds)."""
    return models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=32,
                        num_layers=1, seed=3)


def no_reward(prompts, completions, **_):
    """The trainer needs a reward source; this test gives the rollout's rewards itself."""
    return [0.0] * len(completions)


def answer_logprobs64(model, tokens, starts, answer_length):
    """float64 log-probs [B, T] of each row's answer (row b's from column starts[b]), by plain
    indexing of the log-softmax (no zeroxla helper)."""
    logp = jax.nn.log_softmax(model(jnp.asarray(tokens[:, :-1])), axis=-1)    # [B, S-1, V]
    b = np.repeat(np.arange(tokens.shape[0]), answer_length)
    t = (np.asarray(starts)[:, None] - 1 + np.arange(answer_length)).reshape(-1)
    return logp[b, t, tokens[b, t + 1]].reshape(tokens.shape[0], answer_length)


def reference_loss(model, tokens, starts, mask, old, ref, advantages, weights, config):
    """The float64 DAPO loss of the module docstring; `weights` [B, T] the TIS or decoupled
    weights (ones without correction)."""
    logp = answer_logprobs64(model, tokens, starts, mask.shape[1])
    ratio = jnp.exp(logp - old)
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1 - config.epsilon, 1 + config.clip_high)
    terms = -jnp.minimum(ratio * a, clipped * a)
    delta = ref - logp
    kl = config.beta * (jnp.exp(delta) - delta - 1)
    if config.rollout_correction == "decoupled":          # AReaL: the clipped term alone
        terms = terms * weights + kl
    else:
        terms = (terms + kl) * weights
    return jnp.sum(terms * mask) / jnp.sum(mask)


def reference_update(model, rollout, rewards, config, lr, steps=1):
    """(float64 losses, float64 parameters) of `steps` SGD steps from the plain `model`'s
    parameters on `rollout`'s tokens, masks and log-probs with the advantages of `rewards`."""
    graphdef, params = nnx.split(model)
    with jax.enable_x64(True):
        state = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), params)
        fixed = [jnp.asarray(np.asarray(x, np.float64)) for x in (
            rollout.action_mask, rollout.logprobs, rollout.ref_logprobs,
            np_advantages(rewards, config.num_generations, config.scale_rewards,
                          config.advantage))]
        weights = np.ones(rollout.action_mask.shape)
        behaviour = np.exp(rollout.logprobs.astype(np.float64) - rollout.rollout_logprobs)
        if config.rollout_correction == "tis":
            weights = np.minimum(behaviour, config.tis_cap)
        if config.rollout_correction == "decoupled":
            cap = config.behav_imp_weight_cap
            weights = behaviour if cap is None else np.where(behaviour <= cap, behaviour, 0.0)
        loss = jax.value_and_grad(lambda s: reference_loss(
            nnx.merge(graphdef, s), rollout.tokens, rollout.answer_starts(), *fixed,
            jnp.asarray(weights), config))

        @jax.jit                                                  # one program, not op by op
        def sgd_step(s):
            value, grad = loss(s)
            return value, jax.tree.map(lambda p, g: p - lr * g, s, grad)

        losses = []
        for _ in range(steps):
            value, state = sgd_step(state)
            losses.append(float(value))
        return losses, jax.tree.map(np.asarray, state)


def fixed_rollout(trainer, rng):
    """Prompts of 2 and 15 tokens (rows 0-3 and 4-7), right-padded answers of 1 to 5 tokens,
    rewards, and the injected log-prob offsets of the module docstring."""
    c = trainer.config
    starts = np.repeat([ids.size for ids in trainer.prompts.ids], c.num_generations)
    lengths = np.array([5, 1, 3, 4, 2, 5, 5, 3])
    tokens = np.zeros((len(starts), c.prompt_length + c.max_completion_length), np.int32)
    mask = (np.arange(c.max_completion_length) < lengths[:, None]).astype(np.float32)
    for b, (start, n) in enumerate(zip(starts, lengths)):
        tokens[b, :start] = trainer.prompts.ids[b // c.num_generations]
        tokens[b, start:start + n] = rng.integers(0, TOKENIZER.vocab_size, n)
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.4, 0.7])
    actor = np.asarray(trainer.logprobs(tokens, starts, mask), np.float64)
    shape = mask.shape
    ratios = rng.choice([0.6, 0.7, 0.9, 1.1, 1.2, 1.4, 1.5], shape)      # off the clip edges
    old = (actor - np.log(ratios)) * mask
    weights = rng.choice([1 / 3, 0.5, 0.8, 1.25, 1.8, 2.5, 3.0], shape)  # cap 2: some truncated
    return GRPORollout(
        tokens=tokens, action_mask=mask, completions=("",) * len(starts), rewards=rewards,
        reward_parts={}, advantages=np.asarray(group_advantages(
            rewards.astype(np.float32), c.num_generations), np.float32),
        logprobs=old.astype(np.float32),
        ref_logprobs=((actor + rng.choice([-0.3, 0.3], shape)) * mask).astype(np.float32),
        rollout_logprobs=((old - np.log(weights)) * mask).astype(np.float32),
        prompt_lengths=starts.astype(np.int32))


def test_one_update_matches_the_float64_reference():
    trainer = GRPOTrainer(CONFIG, tiny_actor(), mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                          prompts=PROMPTS, reward_funcs=[no_reward],
                          inference_tp_size=1, optimizer=optax.sgd(LR))
    rollout = fixed_rollout(trainer, np.random.default_rng(0))
    real = rollout.action_mask > 0
    weights = np.exp(rollout.logprobs - rollout.rollout_logprobs)[real]
    assert weights.max() > 2.5 and weights.min() < 0.4 and np.mean(weights > 2) > 0.1
    before = zeroxla.gathered_model(trainer.actor_state)
    losses, expected = reference_update(before, rollout, rollout.rewards, CONFIG, LR)

    train = trainer.train_grpo(rollout)
    assert train["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert train["tis_clipped_fraction"] == pytest.approx(np.mean(weights > 2.0), rel=1e-6)
    assert_update(before, zeroxla.gathered_model(trainer.actor_state), expected)


def two_version_rollout(trainer, rng):
    """`fixed_rollout` whose answers were drawn by two versions: each row's first 1 to 3
    tokens by version 0 (stale: pi_prox / pi_behav from 1/3 to 3.0, cap 2.2: some filtered),
    the rest by version 1 (near the proximal policy: 0.8 to 1.25), `versions` [B, T] so."""
    rollout = fixed_rollout(trainer, rng)
    mask = rollout.action_mask
    split = rng.integers(1, 4, mask.shape[0])[:, None]
    versions = np.where(np.arange(mask.shape[1]) < split, 0, 1) * mask - (1 - mask)
    weights = np.where(versions == 0, rng.choice([1 / 3, 0.5, 1.8, 2.5, 3.0], mask.shape),
                       rng.choice([0.8, 0.9, 1.1, 1.25], mask.shape))
    behaviour = (rollout.logprobs.astype(np.float64) - np.log(weights)) * mask
    return dataclasses.replace(rollout, rollout_logprobs=behaviour.astype(np.float32),
                               versions=versions.astype(np.int32))


def test_a_decoupled_update_matches_the_float64_reference():
    """`rollout_correction="decoupled"` (AReaL's objective) on a rollout drawn by two
    versions: the whole update within 1e-6 relative (L2) of the float64 reference's, each
    leaf's step as `assert_update`, the filtered share the one the cap implies, and the loss
    within 1e-5 relative (a mean of terms ~1 whose advantages cancel to ~4e-3: float32
    round-off of the terms is ~4e-6 of it)."""
    config = CONFIG.replace(rollout_correction="decoupled", behav_imp_weight_cap=2.2)
    trainer = GRPOTrainer(config, tiny_actor(), mesh=zeroxla.make_mesh(2, 4),
                          tokenizer=TOKENIZER, prompts=PROMPTS, reward_funcs=[no_reward],
                          inference_tp_size=1, optimizer=optax.sgd(LR))
    rollout = two_version_rollout(trainer, np.random.default_rng(2))
    real = rollout.action_mask > 0
    weights = np.exp(rollout.logprobs.astype(np.float64) - rollout.rollout_logprobs)[real]
    assert np.mean(weights > 2.2) > 0.05 and set(np.unique(rollout.versions[real])) == {0, 1}
    before = zeroxla.gathered_model(trainer.actor_state)
    losses, expected = reference_update(before, rollout, rollout.rewards, config, LR)

    train = trainer.train_grpo(rollout)
    # The loss is a token mean of terms of order 1 whose advantages cancel to about 4e-3:
    # float32's rounding of the terms (about 1e-7 each) bounds it absolutely, not relative to
    # the small mean (jax 0.12's fusions land 4.1e-8 from the float64 value).
    assert train["loss"] == pytest.approx(losses[0], rel=0, abs=1e-6)
    assert train["rollout_corr/rollout_is_clipped_fraction"] == pytest.approx(
        np.mean(weights > 2.2), rel=1e-6)
    after = zeroxla.gathered_model(trainer.actor_state)
    assert_update(before, after, expected)
    assert update_error(before, after, expected) <= 1e-6


def update_error(before, after, expected):
    """||step - reference step|| / ||reference step|| over every parameter (L2, float64)."""
    start, end = jax.tree.leaves(nnx.state(before)), jax.tree.leaves(nnx.state(after))
    got, want = (np.concatenate([(np.asarray(x, np.float64) - np.asarray(s, np.float64)).ravel()
                                 for x, s in zip(leaves, start)])
                 for leaves in (end, jax.tree.leaves(expected)))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_update(before, after, expected):
    """Every leaf's step (`after` - `before`, plain models) equals the reference's (`expected`
    - `before`) to float32 round-off: rtol 1e-3 of the step, atol 2e-7 (an ulp or two of a
    parameter near 1); the reference moves some leaf by more than 1e-3."""
    named = jax.tree_util.tree_flatten_with_path(expected)[0]
    start, end = jax.tree.leaves(nnx.state(before)), jax.tree.leaves(nnx.state(after))
    assert len(named) == len(start) == len(end)
    moved = 0.0
    for (path, want), first, last in zip(named, start, end):
        first = np.asarray(first, np.float64)
        np.testing.assert_allclose(np.asarray(last, np.float64) - first, want - first,
                                   rtol=1e-3, atol=2e-7, err_msg=jax.tree_util.keystr(path))
        moved = max(moved, np.abs(want - first).max())
    assert moved > 1e-3                       # the update is far above the tolerance


@pytest.mark.slow
def test_a_token_budget_update_matches_the_float64_reference():
    """With `ppo_max_token_len_per_gpu` (verl's token budget) the packed rows are the budget
    long and each of the 2 data replicas' rows is a micro-batch: the update is still the
    reference's single step on the whole rollout."""
    longest = CONFIG.prompt_length + CONFIG.max_completion_length - 1          # 19 slots
    config = CONFIG.replace(ppo_max_token_len_per_gpu=longest)
    mesh = zeroxla.make_mesh(1, 2, devices=jax.devices()[:2])
    trainer = GRPOTrainer(config, tiny_actor(), mesh=mesh, tokenizer=TOKENIZER,
                          prompts=PROMPTS, reward_funcs=[no_reward], inference_tp_size=1,
                          optimizer=optax.sgd(LR))
    rollout = fixed_rollout(trainer, np.random.default_rng(1))
    before = zeroxla.gathered_model(trainer.actor_state)
    losses, expected = reference_update(before, rollout, rollout.rewards, config, LR)

    train = trainer.train_grpo(rollout)
    assert train["packing/micro_batches"] >= 2                 # accumulated, not one pass
    assert train["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert_update(before, zeroxla.gathered_model(trainer.actor_state), expected)
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=18 is invalid.*at least "
                                         r"19"):
        GRPOTrainer(config.replace(ppo_max_token_len_per_gpu=longest - 1), tiny_actor(),
                    mesh=mesh, tokenizer=TOKENIZER, prompts=PROMPTS, reward_funcs=[no_reward],
                    inference_tp_size=1)
