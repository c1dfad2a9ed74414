"""A rollout's per-answer-token values computed in the policy's step layout under sequence
parallelism (zeroxla/rlhf/answer_forward.py, zeroxla/engine/token_forward.py) against the
one-device forward of the gathered model they replace: GRPO's ragged answer log-probs
(`answer_values.ragged_answer_logprobs`, right-padded answers after prompts of their own
lengths) and PPO's answer values (`answer_values.answer_values`, prompts left-padded), within
float32 rounding, under Ulysses and under the ring's zigzag split (whose token order the
forward puts back)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from runs import bytes_per_device
from test_packed_rollout import G, P, gpt, llama, ppo_rollout, rollout
from zeroxla.engine.frozen_codes import FrozenCodesView
from zeroxla.engine.sequence import in_sequence_layout, out_of_sequence_layout
from zeroxla.engine.token_forward import TokenForward
from zeroxla.models.sequence_parallel import SequenceParallel
from zeroxla.rlhf.answer_forward import AnswerForward
from zeroxla.rlhf.grpo.losses import make_grpo_loss, ragged_answer_logprobs
from zeroxla.rlhf.ppo.losses import answer_values, make_critic_loss
from zeroxla.rlhf.reward_model import RewardModel
from zeroxla.sharding.stored_forms import StoredCodes


def _step(model, loss_fn, strategy):
    config = zeroxla.ZeroConfig(stage=3, sequence_parallel_strategy=strategy)
    return zeroxla.make_step(model, zeroxla.make_mesh(2, 2, sequence=2), optimizer=optax.sgd(0.1),
                             loss_fn=loss_fn, config=config)


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_policy_logprobs_in_the_step_layout_equal_the_gathered_forward(strategy):
    padded = rollout(12, seed=31)
    step = _step(llama(), make_grpo_loss(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
                 strategy)
    state = step.init(0)
    mask = padded["action_mask"]
    got = AnswerForward(step, "logprobs")(
        state, padded["tokens"], mask, padded["prompt_lengths"])
    want = np.asarray(ragged_answer_logprobs(
        zeroxla.gathered_model(state), jnp.asarray(padded["tokens"]),
        jnp.asarray(padded["prompt_lengths"]), G)) * mask
    assert got.shape == (12, G) and np.all(got[mask == 0] == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert np.abs(want).max() > 1.0


def test_critic_values_in_the_step_layout_equal_the_gathered_forward():
    padded = ppo_rollout(12, seed=37)
    critic = RewardModel(gpt())
    critic.v_head[...] = jax.random.normal(jax.random.key(5), critic.v_head[...].shape)
    step = _step(critic, make_critic_loss(0.2), "ulysses")
    state = step.init(0)
    mask = padded["action_mask"]
    got = AnswerForward(step, "values")(state, padded["tokens"], mask)
    want = np.asarray(answer_values(zeroxla.gathered_model(state),
                                    jnp.asarray(padded["tokens"]), G)) * mask
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert np.abs(want).max() > 0.1 and P > 1


def plain(model, batch):
    """A forward that knows nothing of sequence parallelism."""
    return model(batch["inputs"])


def test_a_forward_that_takes_no_sequence_is_refused_by_name():
    step = _step(llama(), make_grpo_loss(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
                 "ulysses")
    with pytest.raises(ValueError, match="fn plain takes no `sequence` argument"):
        TokenForward(step, plain)
    with pytest.raises(ValueError, match="kind='logits' is invalid"):
        AnswerForward(step, "logits")


def test_the_zigzag_order_is_undone():
    sequence = SequenceParallel("sequence", 4, "ring")
    x = jnp.arange(2 * 24).reshape(2, 24)
    moved = in_sequence_layout({"x": x}, sequence)["x"]
    assert not np.array_equal(moved, x)
    np.testing.assert_array_equal(out_of_sequence_layout(moved, sequence), x)


def test_the_reference_is_a_copy_of_the_first_partitions_in_the_policys_layout():
    # Under sequence parallelism the frozen reference is the policy's first stored partitions:
    # its log-probs, read after the policy has taken a step (which donates the state it
    # advances), are still the starting model's.
    from zeroxla.rlhf.answer_forward import reference_partitions
    from zeroxla.rlhf.packed_rollout import pack_for_step
    loss_fn = make_grpo_loss(loss_type="dapo", epsilon=0.2, epsilon_high=0.2)
    step = _step(llama(), loss_fn, "ulysses")
    state = step.init(0)
    reference = reference_partitions(step, state, int8=False, owner="GRPOConfig")
    start = zeroxla.gathered_model(state)
    padded = rollout(8, seed=41)
    packed, _, _ = pack_for_step(padded, step.layout, loss_type="dapo", row_len=P + G - 1,
                                 token_budget=None, owner="GRPOConfig")
    state, _ = step(state, packed)
    forward = AnswerForward(step, "logprobs")
    args = (padded["tokens"], padded["action_mask"], padded["prompt_lengths"])
    want = np.asarray(ragged_answer_logprobs(
        start, jnp.asarray(padded["tokens"]), jnp.asarray(padded["prompt_lengths"]),
        G)) * padded["action_mask"]
    np.testing.assert_allclose(forward(reference, *args), want, rtol=0, atol=2e-5)
    assert np.abs(forward(state, *args) - want).max() > 1e-3       # the policy moved
    # As int8 codes (test_reference_int8.py reads them): stored for the policy's codes view,
    # which the policy's forward refuses to read, by name.
    codes = reference_partitions(step, state, int8=True, owner="GRPOConfig")
    assert isinstance(codes.step, FrozenCodesView) and forward.reading(codes).step is codes.step
    assert any(isinstance(x, StoredCodes) for x in codes.params.values())
    with pytest.raises(ValueError, match=r"frozen partitions given are stored for "
                                         r"FrozenCodesView's layout"):
        forward(codes, *args)
    assert forward.reading(reference) is forward


@pytest.mark.parametrize("packed", [True, False])
def test_without_a_sequence_axis_the_reads_are_partitioned_and_equal_the_gathered_forward(
        packed):
    # A 2x4 mesh without sequence parallelism (GRPO's and PPO's rollout-side reads): the
    # policy's and the reference's log-probs (the reference a copy of the first partitions)
    # equal the plain model's ragged forward; every device holds the same bytes of the
    # reference and of the program reading it (no model whole on device 0).
    from zeroxla.rlhf.answer_forward import reference_partitions
    padded = rollout(12, seed=43)            # 12 rows: padded up to 16 for 8 data replicas
    step = zeroxla.make_step(         # every leaf partitioned (the tiny model's are below 1e5)
        llama(), zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
        loss_fn=make_grpo_loss(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state = step.init(0)
    reference = reference_partitions(step, state, int8=False, owner="GRPOConfig")
    start = zeroxla.gathered_model(state)
    forward = AnswerForward(step, "logprobs", packed=packed)
    args = (padded["tokens"], padded["action_mask"], padded["prompt_lengths"])
    want = np.asarray(ragged_answer_logprobs(
        start, jnp.asarray(padded["tokens"]), jnp.asarray(padded["prompt_lengths"]),
        G)) * padded["action_mask"]
    for values in (forward(state, *args), forward(reference, *args)):
        np.testing.assert_allclose(values, want, rtol=0, atol=2e-5)
    held = bytes_per_device(reference.params)
    whole = sum(x.nbytes for x in jax.tree.leaves(nnx.state(start, nnx.Param)))
    assert max(held) <= 1.05 * min(held) and max(held) < whole / 2, (held, whole)
