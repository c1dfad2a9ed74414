"""The RL jobs' frozen reference as int8 codes of the policy's first partitions
(`--reference-int8`; zeroxla/rlhf/answer_forward.py, zeroxla/engine/frozen_codes.py).

Against a float64 reference: the starting weights rounded to int8 in float64 numpy
(tests/support/numpy_quant.py, DeepSpeed's group formulas; each device's shard in the groups its
codes use) and the model run in float64 on one device. Where a weight lies within float32's
rounding of a .5 boundary (a near tie) the float32 quantizer may store the neighbouring code:
there the reference takes the code the device stored (at most NEAR_TIES_TAKEN of them differ
from float64's), everywhere else float64's rounding, which every other stored code equals
exactly. Stated tolerances:

- int8 codes against that float64 model: 2e-5 nats per answer token (the float32 forward's
  rounding, as the float reference's own tests);
- int8 codes against the float reference: at most ROUNDING_BOUND nats per answer token. Each
  weight moves by at most half its group's step (absmax / 254, 0.4% of the group's largest
  weight); on the tiny Llama that moves a log-prob by 4.1e-3 at most (measured), and the bound
  is five times that;
- GRPO's k3 KL per iteration record: the float run's within KL_BOUND.

Memory (the issue's Must-show): every rollout-side forward program of GRPO (--beta 0.04) and
PPO on the 2 x 4 mesh (the actor's old log-probs, the reference's, PPO's critic values), float
and int8 reference: each device's argument bytes (its shards of the program's inputs) equal
every other device's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from numpy_quant import (codes_at_near_ties, dequantize_groups64, from_shards64,
                         quantize_shards64, shard_index, unpad_groups)
from test_packed_rollout import G, llama, rollout
from zeroxla.rlhf.answer_forward import AnswerForward, reference_partitions
from zeroxla.rlhf.grpo.losses import make_grpo_loss, ragged_answer_logprobs

ROUNDING_BOUND = 2e-2        # nats per answer token, int8 against float (module docstring)
FLOAT32_ROUNDING = 2e-5      # nats per answer token, the float32 forward against float64
KL_BOUND = 1e-3              # GRPO's record "kl", int8 reference against float


def program_bytes(lowered) -> dict:
    """{device: bytes of its shards of the program's inputs} of a lowered program, from the
    compiled program's input shardings (what each device holds while it runs; an input the
    program does not read is not passed to it)."""
    compiled = lowered.compile()
    held = dict.fromkeys(jax.devices(), 0)
    infos = dict(jax.tree_util.tree_flatten_with_path(lowered.args_info)[0])
    shardings = dict(jax.tree_util.tree_flatten_with_path(compiled.input_shardings)[0])
    assert shardings.keys() <= infos.keys()
    for path, sharding in shardings.items():
        info = infos[path]
        shard = np.prod(sharding.shard_shape(info.shape), dtype=np.int64)
        for device in sharding.device_set:
            held[device] += int(shard) * np.dtype(info.dtype).itemsize
    return held


# At most this many of the stored codes (some 10^5 on the tiny Llama) may be the device's
# rounding of a near tie rather than float64's: a tie needs a float32 coincidence.
NEAR_TIES_TAKEN = 32


def int8_weights64(state, codes) -> tuple[dict, int]:
    """({path: float64 array} of the step's logical weights, each quantized leaf the int8 round
    trip of each device's shard in float64 numpy in the groups the codes use, the others as
    they are; how many near-tie codes the reference took from the device). `codes`:
    `reference_partitions(..., int8=True)`. Where a value lies within float32's rounding of a
    .5 boundary the device may store the neighbouring code (numpy_quant's `near_tie`): there
    the reference takes the code the device stored, everywhere else it must equal float64's
    rounding exactly (`codes_at_near_ties`)."""
    params = nnx.to_flat_state(nnx.state(zeroxla.gathered_model(state), nnx.Param))
    leaves = {leaf.path: leaf for leaf in codes.step.layout.plan.leaves
              if leaf.params_quantized}
    out, taken = {}, 0
    for path, var in params:
        name = "/".join(str(k) for k in path)
        x = np.asarray(var.get_value(), np.float64)
        if name not in leaves:
            out[path] = x
            continue
        leaf = leaves[name]
        assert not leaf.stage_split and leaf.storage_bits == 8, leaf
        index = shard_index(x.shape, leaf.shard_dim, leaf.padded_size, leaf.data_size,
                            leaf.stacked)
        assert index.shape == (leaf.layers * leaf.data_size, leaf.chunk), (name, index.shape)
        expected = quantize_shards64(x, index, bits=8, group_size=leaf.storage_group_size)
        stored = np.asarray(codes.params[name].data).reshape(expected.codes.shape)
        rounded, moved = codes_at_near_ties(stored, expected)
        taken += moved
        rows = unpad_groups(dequantize_groups64(rounded.codes, rounded.steps), index.shape, 1)
        out[path] = from_shards64(rows, index, x.shape)
    return out, taken


def float64_logprobs(weights, padded):
    """The ragged answer log-probs [B, G] of `llama()` holding `weights`, in float64 on one
    device."""
    with jax.enable_x64(True):
        model = llama()
        graphdef, params = nnx.split(model, nnx.Param)
        flat = nnx.to_flat_state(params)
        for path, var in flat:
            var.set_value(jnp.asarray(weights[path], jnp.float64))
        rest = nnx.state(model, nnx.Not(nnx.Param))

        @jax.jit
        def run(p, tokens, starts):
            values = ragged_answer_logprobs(nnx.merge(graphdef, p, rest), tokens, starts, G)
            assert values.dtype == jnp.float64
            return values
        values = run(nnx.from_flat_state(flat), jnp.asarray(padded["tokens"]),
                     jnp.asarray(padded["prompt_lengths"]))
        return np.asarray(values) * padded["action_mask"]


@functools.cache
def _step_2x4():
    step = zeroxla.make_step(         # every leaf partitioned (the tiny model's are below 1e5)
        llama(), zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.1),
        loss_fn=make_grpo_loss(loss_type="dapo", epsilon=0.2, epsilon_high=0.2),
        config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
    return step, step.init(0)


def test_int8_reference_equals_the_float64_dequantized_model_and_holds_a_quarter_of_the_bytes():
    step, state = _step_2x4()
    padded = rollout(12, seed=43)
    args = (padded["tokens"], padded["action_mask"], padded["prompt_lengths"])
    float_copy = reference_partitions(step, state, int8=False, owner="GRPOConfig")
    codes = reference_partitions(step, state, int8=True, owner="GRPOConfig")
    forward = AnswerForward(step, "logprobs")
    int8_forward = forward.reading(codes)
    got, exact = int8_forward(codes, *args), forward(float_copy, *args)

    weights, taken = int8_weights64(state, codes)
    assert taken <= NEAR_TIES_TAKEN, taken
    want = float64_logprobs(weights, padded)
    np.testing.assert_allclose(got, want, rtol=0, atol=FLOAT32_ROUNDING)
    moved = float(np.abs(got - exact).max())
    print(f"near-tie codes taken from the device: {taken}; "
          f"int8 vs float64 dequantized: {np.abs(got - want).max():.2e}; "
          f"int8 vs float: {moved:.2e} of log-probs up to {np.abs(exact).max():.2f}")
    assert 1e-4 < moved <= ROUNDING_BOUND

    # The compiled reference forward: every device holds the same bytes of its inputs, and
    # about a quarter of what the float copy's holds (int8 codes and one float32 scale per
    # group of g elements: 1 + 4/g bytes per weight against 4).
    int8_bytes = program_bytes(int8_forward.lower(codes, *args))
    float_bytes = program_bytes(forward.lower(float_copy, *args))
    print(f"reference forward input bytes per device: int8 {sorted(set(int8_bytes.values()))}, "
          f"float {sorted(set(float_bytes.values()))}")
    assert len(set(int8_bytes.values())) == 1 and len(set(float_bytes.values())) == 1
    groups = [leaf.storage_group_size for leaf in codes.step.layout.plan.leaves
              if leaf.params_quantized]
    ratio = int8_bytes[jax.devices()[0]] / float_bytes[jax.devices()[0]]
    assert 0.25 < ratio < 0.25 * (1 + 4 / min(groups)) + 0.05, (ratio, min(groups))


def rollout_side_bytes(forwards, rows) -> dict:
    """{name: ({device: argument bytes}, temp bytes)} of each named (AnswerForward, state)'s
    program on `rows` (tokens, mask[, prompt_lengths])."""
    out = {}
    for name, (forward, state) in forwards.items():
        lowered = forward.lower(state, *rows)
        out[name] = (program_bytes(lowered), lowered.compile().memory_analysis().temp_size_in_bytes)
    return out


def assert_balanced(figures):
    """Device 0's argument bytes within 5% of every other device's, for every program."""
    for name, (held, temp) in figures.items():
        first = held[jax.devices()[0]]
        print(f"{name}: device 0 {first} B of inputs (others {sorted(set(held.values()))}), "
              f"temp {temp} B per device")
        assert all(abs(first - other) <= 0.05 * other for other in held.values()), (name, held)


@pytest.mark.slow
def test_every_rollout_side_forward_of_grpo_and_ppo_holds_the_same_bytes_on_every_device():
    # GRPO --beta 0.04 and PPO, llama-tiny-shaped actors on the 2 x 4 mesh, no sequence
    # parallelism: the actor's old log-probs, the reference's (float copy and int8 codes) and
    # PPO's critic values.
    import dataclasses

    from job_runs import distinct_chars
    from test_grpo import CONFIG as GRPO, EOS, TOKENIZER
    from zeroxla import models, rlhf
    from zeroxla.app import data
    from zeroxla.rlhf.grpo import arithmetic_task as task
    from zeroxla.rlhf.grpo.trainer import GRPOTrainer

    mesh = zeroxla.make_mesh(2, 4)
    # MLP layers of 192 x 768 parameters: over the persistence threshold (1e5), so they
    # are partitioned 1/8 per device, as a real model's are (llama-tiny's own stay whole)
    wide = dict(d_model=192, mlp_dim=768, max_seq_len=32)
    actor = models.build("llama-tiny", vocab_size=TOKENIZER.vocab_size, seed=3, **wide)
    whole = sum(x.nbytes for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
    grpo = GRPOTrainer(dataclasses.replace(GRPO, reference_int8=True), actor,
                       mesh=mesh, tokenizer=TOKENIZER, prompts=task.split_problems(32, 0)[0],
                       reward_funcs=[distinct_chars], eos_id=EOS, seed=0)
    rng = np.random.default_rng(0)
    b, p, t = 16, GRPO.prompt_length, GRPO.max_completion_length
    rows = (rng.integers(1, TOKENIZER.vocab_size, (b, p + t)).astype(np.int32),
            np.ones((b, t), np.float32), np.full(b, p, np.int32))
    float_copy = reference_partitions(grpo.actor_step, grpo.actor_state, int8=False,
                                      owner="GRPOConfig")
    figures = rollout_side_bytes({
        "grpo actor": (grpo.answers, grpo.actor_state),
        "grpo reference float": (grpo.answers, float_copy),
        "grpo reference int8": (grpo.reference_answers, grpo.reference_state)}, rows)
    assert_balanced(figures)
    for name, (held, _) in figures.items():          # no device holds the whole model
        assert max(held.values()) < whole / 2, (name, held, whole)

    corpus = data.load_corpus()
    config = rlhf.PPOConfig(prompts_per_iteration=16, prompt_length=8, answer_length=12,
                            reference_int8=True)
    actor = models.build("llama-tiny", vocab_size=corpus.tokenizer.vocab_size, seed=0, **wide)
    whole = sum(x.nbytes for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))
    ppo = rlhf.PPOTrainer(config, actor,
                          mesh=mesh, tokenizer=corpus.tokenizer, prompt_tokens=corpus.val,
                          seed=0)
    b, p, t = 16, config.prompt_length, config.answer_length
    rows = (rng.integers(1, corpus.tokenizer.vocab_size, (b, p + t)).astype(np.int32),
            np.ones((b, t), np.float32))
    float_copy = reference_partitions(ppo.actor_step, ppo.actor_state, int8=False,
                                      owner="PPOConfig")
    figures = rollout_side_bytes({
        "ppo actor": (ppo.answers, ppo.actor_state),
        "ppo reference float": (ppo.answers, float_copy),
        "ppo reference int8": (ppo.reference_answers, ppo.reference_state),
        "ppo critic": (ppo.values, ppo.critic_state)}, rows)
    assert_balanced(figures)
    for name, (held, _) in figures.items():
        assert max(held.values()) < whole / 2, (name, held, whole)


@pytest.mark.slow
def test_grpo_with_an_int8_reference_records_the_float_references_kl():
    # Two iterations of GRPO (--beta 0.04) from the same actor and seeds, the reference a float
    # copy or int8 codes: the same rollouts' KL to the reference within KL_BOUND.
    import dataclasses

    from job_runs import distinct_chars
    from test_grpo import CONFIG as GRPO, EOS, TOKENIZER, tiny_actor
    from zeroxla.rlhf.grpo import arithmetic_task as task
    from zeroxla.rlhf.grpo.trainer import GRPOTrainer

    records = {}
    for int8 in (False, True):
        trainer = GRPOTrainer(dataclasses.replace(GRPO, reference_int8=int8), tiny_actor(),
                              mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                              prompts=task.split_problems(32, 0)[0],
                              reward_funcs=[distinct_chars], eos_id=EOS, seed=0)
        records[int8] = [trainer.iteration(it)[0] for it in range(2)]
    for exact, codes in zip(records[False], records[True]):
        print(f"iteration {exact['iteration']}: kl float {exact['kl']:.3e}, "
              f"int8 {codes['kl']:.3e}, loss {exact['loss']:.6f} / {codes['loss']:.6f}")
        assert abs(codes["kl"] - exact["kl"]) <= KL_BOUND
    assert records[True][1]["kl"] > 0


def test_reference_int8_is_validated():
    assert zeroxla.rlhf.PPOConfig(reference_int8=True).reference_int8
    with pytest.raises(ValueError, match="reference_int8"):
        zeroxla.rlhf.PPOConfig(reference_int8="yes")
