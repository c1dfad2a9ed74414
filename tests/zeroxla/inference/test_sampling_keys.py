"""A prompt's continuation depends on the prompt and the seed alone: not on the other prompts of
the call, nor on its place among them, nor on the batch and prompt buckets they lead to. Each
row draws with keys folded from the seed, a hash of its own token ids and the decode step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inference_helpers import prompts_of, train, zero3_step
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.inference.sampling import Sampling, next_token, prompt_hash

NEW = 8
SAMPLED = {"temperature": 1.0, "top_p": 0.9}


@pytest.fixture(scope="module")
def gpt():
    step = zero3_step("gpt-tiny")
    state = train(step, 3)
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    yield engine, state
    engine.release()


# The engine-level daily check of this contract: test_continuous.py's
# test_two_prompts_in_one_batch_each_draw_with_their_own_knobs (two prompts together vs alone).
@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_same_prompt_and_seed_same_tokens_whatever_the_neighbours(gpt, sampling):
    engine, state = gpt
    prompt, *others = prompts_of((5, 3, 7, 1, 2, 12, 4), seed=11)

    def continuation(prompts, index, seed=7):
        outs = engine.generate(state, prompts, max_new_tokens=NEW, seed=seed, **sampling)
        np.testing.assert_array_equal(outs[index][:prompt.size], prompt)
        return outs[index]

    alone = continuation([prompt], 0)                       # batch bucket 4, prompt bucket 8
    between = continuation([others[0], prompt, others[1]], 1)
    # another place, other neighbours, batch bucket 8 and prompt bucket 16 (a 12-token row)
    elsewhere = continuation([*others[2:], prompt], 4)
    twice = engine.generate(state, [prompt, others[0], prompt], max_new_tokens=NEW, seed=7,
                            **sampling)
    for out in (between, elsewhere, twice[0], twice[2]):
        np.testing.assert_array_equal(out, alone)
    if sampling:
        greedy = engine.generate(state, [prompt], max_new_tokens=NEW)[0]
        reseeded = [continuation([prompt], 0, seed=s) for s in (8, 9, 10)]
        assert any(not np.array_equal(r, alone) for r in reseeded), "the seed is not used"
        assert any(not np.array_equal(r, greedy) for r in [alone, *reseeded]), "not sampled"


@pytest.mark.slow          # trains and builds the engine of the fixture for one check
def test_typed_key_seed_is_the_int_seed(gpt):
    engine, state = gpt
    prompts = prompts_of((3, 5))
    by_int = engine.generate(state, prompts, max_new_tokens=4, seed=3, **SAMPLED)
    by_key = engine.generate(state, prompts, max_new_tokens=4, seed=jax.random.key(3), **SAMPLED)
    for a, b in zip(by_int, by_key):
        np.testing.assert_array_equal(a, b)


def test_prompt_hash_ignores_padding_and_tells_prompts_apart():
    rows = [np.array([5]), np.array([5, 0]), np.array([0, 5]), np.array([0]), np.array([0, 0])]

    def hashes(width):
        tokens = np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :row.size] = row
            tokens[i, row.size:] = 9                   # padding holds anything
        lengths = jnp.asarray([row.size for row in rows], jnp.int32)
        return np.asarray(prompt_hash(jnp.asarray(tokens), lengths))

    np.testing.assert_array_equal(hashes(2), hashes(16))
    assert len(set(hashes(4).tolist())) == len(rows)


def test_each_row_draws_with_its_own_key_from_its_own_logits():
    logits = jax.random.normal(jax.random.key(1), (6, 50))
    keys = jax.random.split(jax.random.key(2), 6)
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    batch = np.asarray(next_token(logits, keys, sampling))
    for b in range(6):
        assert next_token(logits[b:b + 1], keys[b:b + 1], sampling)[0] == batch[b]
    order = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(next_token(logits[order], keys[order], sampling), batch[order])
