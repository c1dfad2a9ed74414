"""Routing replay (R3) on a rollout's rows: the record [B, P + G, L, k] beside the padded rows
packed with them (each slot its input token's record), the actor's answer log-probs read in the
step's layout at expert parallelism 2 under the record, and the `routing/mismatch` count, each
against the plain single-device model (its own live router choices, counted in numpy)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.rlhf.answer_forward import AnswerForward
from zeroxla.rlhf.packed_rollout import pack_rollout

CONFIG = models.Qwen3MoeConfig(vocab_size=64, max_seq_len=32, d_model=32, num_heads=4,
                               num_kv_heads=2, explicit_head_dim=8, num_layers=2, mlp_dim=48,
                               num_experts=8, experts_per_token=2, expert_mlp_dim=16,
                               router_aux_loss_coef=0.01, output_router_logits=True,
                               expert_tile=4, init_std=0.2)


def moe(seed):
    return models.REGISTRY["qwen3_moe"].model_class(CONFIG, rngs=nnx.Rngs(seed))


def rows(b=6, p=5, g=4, seed=0):
    """Right-padded rows [B, P + G] (prompt L_b, answer A_b, zeros), their answer masks and
    prompt lengths."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(2, p + 1, b).astype(np.int32)
    answers = rng.integers(1, g + 1, b)
    tokens = np.zeros((b, p + g), np.int32)
    mask = (np.arange(g) < answers[:, None]).astype(np.float32)
    for i in range(b):
        tokens[i, :starts[i] + answers[i]] = rng.integers(1, 64, starts[i] + answers[i])
    return tokens, mask, starts


def test_pack_rollout_places_each_token_record_at_its_input_slot():
    """Every packed slot of a sequence holds the record of its input token: a record encoding
    (row, position) decodes, on every slot, to a token equal to the slot's input at the slot's
    position; slots of no sequence hold -1."""
    tokens, mask, starts = rows()
    b, t = tokens.shape
    code = (np.arange(b)[:, None] * 100 + np.arange(t)[None, :]).astype(np.int32)
    routing = np.broadcast_to(code[:, :, None, None], (b, t, 3, 2)).copy()
    packed, _ = pack_rollout({"tokens": tokens, "action_mask": mask, "prompt_lengths": starts,
                              "routing": routing}, loss_type="dapo", row_len=t - 1, data_size=2)
    replay = packed["replay"]
    assert replay.shape == packed["inputs"].shape + (3, 2)
    real = packed["segment_ids"] > 0
    assert np.all(replay[~real] == -1)
    assert np.all(replay == replay[..., :1, :1])               # whole records moved
    row, pos = replay[real][:, 0, 0] // 100, replay[real][:, 0, 0] % 100
    np.testing.assert_array_equal(tokens[row, pos], packed["inputs"][real])
    np.testing.assert_array_equal(pos, packed["positions"][real])
    assert real.sum() == (starts + mask.sum(1) - 1).sum()


def live_choices(model, tokens):
    """int32 [B, T, L, k]: the experts the single-device model's live router picks for each
    token of the padded rows (causal: a token's choice depends on its row's earlier tokens)."""
    experts, _ = jax.jit(model.router_choices)(jnp.asarray(tokens))        # [L, B, T, k]
    return np.moveaxis(np.asarray(experts), 0, 2)


@pytest.mark.slow   # daily replay: test_grpo_routing_replay.py's rollout, replayed and counted
def test_answer_forward_replays_a_record_at_expert_parallelism_2():
    """A ZeRO-3 actor at EP 2 x 4 data devices: with the record equal to the model's own live
    choices the replayed log-probs equal the single-device model's plain answer log-probs
    (float32 round-off) and nothing mismatches; with another model's record the mismatched
    (token, layer) pairs are the numpy count of recorded pairs whose expert sets differ from
    the single-device live ones, routed live (`follow_record=False`) the log-probs are again
    the plain ones, and replayed they are the single-device replayed forward's."""
    tokens, mask, starts = rows()
    model = moe(3)
    step = zeroxla.make_step(moe(3), zeroxla.make_mesh(2, 2, expert=2), optimizer=optax.sgd(0.0),
                             config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    state, answers = step.init(), AnswerForward(step, "logprobs")
    b, g = mask.shape
    at = starts[:, None] - 1 + np.arange(g)                                   # [B, G]
    plain = np.take_along_axis(np.asarray(jax.jit(model.token_logprobs)(
        jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))), at, 1) * mask
    # the record: every token of the prompt and of the answer but its last (never an input)
    fed = np.arange(tokens.shape[1])[None, :] < (starts + mask.sum(1) - 1)[:, None]   # [B, T]
    own = np.where(fed[..., None, None], live_choices(model, tokens), -1)
    logp, mismatched, compared = answers.replayed(state, tokens, mask, own, starts)
    assert (mismatched, compared) == (0, int(fed.sum()) * CONFIG.num_layers)
    np.testing.assert_allclose(logp, plain, rtol=0, atol=2e-6)
    other = np.where(fed[..., None, None], live_choices(moe(7), tokens), -1)
    differ = np.any(np.sort(other, -1) != np.sort(own, -1), -1) & fed[..., None]  # [B, T, L]
    assert 0 < differ.sum() < compared
    live, count, _ = answers.replayed(state, tokens, mask, other, starts, follow_record=False)
    assert count == int(differ.sum())
    np.testing.assert_allclose(live, plain, rtol=0, atol=2e-6)
    replayed, count, _ = answers.replayed(state, tokens, mask, other, starts)
    assert count == int(differ.sum())
    want, _, _ = jax.jit(model.replayed_token_logprobs)(
        jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(other[:, :-1]))
    want = np.take_along_axis(np.asarray(want), at, 1) * mask
    assert np.abs(want - plain).max() > 1e-3                 # the record changes the answers
    np.testing.assert_allclose(replayed, want, rtol=0, atol=2e-6)
