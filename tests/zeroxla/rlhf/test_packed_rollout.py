"""A packed GRPO rollout (zeroxla/rlhf/packed_rollout.py) against the padded one it replaces:
the padded loss is `grpo.losses`' (itself checked against float64 TRL loops in
test_grpo_losses.py); packed, every loss type's loss and gradients equal it within 1e-6 on fresh
rollouts of ragged prompts and answers, for a nanoGPT-style GPT and a Llama (GQA, RoPE), and one
ZeRO-3 step on the 2 x 4 mesh from the same start lands on the same parameters. The bin packing
(zeroxla/engine/bin_packing.py) against brute force."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.engine.bin_packing import balance_rows
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo.losses import make_grpo_loss
from zeroxla.rlhf.packed_rollout import pack_for_step, pack_rollout

V, P, G = 48, 7, 9                    # vocabulary, prompt columns, answer columns
EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.05


def rollout(rows, seed):
    """A padded GRPO training batch as `GRPOTrainer.train_grpo` builds it: row b is its prompt
    (1..P tokens), its answer (1..G tokens), zeros; random log-probs, weights, advantages."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, P + 1, rows)
    answers = rng.integers(1, G + 1, rows)
    tokens = np.zeros((rows, P + G), np.int32)
    mask = np.zeros((rows, G), np.float32)
    for b in range(rows):
        n = prompts[b] + answers[b]
        tokens[b, :n] = rng.integers(1, V, n)
        mask[b, :answers[b]] = 1.0
    return {"tokens": tokens, "prompt_lengths": prompts.astype(np.int32),
            "old_logprobs": rng.uniform(-4.0, -0.5, (rows, G)).astype(np.float32) * mask,
            "ref_logprobs": rng.uniform(-4.0, -0.5, (rows, G)).astype(np.float32) * mask,
            "is_weights": rng.uniform(0.5, 2.0, (rows, G)).astype(np.float32) * mask,
            "advantages": rng.normal(size=rows).astype(np.float32), "action_mask": mask}


def gpt():
    return models.build("gpt-tiny", vocab_size=V, max_seq_len=64, seed=1)


def llama():
    return models.build("llama-tiny", vocab_size=V, max_seq_len=64, seed=2)


def mean_and_grads(model, batch, loss_fn):
    """The `(sum, count)` loss_fn's mean on `batch` and its gradients, on one device."""
    graphdef, params = nnx.split(model)

    def mean(p, rows):
        total, count = loss_fn(nnx.merge(graphdef, p), rows)
        return total / count
    return jax.jit(jax.value_and_grad(mean))(params, batch)       # one program, not op by op


def assert_same_mean_and_grads(model, loss_fn, padded, packed):
    """The packed batch's mean loss within 1e-6 of the padded batch's, and every gradient
    within 1e-6 of the largest."""
    want, want_grads = mean_and_grads(model, padded, loss_fn)
    got, got_grads = mean_and_grads(model, packed, loss_fn)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("family,loss_type", [
    (gpt, "grpo"), pytest.param(llama, "dr_grpo", marks=pytest.mark.slow),
    pytest.param(gpt, "dapo", marks=pytest.mark.slow),
    pytest.param(llama, "grpo", marks=pytest.mark.slow)])
def test_packed_loss_and_grads_equal_the_padded(family, loss_type):
    padded = rollout(12, seed=len(loss_type) + len(family.__name__))
    packed, stats = pack_rollout(padded, loss_type=loss_type, row_len=P + G - 1, data_size=2)
    assert stats["rows"] < 12                       # fewer rows than answers: packed
    assert_same_mean_and_grads(family(), make_grpo_loss(
        loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA), padded, packed)


def test_every_answer_token_lands_on_its_slot_once():
    padded = rollout(10, seed=5)
    packed, _ = pack_rollout(padded, loss_type="dapo", row_len=40, data_size=4)
    mask = packed["action_mask"] > 0
    np.testing.assert_array_equal(np.sort(packed["old_logprobs"][mask]),
                                  np.sort(padded["old_logprobs"][padded["action_mask"] > 0]))
    assert packed["loss_count"].sum() == padded["action_mask"].sum()      # dapo: its tokens
    # each slot predicts its segment's next token, positions restart at each segment
    for row in range(packed["inputs"].shape[0]):
        seg = packed["segment_ids"][row]
        for s in set(seg[seg > 0].tolist()):
            at = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(packed["positions"][row, at], np.arange(at.size))
            np.testing.assert_array_equal(packed["inputs"][row, at[1:]],
                                          packed["targets"][row, at[:-1]])


@pytest.mark.slow
def test_a_zero3_step_on_the_packed_rollout_lands_where_the_padded_one_does():
    padded = rollout(16, seed=11)
    packed, stats = pack_rollout(padded, loss_type="grpo", row_len=P + G - 1, data_size=8)
    assert packed["inputs"].shape[0] % 8 == 0 and stats["replica_imbalance"] >= 1
    loss_fn = make_grpo_loss(loss_type="grpo", epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA)
    assert_same_zero3_step(zero3_step(llama(), loss_fn), padded, packed)


def zero3_step(model, loss_fn):
    return zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.5),
                             loss_fn=loss_fn, config=zeroxla.ZeroConfig(stage=3))


def assert_same_zero3_step(step, padded, packed, accumulation=None):
    """One SGD step (`zero3_step`: ZeRO-3 on 2 x 4 devices) from the same start: the packed
    batch's loss and new parameters (in `accumulation` micro-batches per call) equal the
    padded batch's."""
    results = []
    for batch, k in ((padded, None), (packed, accumulation)):
        state, metrics = step(step.init(0), batch, gradient_accumulation_steps=k)
        results.append((float(metrics["loss"]), zeroxla.gathered_model(state)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(results[1][1], nnx.Param)),
                    jax.tree.leaves(nnx.state(results[0][1], nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def assert_same_update(plain, batch, other, other_batch):
    """One step of `other` on `other_batch` (e.g. under sequence parallelism, packed) from the
    same start as `plain` on `batch`: the same loss within 1e-6, and the same update (SGD: lr x
    the gradient) within float32's reordering of the sums over tokens and devices, 5e-6 of the
    largest (as tests/zeroxla/engine/test_sequence_parallel.py)."""
    (want_state, want), (got_state, got) = (step(step.init(0), b)
                                            for step, b in ((plain, batch), (other, other_batch)))
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    start, want, got = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(
        nnx.state(zeroxla.gathered_model(state), nnx.Param))])
        for state in (plain.init(0), want_state, got_state))
    assert np.abs((got - start) - (want - start)).max() <= 5e-6 * np.abs(want - start).max()


def test_a_sequence_longer_than_the_row_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^row_len=8.*longest sequence"):
        pack_rollout(rollout(4, seed=0) | {"prompt_lengths": np.full(4, P, np.int32)},
                     loss_type="grpo", row_len=8, data_size=1)
    with pytest.raises(ValueError, match=r"packed_row_len=5 is invalid.*>= .* = 22"):
        GRPOConfig(prompt_length=8, max_completion_length=15, packed_row_len=5)
    for bad in (dict(packing=False), dict(packed_row_len=64), dict(ppo_max_token_len_per_gpu=0)):
        with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=\d+ is invalid.*"
                                             r"packing=True and packed_row_len=None"):
            GRPOConfig(**{"ppo_max_token_len_per_gpu": 64, **bad})


def test_an_actor_without_segment_ids_is_refused_when_packing():
    class PlainLM(nnx.Module):                    # model(tokens) -> logits, nothing else
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, 8, rngs=rngs)
            self.out = nnx.Linear(8, V, rngs=rngs)

        def __call__(self, tokens):
            return self.out(self.embed(tokens))

    from zeroxla.app.tokenizers.basic import CharTokenizer
    from zeroxla.rlhf.grpo.trainer import GRPOTrainer
    with pytest.raises(ValueError, match=r"packing=True but PlainLM takes no positions= and "
                                         r"segment_ids=.*packing=False"):
        GRPOTrainer(GRPOConfig(num_generations=2, prompts_per_iteration=4),
                    PlainLM(nnx.Rngs(0)), mesh=zeroxla.make_mesh(1, 8),
                    tokenizer=CharTokenizer.from_text("abc"), prompts=[{"prompt": "ab"}],
                    reward_funcs=[lambda prompts, completions, **_: [0.0] * len(completions)])


@pytest.mark.parametrize("seed", range(20))
def test_balance_rows_is_within_lpt_bound_of_the_best_split(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 50, rng.integers(2, 9)).tolist()
    replicas = int(rng.integers(1, 4))
    per = -(-len(tokens) // replicas)
    placed = balance_rows(tokens, replicas, per)
    assert sorted(r for rows in placed for r in rows) == list(range(len(tokens)))
    assert all(len(rows) <= per for rows in placed)
    heaviest = max(sum(tokens[r] for r in rows) for rows in placed)
    best = min(max(sum(t for t, a in zip(tokens, owner) if a == r) for r in range(replicas))
               for owner in itertools.product(range(replicas), repeat=len(tokens))
               if all(owner.count(r) <= per for r in range(replicas)))
    assert heaviest <= 4 / 3 * best + max(tokens)     # LPT with a row cap


def ppo_rollout(rows, seed):
    """A padded PPO batch as `PPOTrainer.batches` builds it: prompts LEFT-padded to P (the pads
    stay in the sequence), answers of 1..G tokens, per-token advantages, values and returns."""
    rng = np.random.default_rng(seed)
    batch = rollout(rows, seed)
    tokens = np.zeros_like(batch["tokens"])
    answers = batch["action_mask"].sum(1).astype(int)
    for b in range(rows):
        n = batch["prompt_lengths"][b]
        tokens[b, P - n:P] = rng.integers(1, V, n)
        tokens[b, P:P + answers[b]] = rng.integers(1, V, answers[b])
    mask = batch["action_mask"]
    return {"tokens": tokens, "action_mask": mask, "old_logprobs": batch["old_logprobs"],
            "advantages": rng.normal(size=mask.shape).astype(np.float32) * mask,
            "old_values": rng.normal(size=mask.shape).astype(np.float32) * mask,
            "returns": rng.normal(size=mask.shape).astype(np.float32) * mask}


@pytest.mark.slow
def test_ppo_actor_and_critic_losses_packed_equal_the_padded():
    from zeroxla.rlhf.ppo.losses import make_actor_loss, make_critic_loss
    from zeroxla.rlhf.reward_model import RewardModel
    padded, row_len = ppo_rollout(10, seed=21), 2 * (P + G - 1)
    assert pack_rollout(padded, loss_type="dapo", row_len=row_len, data_size=1)[1]["rows"] < 10
    actor = {k: padded[k] for k in ("tokens", "action_mask", "old_logprobs", "advantages")}
    assert_same_mean_and_grads(llama(), make_actor_loss(0.2), actor, pack_rollout(
        actor, loss_type="dapo", row_len=row_len, data_size=1)[0])
    critic = RewardModel(gpt())
    critic.v_head[...] = jax.random.normal(jax.random.key(1), critic.v_head[...].shape)
    values = {k: padded[k] for k in ("tokens", "action_mask", "old_values", "returns")}
    assert_same_mean_and_grads(critic, make_critic_loss(0.2), values, pack_rollout(
        values, loss_type="dapo", row_len=row_len, data_size=1)[0])


@pytest.mark.parametrize("role", ["actor", pytest.param("critic", marks=pytest.mark.slow)])
def test_ppo_token_budget_micro_batches_land_where_the_padded_step_does(role):
    """`PPOConfig.ppo_max_token_len_per_gpu` (verl's token budget): rows of the longest
    sequence's slots, each replica's rows accumulated as micro-batches, one update equal to the
    padded batch's, for the actor's loss (a per-token mean) and the critic's."""
    from zeroxla.rlhf.ppo.losses import make_actor_loss, make_critic_loss
    from zeroxla.rlhf.reward_model import RewardModel
    padded = ppo_rollout(32, seed=23)
    if role == "actor":
        keys, model, loss_fn = ("old_logprobs", "advantages"), llama(), make_actor_loss(0.2)
    else:
        keys, model, loss_fn = ("old_values", "returns"), RewardModel(gpt()), make_critic_loss(0.2)
    batch = {k: padded[k] for k in ("tokens", "action_mask", *keys)}
    step = zero3_step(model, loss_fn)
    packed, stats, k = pack_for_step(batch, step.layout, loss_type="dapo", row_len=P + G - 1,
                                     token_budget=P + G - 1, owner="PPOConfig")
    assert packed["inputs"].shape == (8 * k, P + G - 1) and k >= 2
    assert stats["micro_batches"] == k
    assert_same_zero3_step(step, batch, packed, accumulation=k)


@pytest.mark.slow
def test_a_token_budget_keeps_the_steps_temporaries_flat_as_the_rollout_grows():
    """From the compiled programs (`memory_analysis`, per device): with a token budget of the
    longest sequence the temporaries of a 4x larger rollout stay within 5% (one row's
    activations, whatever the micro-batch count), where one micro-batch of every row grows
    with the rows."""
    step = zero3_step(gpt(), make_grpo_loss(loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HIGH))
    state = step.init(0)
    temps = {}
    for rows in (16, 64):
        padded = rollout(rows, seed=rows)
        for budget in (None, P + G - 1):
            packed, _, k = pack_for_step(padded, step.layout, loss_type="dapo", row_len=P + G - 1,
                                         token_budget=budget, owner="GRPOConfig")
            compiled = step.compile(state, packed, gradient_accumulation_steps=k)
            temps[rows, budget] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[64, None] > 2 * temps[16, None]
    assert temps[64, P + G - 1] <= 1.05 * temps[16, P + G - 1]


@pytest.mark.parametrize("role,strategy", [
    pytest.param("actor", "ulysses", marks=pytest.mark.slow), ("critic", "ring"),
    pytest.param("actor", "usp", marks=pytest.mark.slow)])
def test_ppo_losses_under_sequence_parallelism_land_where_the_padded_step_does(role, strategy):
    """PPO's actor and critic losses on a packed rollout whose rows are split over 2 sequence
    devices (2 x 2 data replicas): one update equal to the padded batch's without sequence
    parallelism (2 x 4 replicas); a padded batch under it is refused naming the option."""
    from zeroxla.rlhf.ppo.losses import make_actor_loss, make_critic_loss
    from zeroxla.rlhf.reward_model import RewardModel
    padded = ppo_rollout(16, seed=29)
    if role == "actor":
        keys, build, loss_fn = ("old_logprobs", "advantages"), llama, make_actor_loss(0.2)
    else:
        keys, loss_fn = ("old_values", "returns"), make_critic_loss(0.2)

        def build():
            critic = RewardModel(gpt())
            critic.v_head[...] = jax.random.normal(jax.random.key(3), critic.v_head[...].shape)
            return critic
    batch = {k: padded[k] for k in ("tokens", "action_mask", *keys)}
    sp = zeroxla.make_step(build(), zeroxla.make_mesh(2, 2, sequence=2),
                           optimizer=optax.sgd(0.5), loss_fn=loss_fn,
                           config=zeroxla.ZeroConfig(stage=3, sequence_parallel_strategy=strategy))
    packed, _, _ = pack_for_step(batch, sp.layout, loss_type="dapo", row_len=P + G - 1,
                                 token_budget=None, owner="PPOConfig")
    assert_same_update(zero3_step(build(), loss_fn), batch, sp, packed)
    from zeroxla.models.sequence_parallel import SequenceParallel
    with pytest.raises(ValueError, match="PPOConfig.packing=True"):
        loss_fn(build(), batch, sequence=SequenceParallel("sequence", 2))


@pytest.mark.parametrize("strategy,chunks", [("ulysses", 2), ("ring", 4)])
def test_a_token_budget_under_sequence_parallelism_counts_one_sequence_devices_tokens(
        strategy, chunks):
    """verl's `ppo_max_token_len_per_gpu` is one device's tokens: under sequence parallelism
    of 2 a packed row spans the 2 sequence devices, so it is the largest multiple of the chunks
    the row is cut into (P, 2P for the zigzag) of at most 2 x budget tokens, and a sequence
    longer than the budget fits whole (packing only; no compile)."""
    from zeroxla.rlhf.packed_rollout import check_token_budget
    loss_fn = make_grpo_loss(loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HIGH)
    layout = zeroxla.make_step(gpt(), zeroxla.make_mesh(2, 2, sequence=2), loss_fn=loss_fn,
                               optimizer=optax.sgd(0.5), config=zeroxla.ZeroConfig(
                                   stage=3, sequence_parallel_strategy=strategy)).layout
    padded = rollout(16, seed=37)
    slots = padded["prompt_lengths"] + padded["action_mask"].sum(1).astype(int) - 1   # [B]
    longest = int(slots.max())
    budget = longest - 4                             # under the longest, over half of it
    check_token_budget(budget, longest, layout, "GRPOConfig")            # accepted
    packed, stats, k = pack_for_step(padded, layout, loss_type="dapo", row_len=P + G - 1,
                                     token_budget=budget, owner="GRPOConfig")
    row = packed["inputs"].shape[1]
    assert row == max(n for n in range(0, 2 * budget + 1, chunks)), (row, budget)
    assert row // 2 <= budget and row >= longest
    assert (packed["segment_ids"] > 0).sum() == slots.sum()             # every slot placed
    assert packed["inputs"].shape[0] == 4 * k and stats["micro_batches"] == k
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=\d+ is invalid"):
        check_token_budget(-(-longest // 2) - chunks, longest, layout, "GRPOConfig")
