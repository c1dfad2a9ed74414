"""ZeRO++ in the training step: cross-node traffic, hpZ locality and equivalence, convergence."""

import functools

import numpy as np
import optax
import pytest

from zeroxla import models
import zeroxla
from zeroxla.app.data import load_text
from reference import token_batches
from zeroxla.analysis.comm_report import comm_report

ALL = dict(quantized_weights=True, hpz_partition_size=4, quantized_gradients=True)


def _step(model_name, threshold=1000, dtype="bfloat16", **zeropp):
    config = zeroxla.ZeroConfig(stage=3, compute_dtype=dtype, persistence_threshold=threshold,
                                **zeropp)
    return zeroxla.make_step(models.build(model_name), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(1e-3), config=config)


@functools.cache        # a report compiles gpt-small: tests that ask for one config share it
def _cross_node(model_name, **zeropp):
    step = _step(model_name, **zeropp)
    return comm_report(step, step.init(), token_batches(1, 32, 64, vocab=65)[0])


@pytest.fixture(scope="module")
def baseline_small():
    return _cross_node("gpt-small")


def test_zeropp_cuts_cross_node_traffic_of_small_gpt(baseline_small):
    """ZeRO-3 (bf16) / ZeRO++ (qwZ int8 + hpZ 4 + qgZ int4) >= 4.5x. The convention's limit at
    this mesh is 3 / (1/2 + 1/16) = 5.33x: forward gather at half the bytes, no cross-node
    backward gather, and 1/(local*4) of the gradient bytes crossing nodes."""
    zeropp = _cross_node("gpt-small", **ALL)
    ratio = baseline_small.cross_node_bytes / zeropp.cross_node_bytes
    print(f"cross-node ZeRO-3 / ZeRO++ (int8 weights): {ratio:.2f}x")
    assert 4.5 <= ratio <= 5.34
    assert any("qgZ int4" in row[3] for row in zeropp.parameters)


def test_int4_weights_cut_more(baseline_small):
    int8 = _cross_node("gpt-small", **ALL)
    int4 = _cross_node("gpt-small", **ALL, weight_quantization_bits=4)
    ratio = baseline_small.cross_node_bytes / int4.cross_node_bytes
    print(f"cross-node ZeRO-3 / ZeRO++ (int4 weights): {ratio:.2f}x")
    assert int4.cross_node_bytes < 0.6 * int8.cross_node_bytes
    assert ratio > 8


def test_hpz_backward_gathers_never_cross_nodes():
    report = _cross_node("gpt-small", hpz_partition_size=4)
    backward = report.traffic("all-gather", "zero_bwd_gather")
    assert backward.intra_node > 0
    assert backward.cross_node == 0 and backward.max_cross_node == 0
    assert all(len(group) == 4 and len({d // 4 for d in group}) == 1
               for c in report.collectives if c.kind == "all-gather"
               and "zero_bwd_gather" in c.op_name for group in c.device_groups)


def test_hpz_memory_shows_in_report():
    step = _step("gpt-tiny", threshold=500, hpz_partition_size=4)
    state = step.init()
    report = zeroxla.memory_report(step, state, token_batches(1, 16, 16, vocab=65)[0])
    partitioned = sum(leaf.layers * leaf.padded_numel for leaf in step.plan.leaves
                      if leaf.params_partitioned)
    assert report.secondary_partition == 2 * partitioned // 4      # bf16, 1/local of each layer
    assert "hpZ secondary partition" in report.table()


def test_hpz_equivalence_20_steps():
    """Without quantization, hpZ only changes where the backward gather reads from."""
    batches = token_batches(20, 16, 32, vocab=65, seed=3)
    losses = {}
    for hpz in (1, 4):
        step = _step("gpt-tiny", threshold=500, dtype="float32", hpz_partition_size=hpz)
        state = step.init()
        losses[hpz] = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[hpz].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[4], losses[1], rtol=0, atol=1e-6)


def _shakespeare_batches(steps, batch_size, seq_len, seed=0):
    text = load_text()          # the bundled tiny-shakespeare
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text[:200_000]], np.int32)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq_len - 1, batch_size)
        window = np.stack([ids[s:s + seq_len + 1] for s in starts])
        yield {"inputs": window[:, :-1], "targets": window[:, 1:]}


def _train_300(**zeropp):
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=500,
                                weight_quantization_group_size=256,
                                gradient_quantization_group_size=256, **zeropp)
    step = zeroxla.make_step(models.build("gpt-tiny"), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adamw(3e-3), config=config)
    state = step.init()
    losses = []
    for batch in _shakespeare_batches(300, 32, 64):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, np.mean(losses[-100:]), losses


@pytest.fixture(scope="module")
def zero3_converged():
    _, mean, losses = _train_300()
    assert losses[-1] < 0.7 * losses[0]
    return mean


@pytest.mark.slow
@pytest.mark.parametrize("features", [
    ALL, dict(quantized_weights=True), dict(quantized_gradients=True)],
    ids=["zeropp", "qwz", "qgz"])
def test_convergence_matches_zero3(zero3_converged, features):
    """DeepSpeed's nightly ZeRO++ test allows 1.1x; we hold 1.05x over the last 100 steps.
    hpZ alone is not here: without quantization it trains like ZeRO-3 to 1e-6
    (`test_hpz_equivalence_20_steps`), and it is part of the "zeropp" run."""
    step, mean, _ = _train_300(**features)
    print(f"mean loss of the last 100 of 300 steps: {mean:.4f} vs ZeRO-3 {zero3_converged:.4f} "
          f"({mean / zero3_converged:.4f}x)")
    if features.get("quantized_gradients"):
        assert any("qgZ int4" in row[3] for row in step.describe_collectives())
    assert mean <= 1.05 * zero3_converged


def test_hpz_secondary_groups_smaller_than_a_node():
    """hpz_partition_size=2 on 4 local devices: backward gathers stay within pairs of local
    devices, hold half a layer each, and train exactly like hpZ off."""
    batches = token_batches(5, 16, 32, vocab=65, seed=4)
    losses = {}
    for hpz in (1, 2):
        step = _step("gpt-tiny", threshold=500, dtype="float32", hpz_partition_size=hpz)
        state = step.init()
        if hpz == 2:
            report = comm_report(step, state, batches[0])
            groups = {tuple(g) for c in report.collectives if c.kind == "all-gather"
                      and "zero_bwd_gather" in c.op_name for g in c.device_groups}
            assert groups == {(0, 1), (2, 3), (4, 5), (6, 7)}
            memory = zeroxla.memory_report(step, state, batches[0])
            assert memory.secondary_partition == 4 * sum(
                leaf.layers * leaf.padded_numel for leaf in step.plan.leaves
                if leaf.params_partitioned) // 2
        losses[hpz] = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[hpz].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[2], losses[1], rtol=0, atol=1e-6)
