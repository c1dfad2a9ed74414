"""Qwen3.5 under continuous batching: the rollout engine's paged KV cache with the Gated DeltaNet
state of every sequence in a slot beside the pages (`models.recurrent_slots`), from the tiny
transformers-written checkpoint of tests/models/test_qwen3_5.py (8 layers: two periods of three
DeltaNet layers and one gated attention layer):

- `scan_places` (the places of a step through their slots' states, in each sequence's position
  order) equals a float64 numpy loop over each sequence alone;
- greedy tokens equal transformers' `generate` (prompts of 5 and 9 tokens, tp 2 daily and tp 1)
  with prompts prefilled in chunks of 4 places and a pool of 6 pages, too few for both
  sequences, so one is preempted and recomputed from its start;
- `generate_group` (a prompt's state copied once into each answer's slot) equals its answers
  drawn by separate calls, and the static engine's draws (tokens equal, log-probs within 1e-5).
The MoE variant's continuous greedy check is in test_qwen3_5_moe.py, the GRPO run under
continuous batching in test_qwen3_5.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import family_checkpoints
from family_checkpoints import save_random
from test_qwen3_5 import TEXT, VOCAB
from zeroxla.models.recurrent_slots import scan_places

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# prefill in chunks of 4 places; 2 sequences per group; 6 pages of 4 slots (+ the null page,
# the least kv_blocks takes for 24 positions): the prompts of 5 and 9 tokens with 12 new ones
# feed 16 and 20 tokens, 4 + 5 pages, in one group
SMALL_POOL = dict(kv_block_size=4, max_out_tokens=24, max_ragged_batch_size=4,
                  max_ragged_sequence_count=2, kv_blocks=7)


def test_scan_places_runs_each_sequence_in_position_order():
    """Two groups of 7 places: sequences in slots 0..2 (one starting at position 0, whose slot
    holds another sequence's old state), fillers on the null slot 3, the places out of order
    as a step sorts them; the state s <- 0.5 s + x per place (x [2]) and each place's output
    s, against each sequence run alone in float64."""
    rng = np.random.default_rng(0)
    slots = np.array([[2, 0, 2, 1, 0, 3, 2], [1, 1, 3, 0, 1, 3, 3]], np.int32)
    positions = np.array([[4, 7, 5, 0, 8, 0, 6], [2, 3, 0, 9, 4, 0, 0]], np.int32)
    order = np.stack([np.argsort(slots[d] * 100 + positions[d], kind="stable")
                      for d in range(2)]).astype(np.int32)     # each slot's places by position
    x = rng.standard_normal((2, 7, 2)).astype(np.float32)
    states = rng.standard_normal((2, 4, 2)).astype(np.float32)      # [D, S + 1, 2]

    def step(state, x_):
        state = 0.5 * state + x_
        return state, state

    got_states, got = jax.jit(lambda s, x_: scan_places(step, s, x_, positions, slots, order))(
        states, x)
    want, want_states = np.zeros((2, 7, 2)), states.astype(np.float64)
    for d in range(2):
        for slot in range(4):
            mine = np.flatnonzero(slots[d] == slot)
            for p in mine[np.argsort(positions[d, mine])]:
                prev = 0.0 if positions[d, p] == 0 else want_states[d, slot]
                want_states[d, slot] = want[d, p] = 0.5 * prev + x[d, p]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_states)[:, :3], want_states[:, :3], rtol=1e-6,
                               atol=1e-6)                      # the null slot holds anything


@pytest.fixture(scope="module")
def greedy_case(tmp_path_factory):
    """test_qwen3_5.py's checkpoint loaded into ZeRO-3 partitions on 2 x 4, prompts of 5 and 9
    tokens and transformers' greedy tokens (`family_checkpoints.greedy_case`)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**TEXT))
    checkpoint = save_random(model, tmp_path_factory.mktemp("qwen3_5"))
    return family_checkpoints.greedy_case(checkpoint, VOCAB, lengths=(5, 9))


def _engine(step, tp, batching="continuous"):
    from zeroxla.inference import HybridEngine, HybridEngineConfig

    return HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=tp, batching=batching,
                                                        **SMALL_POOL))


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_continuous_greedy_equals_transformers_and_groups_equal_separate_calls(greedy_case, tp):
    """Greedy: transformers' tokens, both prompts in one group of the engine (admitted to the
    emptiest group first), prefilled 4 places a step, the younger preempted and recomputed.
    Then a group of 2 answers per prompt at temperature 1 (each prompt's state computed once
    and copied into its second answer's slot) equals each answer drawn alone: tokens equal,
    log-probs within 1e-5."""
    step, state, prompts, want = greedy_case
    engine = _engine(step, tp)
    assert engine.batching == "continuous"
    got = engine.generate(state, prompts, max_new_tokens=family_checkpoints.GREEDY_NEW_TOKENS)
    for out, expected in zip(got, want):
        np.testing.assert_array_equal(np.asarray(out), expected)
    assert engine.stats["preemptions"] > 0, engine.stats
    assert engine.stats["prefill_tokens"] > sum(p.size for p in prompts)     # recomputed

    seeds = [3, 4]
    grouped, drawn = engine.generate_group(state, prompts, seeds, max_new_tokens=8,
                                           temperature=1.0, return_logprobs=True)
    for seed, outs, logps in zip(seeds, grouped, drawn):
        alone, alone_lp = engine.generate(state, prompts, max_new_tokens=8, temperature=1.0,
                                          seed=seed, return_logprobs=True)
        for a, b, la, lb in zip(alone, outs, alone_lp, logps):
            np.testing.assert_array_equal(b, a)
            np.testing.assert_allclose(lb, la, rtol=0, atol=1e-5)
    assert not np.array_equal(grouped[0][0], grouped[1][0])     # the seeds drew differently


@pytest.mark.slow
def test_sampled_groups_equal_the_static_engine(greedy_case):
    """At tp 2, temperature 1: `generate_group`'s tokens equal the static engine's for each
    seed (its own decode loop over a dense cache), the log-probs within 1e-5."""
    step, state, prompts, _ = greedy_case
    continuous, static = _engine(step, 2), _engine(step, 2, "static")
    seeds = [1, 2]
    grouped, drawn = continuous.generate_group(state, prompts, seeds, max_new_tokens=10,
                                               temperature=1.0, return_logprobs=True)
    for seed, outs, logps in zip(seeds, grouped, drawn):
        want, want_lp = static.generate(state, prompts, max_new_tokens=10, temperature=1.0,
                                        seed=seed, return_logprobs=True)
        for a, b, la, lb in zip(want, outs, want_lp, logps):
            np.testing.assert_array_equal(b, a)
            np.testing.assert_allclose(lb, la, rtol=0, atol=1e-5)
