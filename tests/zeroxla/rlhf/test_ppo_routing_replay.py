"""PPO with routing replay (`PPOConfig.routing_replay`) on the tiny Qwen3-MoE actor of the GRPO
routing test (auxiliary loss off: PPO's loss returns no router statistics) trained at expert
parallelism 2: the rollout's record covers every token the answers' log-probs read, and the
logged `routing/mismatch` is the numpy count of recorded (token, layer) pairs where the
unsharded starting actor's full forward routes otherwise; the actor's packed loss replays
a record (another model's routing) against a float64 numpy clipped loss of the single-device
replayed log-probs; a dense actor and an unpacked rollout are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.rlhf import PPOConfig, PPOTrainer
from zeroxla.rlhf.packed_rollout import pack_rollout
from zeroxla.rlhf.ppo.losses import make_actor_loss
from test_grpo_moe import EOS, TOKENIZER, actor
from test_grpo_routing_replay import numpy_mismatch

CONFIG = PPOConfig(prompts_per_iteration=8, prompt_length=8, answer_length=5, ppo_epochs=1,
                   actor_lr=1e-2, critic_lr=1e-2)


def moe_actor():
    """The GRPO routing test's actor (same weights), its auxiliary loss off."""
    config = actor().config.replace(output_router_logits=False)
    return models.REGISTRY["qwen3_moe"].model_class(config, rngs=nnx.Rngs(3))


def prompts(n=16):
    """int32 [n, P] prompts of the tokenizer's ids but EOS (answers end at their own EOS)."""
    rng = np.random.default_rng(0)
    ids = np.setdiff1d(np.arange(1, TOKENIZER.vocab_size), [EOS])
    return rng.choice(ids, (n, CONFIG.prompt_length)).astype(np.int32)


def trainer(config, policy=None):
    return PPOTrainer(config, moe_actor() if policy is None else policy,
                      mesh=zeroxla.make_mesh(2, 2, expert=2), tokenizer=TOKENIZER,
                      prompt_tokens=prompts(), reward_fn=lambda text: len(set(text)) / 6,
                      inference_tp_size=1, eos_id=EOS, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["measure", "on"])
def test_ppo_logs_the_routing_mismatch_of_its_rollout(mode):
    """One iteration: the engine records the routing under continuous batching (the job's
    default with an EOS), the record covers every fed token of every row (so under "on" the
    actor trains on its rollout's experts), and `routing/mismatch` (with its fraction) is the
    numpy count against the starting actor (float32, tp 1: 0 measured)."""
    run = trainer(CONFIG.replace(routing_replay=mode))
    assert run.engine.batching == "continuous"
    record, rollout = run.iteration(0)
    differ, compared = numpy_mismatch(moe_actor(), rollout.tokens, rollout.routing,
                                      rollout.prompt_length + rollout.action_mask.sum(1) - 1)
    assert record["routing/mismatch"] == differ
    assert record["routing/mismatch_fraction"] == pytest.approx(differ / compared)
    assert np.isfinite(record["actor_loss"]) and np.isfinite(record["critic_loss"])
    assert ("replay" in run.batches(rollout)[0][0]) == (mode == "on")


def test_routing_replay_is_refused_by_name():
    """Without packing (the replayed forward is the packed one), an unknown mode, and a dense
    actor (its decode records no routing)."""
    with pytest.raises(ValueError, match="PPOConfig.routing_replay='on'"):
        CONFIG.replace(routing_replay="on", packing=False)
    with pytest.raises(ValueError, match="PPOConfig.routing_replay='sometimes'"):
        CONFIG.replace(routing_replay="sometimes")
    dense = models.build("gpt-tiny", seed=0)
    with pytest.raises(ValueError, match="return_routing=True with a GPT"):
        trainer(CONFIG.replace(routing_replay="measure"), dense)


def test_the_actor_loss_replays_the_packed_record():
    """`make_actor_loss` on a packed rollout carrying another model's record ("replay"): the
    loss is the float64 numpy clipped surrogate (token mean) of the single-device model's
    replayed answer log-probs, and not the live-routed one's."""
    b, p, g = 4, 5, 4
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, TOKENIZER.vocab_size, (b, p + g)).astype(np.int32)
    answers = np.array([4, 1, 3, 2])
    mask = (np.arange(g) < answers[:, None]).astype(np.float32)             # [B, G]
    tokens[:, p:] *= mask.astype(np.int32)
    model, other = moe_actor(), actor().config.replace(output_router_logits=False)
    other = models.REGISTRY["qwen3_moe"].model_class(other, rngs=nnx.Rngs(11))
    fed = np.arange(p + g)[None, :] < (p + answers - 1)[:, None]           # [B, P + G]
    experts, _ = jax.jit(other.router_choices)(jnp.asarray(tokens))        # [L, B, T, k]
    record = np.where(fed[..., None, None], np.moveaxis(np.asarray(experts), 0, 2), -1)
    replayed, _, _ = jax.jit(model.replayed_token_logprobs)(
        jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(record[:, :-1]))
    plain, _, _ = jax.jit(model.replayed_token_logprobs, static_argnames="follow_record")(
        jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(record[:, :-1]),
        follow_record=False)
    want, live = (np.asarray(v, np.float64)[:, p - 1:] for v in (replayed, plain))  # [B, G]
    assert np.abs((want - live) * mask).max() > 1e-3         # the record changes the answers
    old = want + rng.normal(0, 0.3, want.shape)
    advantages = rng.normal(0, 1, want.shape)
    rows = {"tokens": tokens, "action_mask": mask, "routing": record,
            "old_logprobs": old.astype(np.float32), "advantages": advantages.astype(np.float32)}
    packed, _ = pack_rollout(rows, loss_type="dapo", row_len=p + g - 1, data_size=1)
    loss = jax.jit(make_actor_loss(0.2))
    total, count = loss(model, {k: jnp.asarray(v) for k, v in packed.items()})

    def numpy_loss(logprobs):
        ratio = np.exp((logprobs - old) * mask)
        terms = np.maximum(-advantages * ratio, -advantages * np.clip(ratio, 0.8, 1.2))
        return np.sum(terms * mask) / mask.sum()

    assert float(count) == mask.sum()
    np.testing.assert_allclose(float(total) / float(count), numpy_loss(want), rtol=1e-5)
    assert abs(numpy_loss(want) - numpy_loss(live)) > 1e-3
