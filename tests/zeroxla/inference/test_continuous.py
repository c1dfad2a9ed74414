"""Continuous batching over a paged KV cache (`HybridEngineConfig(batching="continuous")`)
against the static decode loop of the same engine (`batching="static"`, itself checked against
the unsharded model in test_hybrid_engine.py): the same tokens for every family template at
tp 1, 2 and 4, greedy and sampled (temperature, top-k, top-p, a vocabulary limit), with prompts
crossing pages, prompt chunks split over steps, queued prompts refilling freed slots and
sequences preempted when the pool runs out; a GRPO group's prompt prefilled once; one compiled
step for any prompts; and what the engine refuses by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeroxla
from zeroxla.models import (GPT, GPTConfig, Gemma2, Gemma2Config, Llama, LlamaConfig,
                            MistralConfig, Qwen2Config, Qwen3Config)

FAMILIES = {   # 8 query heads; KV heads 2 or 4 (tp 4 repeats 2 KV heads)
    "gpt": lambda: GPT(GPTConfig(init_std=0.2, d_model=64, num_heads=8), rngs=nnx.Rngs(0)),
    "llama": lambda: Llama(LlamaConfig(init_std=0.2, d_model=64, num_heads=8, num_kv_heads=2),
                           rngs=nnx.Rngs(1)),
    "qwen2": lambda: Llama(Qwen2Config(init_std=0.2, d_model=64, num_heads=8, num_kv_heads=4),
                           rngs=nnx.Rngs(2)),
    "qwen3": lambda: Llama(Qwen3Config(init_std=0.2, d_model=64, num_heads=8, num_kv_heads=4),
                           rngs=nnx.Rngs(3)),
    "mistral": lambda: Llama(MistralConfig(init_std=0.2, d_model=64, num_heads=8,
                                           num_kv_heads=2, sliding_window=5), rngs=nnx.Rngs(4)),
    "gemma2": lambda: Gemma2(Gemma2Config(init_std=0.2, num_heads=8, num_kv_heads=2,
                                          sliding_window=5, attn_softcap=2.0),
                             rngs=nnx.Rngs(5)),
}
# pages of 4 slots, 12 token places, 4 slots per data group: prompts cross pages, long ones
# are prefilled over several steps, and 7 prompts queue for the slots
SMALL = dict(kv_block_size=4, max_ragged_batch_size=12, max_ragged_sequence_count=4,
             max_out_tokens=32)


def _step(family):
    return zeroxla.make_step(FAMILIES[family](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.0), config=zeroxla.ZeroConfig(stage=3))


def _one_device_step(family):
    """The step on one device (one data group): the cheapest engine steps, for the daily
    tests that run many of them."""
    return zeroxla.make_step(FAMILIES[family](),
                             zeroxla.make_mesh(1, 1, devices=jax.devices()[:1]),
                             optimizer=optax.sgd(0.0), config=zeroxla.ZeroConfig(stage=3))


def _prompts(vocab, lengths=(1, 3, 9, 14, 5, 17, 2), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


def _engines(step, tp, **config):
    make = lambda batching, extra: zeroxla.HybridEngine(             # noqa: E731
        step.layout, zeroxla.HybridEngineConfig(inference_tp_size=tp, batching=batching,
                                                **{**SMALL, **extra}))
    return make("static", {}), make("continuous", config)


@pytest.fixture(scope="module")
def built():
    """`built(family)`: (`_step(family)`, its initial state), built once per module: the cases
    of a family at tp 1, 2 and 4 decode the same step's parameters (the learning rate is 0, the
    state is never updated), so they share one trace and compile of the step and its init."""
    steps = {}

    def step_and_state(family):
        if family not in steps:
            step = _step(family)
            steps[family] = step, step.init()
        return steps[family]
    return step_and_state


@pytest.fixture(scope="module")
def one_device_gpt():
    """(`_one_device_step("gpt")`, its initial state): the two daily cases on one device
    decode the same parameters."""
    step = _one_device_step("gpt")
    return step, step.init()


@pytest.fixture(scope="module")
def engines(built):
    """`engines(family, tp)`: (step, state, static engine, continuous engine) of `_engines` at
    the SMALL settings, built once per module: the cases that decode a family at one tp share
    the engines' compiled programs (`stats` is each engine's last generation's)."""
    made = {}

    def of(family, tp):
        if (family, tp) not in made:
            step, state = built(family)
            made[family, tp] = (step, state, *_engines(step, tp))
        return made[family, tp]
    return of


def _assert_same(static, continuous, state, prompts, **kw):
    want = static.generate(state, prompts, **kw)
    got = continuous.generate(state, prompts, **kw)
    if kw.get("return_logprobs"):
        (want, want_lp), (got, got_lp) = want, got
        for a, b in zip(want_lp, got_lp):
            np.testing.assert_allclose(b, a, atol=1e-5)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(b, a, err_msg=f"prompt {i}")
    return got


def _matrix():
    fast = {("llama", 2)}
    return [pytest.param(f, tp, marks=() if (f, tp) in fast else pytest.mark.slow)
            for f in FAMILIES for tp in (1, 2, 4)]


@pytest.mark.parametrize("family,tp", _matrix())
def test_greedy_equals_the_static_engine(family, tp, engines):
    step, state, static, continuous = engines(family, tp)
    assert continuous.batching == "continuous"
    vocab = step.layout.vocab_size
    out = _assert_same(static, continuous, state, _prompts(vocab), max_new_tokens=12)
    assert all(o.size == p.size + 12 for o, p in zip(out, _prompts(vocab)))
    # EOS: the most common first new token, so that some rows end early and free their slot
    eos = int(np.bincount([o[p.size] for o, p in zip(out, _prompts(vocab))]).argmax())
    _assert_same(static, continuous, state, _prompts(vocab, seed=1), max_new_tokens=10,
                 eos_id=eos)
    assert continuous.stats["generated_tokens"] > 0


@pytest.mark.slow  # daily: per-row knobs, logprobs in test_two_prompts_in_one_batch_each_...
@pytest.mark.parametrize("knobs", [dict(temperature=0.7, top_k=5),
                                   dict(temperature=1.3, top_p=0.8, vocab_limit=60),
                                   dict(temperature=1.0)], ids=["top-k", "top-p-limit", "t1"])
def test_sampled_tokens_and_logprobs_equal_the_static_engine(knobs, engines):
    step, state, static, continuous = engines("llama", 2)
    _assert_same(static, continuous, state, _prompts(step.layout.vocab_size),
                 max_new_tokens=9, seed=11, return_logprobs=True, **knobs)


@pytest.mark.slow  # daily: rows ending early (EOS) in test_greedy_equals_the_static_engine[llama-2]
def test_rows_end_at_their_own_max_new_tokens(engines):
    step, state, static, continuous = engines("gpt", 1)
    prompts = _prompts(step.layout.vocab_size)
    news = [0, 5, 1, 12, 3, 7, 2]
    out = _assert_same(static, continuous, state, prompts, max_new_tokens=news)
    assert [o.size - p.size for o, p in zip(out, prompts)] == news
    with pytest.raises(ValueError, match=r"max_new_tokens has 2 entries.*one per prompt \(7\)"):
        continuous.generate(state, prompts, max_new_tokens=[1, 2])


@pytest.mark.slow  # daily: preemption in test_a_group_on_a_pool_of_one_sequence_preempts_...
def test_a_full_pool_preempts_and_recomputes_with_the_same_tokens(engines):
    step, state, static, _ = engines("llama", 4)    # the static engine takes no kv_blocks
    # 9 pages of 4 slots (null page included): two 32-token sequences cannot both fit
    _, continuous = _engines(step, 4, kv_blocks=9)
    _assert_same(static, continuous, state, _prompts(step.layout.vocab_size),
                 max_new_tokens=15)
    assert continuous.stats["preemptions"] > 0
    assert continuous.stats["peak_pages_in_use"] <= 8


@pytest.mark.slow  # daily: a group against its answers alone in test_a_group_on_a_pool_of_one_...
def test_a_group_prefills_its_prompt_once_and_answers_as_separate_calls(engines):
    step, state, _, continuous = engines("qwen3", 2)
    prompts, seeds = _prompts(step.layout.vocab_size)[:4], [3, 4, 5]
    grouped, drawn = continuous.generate_group(state, prompts, seeds, max_new_tokens=6,
                                               temperature=1.0, return_logprobs=True)
    assert continuous.stats["prefill_tokens"] == sum(p.size for p in prompts)
    for seed, outs, logps in zip(seeds, grouped, drawn):
        alone, alone_lp = continuous.generate(state, prompts, max_new_tokens=6,
                                              temperature=1.0, seed=seed, return_logprobs=True)
        assert continuous.stats["prefill_tokens"] == sum(p.size for p in prompts)
        for a, b, la, lb in zip(alone, outs, alone_lp, logps):
            np.testing.assert_array_equal(b, a)
            np.testing.assert_allclose(lb, la, atol=1e-6)
    assert len({tuple(o[0]) for o in grouped}) > 1          # the seeds drew differently


@pytest.mark.slow
def test_one_executable_serves_any_prompts():
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    step = _step("gpt")
    _, continuous = _engines(step, 2)
    state = step.init()
    continuous.generate(state, _prompts(step.layout.vocab_size), max_new_tokens=4)
    first = len(compiles)
    assert first > 0                          # the listener sees this JAX's compiles
    for seed, lengths in ((2, (20, 1)), (3, (4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4))):
        continuous.generate(state, _prompts(step.layout.vocab_size, lengths, seed),
                            max_new_tokens=[3] * len(lengths), temperature=0.5, top_k=3,
                            seed=seed)
    assert len(compiles) == first


def test_the_step_lowers_for_cuda(engines):
    from zeroxla.compat.lowering import lower_for_cuda

    _, state, _, continuous = engines("llama", 2)
    batcher = continuous.batcher(jax.random.key(0))
    text = lower_for_cuda(batcher.program, continuous.inference_params(state),
                          state.model_state, batcher.pools(),
                          *batcher.example_inputs()).as_text()
    assert "stablehlo.gather" in text and "stablehlo.scatter" in text


class OwnCacheGPT(GPT):
    """A user model with its own cache handling: it reads the dense cache's "k" itself."""

    def decode(self, tokens, positions, cache):
        assert cache["k"].ndim == 5
        return super().decode(tokens, positions, cache)


def test_a_model_that_cannot_take_pages_is_refused_or_decoded_static():
    model = OwnCacheGPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
    step = zeroxla.make_step(model, zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.0),
                             config=zeroxla.ZeroConfig(stage=3))
    with pytest.raises(ValueError, match=r"batching='continuous' needs a paged KV cache: "
                                         r"OwnCacheGPT.decode\(tokens, positions, PagedKV\) "
                                         r"raised TypeError.*batching='static'"):
        zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(batching="continuous",
                                                                    max_out_tokens=64))
    auto = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(max_out_tokens=64))
    assert auto.batching == "static" and "OwnCacheGPT.decode" in auto.batching_reason


def test_a_batch_invariant_model_is_refused_continuous_and_decoded_static():
    """The batch-invariant mode's attention reads a dense cache (`models.invariant_attention`):
    "continuous" is refused naming batch_invariant, "auto" batches statically."""
    from zeroxla.models.llama import Llama, LlamaConfig

    config = LlamaConfig.tiny().replace(batch_invariant=True)
    step = zeroxla.make_step(lambda: Llama(config, rngs=nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.0), config=zeroxla.ZeroConfig(stage=3))
    with pytest.raises(ValueError, match=r"batching='continuous' needs a paged KV cache: "
                                         r"Llama has batch_invariant=True.*batching='static'"):
        zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(batching="continuous",
                                                                    max_out_tokens=64))
    auto = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(max_out_tokens=64))
    assert auto.batching == "static" and "batch_invariant=True" in auto.batching_reason


@pytest.mark.parametrize("config,match", [
    (dict(batching="paged"), r"batching='paged' is invalid; accepted: 'auto', 'continuous'"),
    (dict(max_ragged_sequence_count=9, max_ragged_batch_size=8),
     r"max_ragged_sequence_count=9 > max_ragged_batch_size=8"),
    (dict(kv_blocks=4, kv_block_size=16, max_out_tokens=64),
     r"kv_blocks=4 is too few; accepted: at least 5"),
    (dict(kv_block_size=0), r"kv_block_size=0 is invalid"),
])
def test_bad_rollout_settings_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        zeroxla.HybridEngineConfig(**config)


def test_more_answers_than_slots_and_bad_seeds_are_refused(engines):
    step, state, _, continuous = engines("gpt", 1)
    prompts = _prompts(step.layout.vocab_size)[:2]
    with pytest.raises(ValueError, match=r"5 answers per prompt but "
                                         r"max_ragged_sequence_count=4"):
        continuous.generate_group(state, prompts, [1, 2, 3, 4, 5], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"seeds=\[\] is invalid"):
        continuous.generate_group(state, prompts, [], max_new_tokens=4)


@pytest.mark.slow          # the static side compiles a batch per distinct knob set
def test_each_prompt_may_carry_its_own_knobs(engines):
    """Per-prompt temperature / top-k in one call: the continuous step draws every row with
    its own knobs (`row_sampling`), the static engine decodes one padded batch per distinct
    knob set; both equal, and each row equals its prompt generated alone with its knobs."""
    step, state, static, continuous = engines("llama", 2)
    prompts = _prompts(step.layout.vocab_size)
    temperature = [0.0, 0.7, 1.3, 0.0, 1.0, 0.5, 2.0]
    top_k = [None, 5, None, 3, None, None, 10]
    got = _assert_same(static, continuous, state, prompts, max_new_tokens=8, seed=4,
                       temperature=temperature, top_k=top_k, top_p=0.9, return_logprobs=True)
    for i in (0, 1, 2, 6):
        alone = continuous.generate(state, [prompts[i]], max_new_tokens=8, seed=4,
                                    temperature=temperature[i], top_k=top_k[i], top_p=0.9)
        np.testing.assert_array_equal(got[i], alone[0])
    with pytest.raises(ValueError, match=r"temperature has 2 entries; accepted: a scalar, "
                                         r"or one per prompt \(7\)"):
        continuous.generate(state, prompts, max_new_tokens=2, temperature=[1.0, 0.5])
    with pytest.raises(ValueError, match=r"prompt 1: temperature=-1"):
        continuous.generate(state, prompts[:2], max_new_tokens=2, temperature=[1.0, -1.0])


# A nanoGPT written the way users write it (plain nnx.Linear / nnx.Embed / nnx.LayerNorm, a
# LayerStack of its blocks) whose block attends through zeroxla.models.attention: the engine
# decodes it with continuous batching, and its greedy tokens are the unsharded model's.
V, SEQ, D, HEADS = 65, 32, 32, 4


class PlainBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln_1, self.ln_2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.c_attn, self.c_proj = nnx.Linear(D, 3 * D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)
        self.c_fc, self.mlp_proj = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x, positions, cache=None):
        from zeroxla.models.attention import attention, cached_attention

        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, HEADS, D // HEADS)
                   for a in jnp.split(self.c_attn(self.ln_1(x)), 3, -1))
        if cache is None:
            a = attention(q, k, v)
        else:
            a, cache = cached_attention(q, k, v, positions, cache)
        x = x + self.c_proj(a.reshape(b, t, D))
        x = x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x))))
        return x if cache is None else (x, cache)


class PlainGPT(nnx.Module):
    def __init__(self, rngs):
        from zeroxla.models.layers import LayerStack

        self.wte, self.wpe = nnx.Embed(V, D, rngs=rngs), nnx.Embed(SEQ, D, rngs=rngs)
        self.blocks = LayerStack(PlainBlock, 2, rngs)
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)

    def forward(self, tokens, positions, cache=None):
        x, cache = self.blocks(self.wte(tokens) + self.wpe(positions), positions, cache=cache)
        return self.wte.attend(self.ln_f(x)), cache

    def __call__(self, tokens):
        return self.forward(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]),
                                                     tokens.shape))[0]

    def init_cache(self, batch, max_len):
        from zeroxla.models.layers import init_kv_cache

        return init_kv_cache(2, batch, max_len, HEADS, D // HEADS)

    def decode(self, tokens, positions, cache):
        return self.forward(tokens, positions, cache)


# Slow: the engine on user models is daily in test_user_model_generation.py, the paged decode
# through models.attention in test_greedy_equals_the_static_engine[llama-2].
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_plain_nnx_model_decodes_continuously_as_the_unsharded_model(tp):
    from inference_helpers import greedy_reference

    step = zeroxla.make_step(PlainGPT(nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adam(1e-2), config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    rng = np.random.default_rng(5)
    for _ in range(2):
        t = rng.integers(0, V, (8, SEQ + 1)).astype(np.int32)
        state, _ = step(state, {"inputs": t[:, :-1], "targets": t[:, 1:]})
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        inference_tp_size=tp, **{**SMALL, "max_out_tokens": SEQ}))
    assert engine.batching == "continuous"
    prompts = _prompts(V, (1, 3, 9, 14, 5))
    out = engine.generate(state, prompts, max_new_tokens=10)
    for got, want in zip(out, greedy_reference(step.gathered_model(state), prompts, 10)):
        np.testing.assert_array_equal(got, want)
    assert len({tuple(o[p.size:]) for o, p in zip(out, prompts)}) > 1, "degenerate model"


def test_a_group_on_a_pool_of_one_sequence_preempts_its_own_answers(one_device_gpt):
    # Issue 66: 1 prompt x 2 answers x 56 new tokens on 17 pages of 4 slots (the least
    # kv_blocks accepts for max_out_tokens 64) raised "no sequence could be scheduled" while
    # the same answers as separate calls ran: a group's answers shared one admission order,
    # so none could preempt another. Reference: each answer generated alone (generate_group's
    # definition) and, greedy, the unsharded model's tokens.
    from inference_helpers import greedy_reference

    step, state = one_device_gpt
    engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(
        **{**SMALL, "max_out_tokens": 64}, kv_blocks=17))
    prompt = _prompts(step.layout.vocab_size, (8,))
    seeds = [3, 4]
    grouped = engine.generate_group(state, prompt, seeds, max_new_tokens=56, temperature=1.0)
    assert engine.stats["preemptions"] > 0
    for seed, outs in zip(seeds, grouped):
        alone = engine.generate(state, prompt, max_new_tokens=56, temperature=1.0, seed=seed)
        np.testing.assert_array_equal(outs[0], alone[0])
    assert not np.array_equal(grouped[0][0], grouped[1][0])     # the seeds drew differently
    greedy = engine.generate_group(state, prompt, seeds, max_new_tokens=56)
    want = greedy_reference(state, prompt, 56)[0]
    for outs in greedy:
        np.testing.assert_array_equal(outs[0], want)


def test_two_prompts_in_one_batch_each_draw_with_their_own_knobs(one_device_gpt):
    # Issue 66, the daily check of per-prompt knobs (the slow test above also runs the static
    # engine): two prompts in one continuous batch, different temperature / top-k / top-p,
    # each equal to its prompt run alone with its own knobs and the same seed (a row's draws
    # depend on the seed, its prompt and its knobs only: `generate`'s contract). One
    # executable serves every call (the knobs are step data).
    step, state = one_device_gpt
    _, continuous = _engines(step, 1)
    prompts = _prompts(step.layout.vocab_size, (3, 9))
    knobs = [dict(temperature=0.7, top_k=5, top_p=None),
             dict(temperature=1.5, top_k=None, top_p=0.8)]
    together, drawn = continuous.generate(
        state, prompts, max_new_tokens=8, seed=4, return_logprobs=True,
        **{name: [k[name] for k in knobs] for name in knobs[0]})

    def alone(i, knob):
        return continuous.generate(state, [prompts[i]], max_new_tokens=8, seed=4,
                                   return_logprobs=True, **knob)

    for i, knob in enumerate(knobs):
        (out,), (logprobs,) = alone(i, knob)
        np.testing.assert_array_equal(together[i], out, err_msg=f"prompt {i}")
        np.testing.assert_allclose(drawn[i], logprobs, atol=1e-6)
    # the knobs matter: prompt 1 under prompt 0's knobs draws otherwise
    assert not np.array_equal(alone(1, knobs[0])[0][0], together[1])
