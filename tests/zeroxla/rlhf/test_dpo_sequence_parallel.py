"""DPO with sequence parallelism: the policy trains on pairs packed into rows split over 2
sequence devices (each pair's log-prob sums over both halves, `packed_pairs.pair_sums`), and
the first step's record (its loss, accuracy and margin, and the held-out ones before it) equals
the same run without sequence parallelism (the same 4 data replicas) within float32 noise.
The reference sums come from the frozen start, in the policy's layout, in both runs."""

import jax
import numpy as np
import pytest

import zeroxla
from test_packed_pairs import V, pairs
from zeroxla import models
from zeroxla.rlhf.dpo.losses import DPOConfig
from zeroxla.rlhf.dpo.trainer import run_dpo

CONFIG = DPOConfig(beta=0.5, batch_size=8, seq_len=24, learning_rate=1e-3)


def _records(mesh):
    policy = models.build("llama-tiny", vocab_size=V, max_seq_len=32, seed=5)
    train, val = pairs(16, seed=13), pairs(8, seed=14)
    for rows in (train, val):
        del rows["ref_chosen"], rows["ref_rejected"]          # the trainer computes them
    return run_dpo(CONFIG, 1, policy, mesh=mesh, train=train, val=val).records


@pytest.mark.slow      # the losses under it: test_packed_rollout.py / test_packed_pairs.py
def test_dpo_with_sequence_parallel_two_matches_the_run_without():
    without = _records(zeroxla.make_mesh(1, 4, devices=jax.devices()[:4]))
    with_sp = _records(zeroxla.make_mesh(1, 4, sequence=2))
    # Before any step the policy is the reference: margins 0 up to the rounding of sums of
    # some 60 float32 log-probs (1e-5; so the accuracy, a count of ties broken by rounding,
    # is not compared there), loss log 2.
    for key in ("val_loss", "val_margin"):
        assert with_sp[0][key] == pytest.approx(without[0][key], rel=1e-5, abs=1e-5), key
    for key in ("loss", "margin"):
        assert with_sp[1][key] == pytest.approx(without[1][key], rel=1e-5, abs=1e-5), key
    # After the step (AdamW from the same gradients, up to float32's reordering of the sums):
    # the held-out pairs separate, the same way in both runs.
    for key in ("val_loss", "val_margin"):
        assert with_sp[1][key] == pytest.approx(without[1][key], rel=1e-3), key
    assert with_sp[1]["val_accuracy"] == without[1]["val_accuracy"]
    assert abs(without[1]["val_margin"]) > 1e-3


@pytest.mark.slow   # daily: test_answer_forward.py's reads under Ulysses, test_packed_pairs.py's
def test_the_reference_sums_in_the_policys_layout_equal_the_one_device_reference():
    # Under sequence parallelism the reference's sums come from the policy's first partitions,
    # read in its layout (70 pairs: two calls of 64, the second partial); against the plain
    # model's sums on one device (`dpo.sequence_logprobs`). As int8 codes (`reference_int8`,
    # read through the policy's codes view under sequence parallelism too) the sums are the
    # float ones within the int8 rounding (2e-2 nats per token, test_reference_int8.py) and a
    # device holds 1/8 of the model, against the whole tiny model of the float copy.
    from zeroxla.rlhf.dpo.losses import sequence_logprobs
    from zeroxla.rlhf.dpo.trainer import DPOTrainer
    policy = models.build("llama-tiny", vocab_size=V, max_seq_len=32, seed=5)
    train, val = pairs(70, seed=15), pairs(8, seed=16)
    for rows in (train, val):
        del rows["ref_chosen"], rows["ref_rejected"]
    mesh = zeroxla.make_mesh(1, 4, sequence=2)
    trainer = DPOTrainer(CONFIG, policy, mesh=mesh, train=train, val=val)
    on_one_device = jax.device_put({k: train[k] for k in ("chosen", "rejected", "chosen_mask",
                                                           "rejected_mask")}, jax.devices()[0])
    want = dict(zip(("ref_chosen", "ref_rejected"),
                    map(np.asarray, jax.jit(sequence_logprobs)(policy, on_one_device))))
    for key in ("ref_chosen", "ref_rejected"):
        np.testing.assert_allclose(trainer.train[key], want[key], rtol=1e-5, atol=1e-4)
    # The reference is a copy of the policy's stored partitions: a device holds what it holds
    # of the policy (the whole tiny model: every leaf is below the persistence threshold).
    held = {}
    for leaf in jax.tree.leaves(trainer.state.params):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert trainer.reference_bytes == max(held.values()) and len(held) == 8
    assert np.abs(want["ref_chosen"]).min() > 1.0
    codes = DPOTrainer(CONFIG.replace(reference_int8=True), policy, mesh=mesh, train=train,
                       val=val)
    tokens = train["chosen_mask"].sum(-1), train["rejected_mask"].sum(-1)
    for key, count in zip(("ref_chosen", "ref_rejected"), tokens):
        moved = np.abs(codes.train[key] - trainer.train[key])
        assert np.all(moved <= 2e-2 * count) and moved.max() > 1e-5, key
    assert codes.reference_bytes < trainer.reference_bytes / 8
