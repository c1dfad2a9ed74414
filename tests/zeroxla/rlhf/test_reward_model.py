"""The reward model of DeepSpeed-Chat's step 2 (`dschat/utils/model/reward_model.py`) and its use in
step 3, against independent references: the pairwise loss of the ZeRO-3 step and the validation
metrics recomputed in numpy float64 from end scores read off the plain model's values by index;
padding after the end; the critic started from a reward model; the rollout scorer reading
the reward model in a ZeRO-3 step's layout against the plain model's end scores; and PPO scoring
its rollouts with a reward model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models, rlhf
from zeroxla.app import data
from reference import flat_params, train_single_device
from runs import bytes_per_device

VOCAB = 65


def random_head(model, seed, scale=0.3):
    """`model` with a random v_head (a fresh one is zero: every score would be 0)."""
    rng = np.random.default_rng(seed)
    model.v_head[...] = jnp.asarray(rng.normal(0, scale, model.v_head.shape), jnp.float32)
    return model


def reward_model(family="gpt", seed=0):
    return random_head(rlhf.RewardModel(models.build(f"{family}-tiny", seed=seed)), seed + 100)


def random_pairs(n, seq_len, seed):
    """Random token pairs with ends anywhere in [1, seq_len); tokens after an end are random
    too (they must not matter)."""
    rng = np.random.default_rng(seed)
    return {"chosen": rng.integers(0, VOCAB, (n, seq_len), dtype=np.int32),
            "rejected": rng.integers(0, VOCAB, (n, seq_len), dtype=np.int32),
            "chosen_end": rng.integers(1, seq_len, n).astype(np.int32),
            "rejected_end": rng.integers(1, seq_len, n).astype(np.int32)}


@nnx.jit
def values_of(model, tokens):
    """`model(tokens)` as one program (the references' forwards, not op by op)."""
    return model(tokens)


def np_end_scores(model, tokens, ends):
    """float64[B]: the plain model's values [B, T], read at `ends` row by row."""
    values = np.asarray(values_of(model, jnp.asarray(tokens)), np.float64)
    return np.array([values[b, e] for b, e in enumerate(ends)])


def np_pair_loss(d):
    """-log sigmoid(d) in float64, stable for any sign: log(1 + exp(-d))."""
    return np.logaddexp(0.0, -np.asarray(d, np.float64))


# ---- the model ---------------------------------------------------------------------------------
def test_refuses_a_base_without_hidden_and_d_model():
    with pytest.raises(TypeError, match=r"base=Linear lacks hidden\(tokens\) and config\.d_model"):
        rlhf.RewardModel(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("family", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_fresh_head_scores_zero_and_end_scores_ignore_padding(family):
    fresh = rlhf.RewardModel(models.build(f"{family}-tiny", seed=0))
    assert rlhf.Critic is rlhf.RewardModel
    assert fresh.v_head.get_metadata()["logical_axes"] == (models.axes.EMBED,)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 12), dtype=np.int32)
    values = np.asarray(fresh(jnp.asarray(tokens)))
    assert values.shape == (3, 12) and values.dtype == np.float32 and np.all(values == 0)

    model = random_head(fresh, 1)
    ends = np.array([4, 11, 0], np.int32)
    values = np.asarray(model(jnp.asarray(tokens)))
    got = np.asarray(rlhf.end_scores(jnp.asarray(values), jnp.asarray(ends)))
    np.testing.assert_array_equal(got, [values[0, 4], values[1, 11], values[2, 0]])
    assert len(set(values[0].tolist())) == 12            # a wrong index would give another value
    # Other padding after each end (and another pad id): the same end scores.
    repadded = tokens.copy()
    for b, e in enumerate(ends):
        repadded[b, e + 1:] = (b + 7) % VOCAB
    assert not np.array_equal(repadded, tokens)
    np.testing.assert_allclose(np_end_scores(model, repadded, ends),
                               np_end_scores(model, tokens, ends), rtol=1e-6, atol=1e-6)


def test_large_margins_give_a_finite_exact_loss():
    """Scores in the thousands: log_sigmoid keeps the loss finite and equal to log(1 + e^-d)."""
    model = random_head(rlhf.RewardModel(models.build("gpt-tiny", seed=0)), 2, scale=300.0)
    batch = random_pairs(8, 10, seed=3)
    total, count = rlhf.pairwise_loss_terms(model, {k: jnp.asarray(v) for k, v in batch.items()})
    d = (np_end_scores(model, batch["chosen"], batch["chosen_end"])
         - np_end_scores(model, batch["rejected"], batch["rejected_end"]))
    assert np.abs(d).max() > 100 and np.isfinite(float(total)) and float(count) == 8
    np.testing.assert_allclose(float(total), np_pair_loss(d).sum(), rtol=1e-5)


# ---- the ZeRO-3 loss and the validation metrics --------------------------------------------------
@pytest.mark.parametrize("family", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_zero3_pairwise_loss_and_metrics_match_numpy(family):
    """make_step's loss at stage 3 on the 2 x 4 mesh, and `pair_metrics` on the gathered model,
    against float64 numpy on the plain model's end scores."""
    model = reward_model(family)
    batch = random_pairs(16, 12, seed=4)
    step = zeroxla.make_step(model, zeroxla.make_mesh(nodes=2, local=4), optimizer=optax.adam(1e-3),
                             config=zeroxla.ZeroConfig(stage=3), loss_fn=rlhf.pairwise_loss_terms)
    state = step.init(0)
    plain = zeroxla.gathered_model(state)
    r_c = np_end_scores(plain, batch["chosen"], batch["chosen_end"])
    r_r = np_end_scores(plain, batch["rejected"], batch["rejected_end"])
    d = r_c - r_r
    assert 0 < np.mean(d > 0) < 1                           # both outcomes occur
    metrics = rlhf.pair_metrics(plain, batch)
    np.testing.assert_allclose(metrics["accuracy"], np.mean(d > 0), rtol=1e-6)
    np.testing.assert_allclose(metrics["margin"], np.mean(d), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["chosen_score"], np.mean(r_c), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["rejected_score"], np.mean(r_r), rtol=1e-5, atol=1e-6)
    _, step_metrics = step(state, batch)
    np.testing.assert_allclose(float(step_metrics["loss"]), np.mean(np_pair_loss(d)), rtol=1e-5)


@pytest.mark.slow
def test_llama_unused_lm_head_gets_no_update_and_the_step_matches_one_device():
    """Llama's untied output projection is held but never read: a ZeRO-3 step (SGD, Adam, or
    with `without_lm_head` freezing it) leaves it bit-for-bit as it was, and the SGD step's
    weights match single-device optax on a loss written here from the model's values (not the
    package's loss_fn). (SGD for the comparison: Adam's first step is `lr * sign(g)`, which
    turns float32 rounding of the smallest gradients into whole steps.)"""
    model, batch = reward_model("llama"), random_pairs(16, 12, seed=5)

    def loss(m, b):                                          # the mean of -log sigmoid(d)
        def ends(tokens, end):
            return jnp.take_along_axis(m(tokens), end[:, None], axis=1)[:, 0]
        d = ends(b["chosen"], b["chosen_end"]) - ends(b["rejected"], b["rejected_end"])
        return jnp.mean(jnp.logaddexp(0.0, -d))

    _, expected = train_single_device(nnx.clone(model), optax.sgd(0.1), [batch], loss_fn=loss)
    initial = flat_params(nnx.state(model, nnx.Param))
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    for optimizer, trainable, compare in ((optax.sgd(0.1), None, True),
                                          (optax.sgd(0.1), rlhf.without_lm_head, True),
                                          (optax.adam(1e-2), None, False)):
        step = zeroxla.make_step(model, mesh, optimizer=optimizer, trainable=trainable,
                                 config=zeroxla.ZeroConfig(stage=3),
                                 loss_fn=rlhf.pairwise_loss_terms)
        state, _ = step(step.init(0), batch)
        got = flat_params(nnx.state(zeroxla.gathered_model(state), nnx.Param))
        np.testing.assert_array_equal(got["base/head/weight"], initial["base/head/weight"])
        assert np.abs(got["v_head"] - initial["v_head"]).max() > 1e-3
        for path, value in expected.items() if compare else ():
            np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-6, err_msg=path)


# ---- training on preference pairs ---------------------------------------------------------------
# Training a reward model until held-out accuracy rises is checked through the job that does it,
# on the bundled preference pairs (tests/zeroxla/app/test_chat_jobs.py).


# ---- the critic from a reward model, and PPO scored by one ---------------------------------------
def test_critic_from_reward_model_reproduces_its_values_and_is_a_copy():
    rm = reward_model("llama", seed=6)
    critic = rlhf.critic_from_reward_model(rm)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, VOCAB, (2, 9), dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(critic(tokens)), np.asarray(rm(tokens)))
    critic.v_head[...] = critic.v_head[...] + 1.0
    assert not np.allclose(np.asarray(critic(tokens)), np.asarray(rm(tokens)))
    with pytest.raises(TypeError, match="accepted: a zeroxla.rlhf.RewardModel"):
        rlhf.critic_from_reward_model(models.build("gpt-tiny"))


def test_the_scorer_reads_the_reward_model_partitioned_and_equals_its_plain_end_scores():
    """`make_scorer(reward_model=, mesh=)` on the 2 x 4 mesh: the end scores of fresh random
    rows (answers of different lengths; 11 rows, padded up to 16 for the 8 data replicas) equal
    the plain one-device `answer_end_scores`, and the model is held 1/N per device (every leaf
    partitioned: the tiny model's are below the default persistence threshold), in the state
    and in the compiled program's arguments; no mesh is refused by name."""
    rm = reward_model("llama", seed=9)
    scorer = rlhf.make_scorer(reward_model=rm, mesh=zeroxla.make_mesh(2, 4),
                              zero_config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    rng = np.random.default_rng(10)
    b, p, g = 11, 6, 8
    tokens = rng.integers(0, VOCAB, (b, p + g), dtype=np.int32)
    lengths = np.concatenate([[g, 1], rng.integers(1, g + 1, b - 2)])
    mask = (np.arange(g) < lengths[:, None]).astype(np.float32)               # [B, G]
    got = scorer(tokens, mask, [""] * b)
    want = np.asarray(nnx.jit(rlhf.answer_end_scores)(rm, jnp.asarray(tokens),
                                                      jnp.asarray(mask)))     # one program
    assert got.shape == (b,) and got.dtype == np.float32 and np.std(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the end index matters: the value one token earlier is another score
    earlier = np_end_scores(rm, tokens, p + lengths - 2)
    assert np.abs(earlier - got).min() > 1e-3
    whole = sum(x.nbytes for x in jax.tree.leaves(nnx.state(rm, nnx.Param)))
    held = bytes_per_device(scorer.state.params)
    assert max(held) <= 1.05 * min(held) and max(held) < whole / 4, (held, whole)
    arguments = scorer.lower(tokens).compile().memory_analysis().argument_size_in_bytes
    assert arguments < whole / 4, (arguments, whole)
    with pytest.raises(ValueError, match=r"without `mesh`.*accepted: mesh="):
        rlhf.make_scorer(reward_model=rm)


@pytest.mark.slow
def test_the_scorer_under_sequence_parallelism_equals_the_plain_end_scores():
    """Under the ring's zigzag split over 2 sequence devices (each row cut into 4 chunks), rows
    of 15 tokens (padded to 16 after every answer's end; 5 rows, to 8 for the 4 data replicas)
    score as the plain model does."""
    rm = reward_model("gpt", seed=11)
    scorer = rlhf.make_scorer(reward_model=rm, mesh=zeroxla.make_mesh(2, 2, sequence=2),
                              zero_config=zeroxla.ZeroConfig(
                                  stage=3, sequence_parallel_strategy="ring"))
    rng = np.random.default_rng(12)
    b, p, g = 5, 6, 9
    tokens = rng.integers(0, VOCAB, (b, p + g), dtype=np.int32)
    mask = (np.arange(g) < rng.integers(1, g + 1, b)[:, None]).astype(np.float32)
    want = np.asarray(nnx.jit(rlhf.answer_end_scores)(rm, jnp.asarray(tokens),
                                                      jnp.asarray(mask)))
    assert scorer.batch(tokens)["tokens"].shape == (8, 16) and np.std(want) > 0.1
    np.testing.assert_allclose(scorer(tokens, mask, [""] * b), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_scorer_refuses_a_reward_model_whose_experts_the_mesh_splits():
    """A reward model on an MoE base, its experts split over an expert axis of 2: refused by
    name (the scorer's forward is a dense model's)."""
    from test_grpo_moe import actor
    config = actor().config.replace(output_router_logits=False)
    base = models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"splits the reward model's experts over 2 devices; "
                                         r"accepted: a dense RewardModel"):
        rlhf.make_scorer(reward_model=rlhf.RewardModel(base),
                         mesh=zeroxla.make_mesh(2, 2, expert=2))


PPO = rlhf.PPOConfig(prompts_per_iteration=16, prompt_length=8, answer_length=12)


def test_ppo_scores_rollouts_with_the_reward_model_and_starts_the_critic_from_it():
    """A PPO rollout (`PPOTrainer.generate_experience`, what `run_ppo` runs first) with
    `reward_model=` and `critic_init=` the same (random) reward model: each rollout score is
    that model's value of the row at its last real answer token (prompt length + answer length
    - 1, the EOS when there is one), and the critic's rollout values are the reward model's at
    positions P-1 .. P+G-2."""
    corpus = data.load_corpus()
    eos = int(corpus.tokenizer.encode(" ")[0])          # a random actor ends some answers early
    rm = reward_model("gpt", seed=8)
    trainer = rlhf.PPOTrainer(PPO, models.build("gpt-tiny", seed=0), mesh=zeroxla.make_mesh(2, 4),
                              tokenizer=corpus.tokenizer, prompt_tokens=corpus.val,
                              reward_model=rm, critic_init=rm, eos_id=eos, seed=0)
    r, p = trainer.generate_experience(0)[0], PPO.prompt_length
    lengths = r.action_mask.sum(1).astype(int)
    assert lengths.min() < PPO.answer_length                # the end index is exercised
    values = np.asarray(values_of(rm, jnp.asarray(r.tokens)), np.float64)
    expected = np.array([values[b, p + n - 1] for b, n in enumerate(lengths)])
    np.testing.assert_allclose(r.scores, expected, rtol=1e-5, atol=1e-6)
    assert np.std(r.scores) > 0.1
    np.testing.assert_allclose(r.values, values[:, p - 1:-1] * r.action_mask, rtol=1e-5, atol=1e-6)


def test_ppo_refuses_two_rewards_and_mismatched_reward_models():
    actor, rm = models.build("gpt-tiny"), reward_model("gpt")
    common = dict(mesh=None, tokenizer=None, prompt_tokens=np.zeros(100, np.int32))
    with pytest.raises(ValueError, match="reward_fn and reward_model are both given"):
        rlhf.run_ppo(PPO, 1, actor, reward_fn=rlhf.vowel_fraction, reward_model=rm, **common)
    with pytest.raises(TypeError, match="reward_model=GPT; accepted: a zeroxla.rlhf.RewardModel"):
        rlhf.PPOTrainer(PPO, actor, reward_model=actor, **common)
    other = rlhf.RewardModel(models.build("gpt-tiny", vocab_size=70))
    with pytest.raises(ValueError, match="critic_init has vocab_size=70 but the actor 65"):
        rlhf.PPOTrainer(PPO, actor, critic_init=other, **common)
    short = rlhf.RewardModel(models.build("gpt-tiny", max_seq_len=16))
    with pytest.raises(ValueError, match=r"reward_model has max_seq_len=16 < .* = 20"):
        rlhf.PPOTrainer(PPO, actor, reward_model=short, **common)
