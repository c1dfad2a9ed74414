"""Routing replay (R3) where it matters: a bf16 rollout (`GRPOConfig.rollout_dtype`) of a tiny
Qwen3-MoE actor trained in float32 at expert parallelism 2, generated at tensor parallelism 2
under continuous batching. The rollout routes some (token, layer) pairs otherwise than the
float32 training forward: `routing_replay="measure"` logs that count (> 0), equal to a numpy
recount against the unsharded float32 actor. With `"on"` every fed token trains on its recorded
experts: the step's gradients (one SGD step, read back as (before - after) / learning rate)
equal a float64 reference of the GRPO loss with the record's selection fixed and the weights
from the live router (the unsharded actor in float64), router included, within float32's
round-off; the same reference with the float64 actor's own live selection is far off.

The actor is test_grpo_moe's with near-tied routers: in each layer experts 1 and 2, 3 and 4, 5
and 6 have router columns equal but for an offset of 3e-4 of the router's std, under bf16's step
(an element of 0.2 rounds to multiples of 2^-10), far over float32's. Where such a pair holds
the second place, float32 ranks its two experts by the offset, the bf16 rollout by its
rounding: a bf16 rollout flips those choices; float32 round-off between the sharded and the
unsharded forward flips none. No auxiliary loss: its statistics count the live router's own
top-k even under replay, near ties that float32 and float64 may break apart; the loss is the
policy term alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from job_runs import distinct_chars
from test_grpo_moe import EOS, TOKENIZER, actor
from test_grpo_routing_replay import numpy_mismatch

TIED = ((1, 2), (3, 4), (5, 6))    # expert pairs whose router columns differ below bf16's step
OFFSET = 3e-4                       # the pair's difference, x the router's std (~0.2 / 1000)
LR = 1e4                # SGD's step: (before - after) / LR is the gradient, its rounding ~1e-8
CONFIG = GRPOConfig(num_generations=2, prompts_per_iteration=4, prompt_length=8,
                    max_completion_length=5, rollout_dtype="bfloat16", learning_rate=LR)


def near_tied_actor():
    """test_grpo_moe's actor, auxiliary loss off, each `TIED` pair's router columns equal but
    for a random offset of `OFFSET` x the router's std (module docstring)."""
    model = actor()
    model = type(model)(model.config.replace(output_router_logits=False), rngs=nnx.Rngs(3))
    router = np.array(model.blocks.layers.moe.router.get_value())                 # [L, D, E]
    noise = np.random.default_rng(0).normal(size=router.shape[:2])
    for low, high in TIED:
        router[..., high] = router[..., low] + OFFSET * router.std() * noise
    model.blocks.layers.moe.router.set_value(jnp.asarray(router))
    return model


def trainer(mode, dtype="bfloat16"):
    return GRPOTrainer(CONFIG.replace(routing_replay=mode, rollout_dtype=dtype), near_tied_actor(),
                       mesh=zeroxla.make_mesh(2, 2, expert=2), tokenizer=TOKENIZER,
                       prompts=task.split_problems(16, 0)[0], reward_funcs=[distinct_chars],
                       inference_tp_size=2, eos_id=EOS, seed=0, optimizer=optax.sgd(LR))


def fed_ends(rollout):
    return rollout.answer_starts() + rollout.action_mask.sum(1).astype(np.int32) - 1


def params_of(model):
    return nnx.state(model, nnx.Param)


def reference_gradients(model, rollout, replay):
    """float64 gradients of the GRPO (dapo) loss of `rollout` under `model` cast to float64,
    every MoE layer sending each input token to `replay` [B, T, L, k]'s experts (None: the
    model's own live top-k), weighed by the live router; TRL's clipped surrogate at the first
    step on a rollout, whose old policy is these parameters (the ratio 1, its gradient the
    log-probs')."""
    eps, eps_high = CONFIG.epsilon, CONFIG.clip_high
    tokens = jnp.asarray(rollout.tokens)
    starts = rollout.answer_starts()
    mask = np.asarray(rollout.action_mask, np.float64)                               # [B, G]
    g = mask.shape[1]
    read = (starts[:, None] - 1 + np.arange(g)[None, :])                             # [B, G]
    rows = np.arange(tokens.shape[0])[:, None]
    with jax.enable_x64(True):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)

        def loss(params):
            m = nnx.merge(graphdef, params, rest)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            if replay is None:
                logp, _ = m.routed_token_logprobs(inputs, labels)
            else:
                logp, _, _ = m.replayed_token_logprobs(inputs, labels,
                                                       jnp.asarray(replay[:, :-1]))
            answer = logp[rows, read]                                                # [B, G]
            ratio = jnp.exp(answer - jax.lax.stop_gradient(answer))     # pi_old: these params
            a = jnp.asarray(rollout.advantages, jnp.float64)[:, None]
            terms = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps, 1 + eps_high) * a)
            return jnp.sum(terms * mask) / mask.sum()

        return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(params))


@pytest.mark.slow
def test_a_bf16_rollout_routes_otherwise_and_measure_counts_it():
    """`measure`: the logged count equals the numpy recount against the unsharded float32
    actor, and it is > 0; the same actor's float32 rollout routes as training does (0)."""
    run = trainer("measure")
    assert run.engine.batching == "continuous" and run.engine.dtype == jnp.bfloat16
    record, rollout = run.iteration(0)
    differ, compared = numpy_mismatch(near_tied_actor(), rollout.tokens, rollout.routing,
                                      fed_ends(rollout))
    print(f"bf16 rollout, measure: routing/mismatch {record['routing/mismatch']} of "
          f"{compared} pairs; numpy {differ}")
    assert record["routing/mismatch"] == differ > 0
    assert record["routing/mismatch_fraction"] == pytest.approx(differ / compared)
    record, rollout = trainer("measure", "float32").iteration(0)
    assert record["routing/mismatch"] == numpy_mismatch(
        near_tied_actor(), rollout.tokens, rollout.routing, fed_ends(rollout))[0] == 0


@pytest.mark.slow
def test_replay_trains_on_the_bf16_rollouts_selection():
    """`on`: every fed token has a record (the selection the replayed forward uses at every
    token and layer), the live mismatch is still logged (> 0), and the step's gradients equal
    the float64 reference with the record's selection within 2e-6 of each leaf's largest
    (float32's floor here: 1.2e-6 measured, and the unsharded float32 actor's own gradients
    are 2.0e-6 off the float64 ones), while the reference with the live selection is > 1e-2
    off (0.13 measured): the step trained on the record, not on its own choice."""
    run = trainer("on")
    before = params_of(zeroxla.gathered_model(run.actor_state))
    record, rollout = run.iteration(0)
    after = params_of(zeroxla.gathered_model(run.actor_state))
    got = jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - np.asarray(a, np.float64)) / LR,
                       before, after)
    differ, _ = numpy_mismatch(near_tied_actor(), rollout.tokens, rollout.routing,
                               fed_ends(rollout))          # asserts a record on every fed token
    assert record["routing/mismatch"] == differ > 0
    model = near_tied_actor()
    want = reference_gradients(model, rollout, rollout.routing)
    live = reference_gradients(model, rollout, None)
    worst, worst_live = 0.0, 0.0
    for (path, g), w, lv in zip(jax.tree_util.tree_leaves_with_path(got),
                                jax.tree.leaves(want), jax.tree.leaves(live)):
        name, scale = jax.tree_util.keystr(path), np.abs(w).max()
        if "router" in name:
            assert scale > 0, name
        err = np.abs(g - w).max() / max(scale, 1e-30)
        worst = max(worst, err)
        worst_live = max(worst_live, np.abs(lv - w).max() / max(scale, 1e-30))
        assert err <= 2e-6, (name, err)
    print(f"replayed step vs float64 reference: {worst:.2e} of the largest gradient; "
          f"the live-selection reference is {worst_live:.2e} off")
    assert worst_live > 1e-2
