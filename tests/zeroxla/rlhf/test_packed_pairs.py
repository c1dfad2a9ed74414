"""Preference pairs packed (zeroxla/rlhf/packed_pairs.py) against the padded pair rows they
replace. DPO: the padded loss is `dpo.make_dpo_loss`'s (checked against the DPO / IPO formulas
and TRL in test_dpo.py); packed, the loss, the accuracy and margin statistics and the gradients
equal it within 1e-6 on fresh pairs of ragged lengths, for a nanoGPT-style GPT and a Llama, and
one ZeRO-3 step on the 2 x 4 mesh lands on the same parameters. A reward model: the pairwise loss
(test_reward_model.py's reference) and its gradients, and a ZeRO-3 step's head update, likewise."""

import jax
import numpy as np
import optax
import pytest

import zeroxla
from zeroxla import models
from zeroxla.rlhf.dpo.losses import DPOConfig, make_dpo_loss, make_dpo_statistic, pair_batch
from zeroxla.rlhf.packed_pairs import pack_pairs, pack_scored_pairs
from test_packed_rollout import (assert_same_mean_and_grads, assert_same_update,
                                 assert_same_zero3_step, mean_and_grads, zero3_step)

V, T = 40, 24                        # vocabulary, seq_len


def pairs(n, seed):
    """`pair_batch` rows of n pairs: a shared prompt of 1..8 tokens, answers of 1..15 tokens,
    right-padded to T; random reference sums."""
    rng = np.random.default_rng(seed)
    arrays = {key: np.zeros((n, T), np.int32) for key in ("chosen", "rejected")}
    shared = rng.integers(1, 9, n)
    for i in range(n):
        prompt = rng.integers(1, V, shared[i])
        for key in ("chosen", "rejected"):
            answer = rng.integers(1, V, rng.integers(1, 16))
            seq = np.concatenate([prompt, answer])
            arrays[key][i, :seq.size] = seq
            arrays[f"{key}_end"] = arrays.get(f"{key}_end", np.zeros(n, np.int32))
            arrays[f"{key}_end"][i] = seq.size - 1
    rows = pair_batch(arrays, {"chosen": shared, "rejected": shared})
    rows["ref_chosen"] = rng.uniform(-60, -20, n).astype(np.float32)
    rows["ref_rejected"] = rng.uniform(-60, -20, n).astype(np.float32)
    return rows




@pytest.mark.parametrize("family,loss_type", [
    ("gpt-tiny", "sigmoid"), pytest.param("llama-tiny", "ipo", marks=pytest.mark.slow)])
def test_packed_pairs_give_the_padded_loss_statistics_and_grads(family, loss_type):
    padded = pairs(8, seed=len(family) + len(loss_type))
    # one replica: the loss_fn sees all rows here (pairs are numbered per replica)
    packed, stats = pack_pairs(padded, row_len=T - 1, data_size=1)
    assert stats["rows"] < 16                        # fewer rows than the 2 x 8 padded ones
    model = models.build(family, vocab_size=V, max_seq_len=32, seed=4)
    for fn in (make_dpo_loss(0.1, loss_type), make_dpo_statistic("margin", 0.1)):
        assert_same_mean_and_grads(model, fn, padded, packed)
    accuracy = make_dpo_statistic("accuracy", 0.1)
    assert (float(mean_and_grads(model, packed, accuracy)[0])
            == float(mean_and_grads(model, padded, accuracy)[0]))


@pytest.mark.slow
def test_a_zero3_step_on_packed_pairs_lands_where_the_padded_one_does():
    padded = pairs(16, seed=3)
    packed, stats = pack_pairs(padded, row_len=T - 1, data_size=8)
    assert packed["inputs"].shape[0] % 8 == 0 and stats["fill"] > 0
    assert_same_zero3_step(zero3_step(models.build("llama-tiny", vocab_size=V, max_seq_len=32,
                                                   seed=5), make_dpo_loss(0.1)), padded, packed)


def test_pairs_stay_on_one_replica_and_each_answer_token_once():
    padded = pairs(12, seed=9)
    packed, _ = pack_pairs(padded, row_len=T - 1, data_size=4)
    per = packed["inputs"].shape[0] // 4
    assert packed["chosen_mask"].sum() == padded["chosen_mask"].sum()
    assert packed["rejected_mask"].sum() == padded["rejected_mask"].sum()
    np.testing.assert_allclose(np.sort(packed["ref_chosen"][packed["ref_chosen"] != 0]),
                               np.sort(padded["ref_chosen"]))
    for r in range(4):
        block = slice(r * per, (r + 1) * per)
        live = packed["segment_ids"][block] > 0
        numbers = packed["pair"][block][live]
        # every pair number a replica uses carries both sides and its one weight
        assert packed["weight"][block].sum() == len(set(numbers.tolist()))


def test_a_sequence_longer_than_the_row_is_refused():
    with pytest.raises(ValueError, match=r"row_len=5 is shorter than the longest sequence"):
        pack_pairs(pairs(4, seed=0), row_len=5, data_size=1)
    with pytest.raises(ValueError, match=r"DPOConfig.packing='yes' is invalid"):
        DPOConfig(packing="yes")


def reward_pairs(n, seed):
    """A reward model's pair batch: sequences of 2..T tokens, right-padded, their ends."""
    rng = np.random.default_rng(seed)
    out = {key: np.zeros((n, T), np.int32) for key in ("chosen", "rejected")}
    for key in ("chosen", "rejected"):
        out[f"{key}_end"] = rng.integers(1, T, n).astype(np.int32)
        for i in range(n):
            out[key][i, :out[f"{key}_end"][i] + 1] = rng.integers(1, V, out[f"{key}_end"][i] + 1)
    return out


@pytest.mark.parametrize("family", [pytest.param("gpt-tiny", marks=pytest.mark.slow),
                                    pytest.param("llama-tiny", marks=pytest.mark.slow)])
def test_packed_reward_pairs_give_the_padded_pairwise_loss_and_grads(family):
    from zeroxla.rlhf.reward_model import RewardModel, pairwise_loss_terms
    padded = reward_pairs(8, seed=len(family))
    packed, stats = pack_scored_pairs(padded, row_len=T, data_size=1)
    assert stats["rows"] < 16
    model = RewardModel(models.build(family, vocab_size=V, max_seq_len=32, seed=6))
    model.v_head[...] = jax.random.normal(jax.random.key(0), model.v_head[...].shape)
    assert_same_mean_and_grads(model, pairwise_loss_terms, padded, packed)
    # and through a ZeRO-3 step on 2 x 4 devices, pairs numbered per replica
    packed8, _ = pack_scored_pairs(reward_pairs(16, seed=7), row_len=T, data_size=8)
    step = zeroxla.make_step(lambda: RewardModel(models.build(family, vocab_size=V,
                                                              max_seq_len=32, seed=6)),
                             zeroxla.make_mesh(2, 4), optimizer=optax.sgd(0.5),
                             loss_fn=pairwise_loss_terms, config=zeroxla.ZeroConfig(stage=3))
    # (a fresh head scores 0: the loss is log 2 on both; the update of the head is where the
    # end tokens' hidden states show)
    heads = [np.asarray(zeroxla.gathered_model(step(step.init(0), batch)[0]).v_head[...])
             for batch in (reward_pairs(16, seed=7), packed8)]
    assert np.abs(heads[0]).max() > 1e-3
    np.testing.assert_allclose(heads[1], heads[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,strategy", [
    pytest.param("dpo", "ulysses", marks=pytest.mark.slow),
    pytest.param("dpo", "ring", marks=pytest.mark.slow),
    pytest.param("reward", "allgather", marks=pytest.mark.slow), ("reward", "ulysses")])
def test_packed_pairs_under_sequence_parallelism_land_where_the_padded_step_does(kind, strategy):
    """DPO's loss and a reward model's pairwise loss on pairs packed into rows split over 2
    sequence devices (2 x 2 data replicas): each pair's sums are over both halves of its rows
    (`packed_pairs.pair_sums`), and one update equals the padded pairs' without sequence
    parallelism (2 x 4 replicas). Padded pairs under it are refused naming the option."""
    from zeroxla.models.sequence_parallel import SequenceParallel
    from zeroxla.rlhf.reward_model import RewardModel, pairwise_loss_terms
    if kind == "dpo":
        padded, loss_fn, option = pairs(16, seed=9), make_dpo_loss(0.1), "DPOConfig.packing"

        def build():
            return models.build("llama-tiny", vocab_size=V, max_seq_len=32, seed=5)
        pack, row_len = pack_pairs, T                # T - 1 slots at most, rounded to 2P
    else:
        padded, loss_fn, option = reward_pairs(16, seed=11), pairwise_loss_terms, "--packing"

        def build():
            model = RewardModel(models.build("gpt-tiny", vocab_size=V, max_seq_len=32, seed=6))
            model.v_head[...] = jax.random.normal(jax.random.key(2), model.v_head[...].shape)
            return model
        pack, row_len = pack_scored_pairs, T
    sp = zeroxla.make_step(build(), zeroxla.make_mesh(2, 2, sequence=2), optimizer=optax.sgd(0.5),
                           loss_fn=loss_fn,
                           config=zeroxla.ZeroConfig(stage=3, sequence_parallel_strategy=strategy))
    packed, _ = pack(padded, row_len=row_len, data_size=4)
    assert_same_update(zero3_step(build(), loss_fn), padded, sp, packed)
    with pytest.raises(ValueError, match=f"accepted: {option}"):
        loss_fn(build(), padded, sequence=SequenceParallel("sequence", 2))
