"""The planner (`zeroxla.analysis.planner`): its figures are the compiled step's, its search
finds the largest length that fits, and remat "offload"'s host bytes are the inputs it keeps."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.analysis.memory import memory_report
from zeroxla.analysis.abstract_step import trace_abstract
from zeroxla.analysis.host_residuals import host_residual_bytes, host_residual_layer_bytes
from zeroxla.analysis.planner import (Setting, largest_fitting, largest_under, model_factory,
                                      plan_memory, sweep_settings)
from zeroxla.make import make_step
from zeroxla.sharding.config import ZeroConfig

SEQ = 64


def _config():
    return models.LlamaConfig.tiny().replace(max_seq_len=SEQ)


@pytest.mark.parametrize("threshold", [0, 1023, 1024, 5000, 9 * 1024, 123_456, 1 << 20])
def test_largest_fitting_is_the_largest_multiple_that_fits(threshold):
    calls = []

    def fits(t):
        calls.append(t)
        return t <= threshold
    found = largest_fitting(fits, granularity=1024, limit=1 << 20)
    expected = max(t for t in range(0, (1 << 20) + 1, 1024) if t <= threshold)
    assert found == expected
    assert all(t % 1024 == 0 for t in calls)
    assert len(calls) <= 2 * 11                  # doubling, then bisection


def _peaks(kind, rng):
    """A per-device peak that grows with T, as compiles give: affine (a remat'd stack), with a
    quadratic term (naive attention's scores), or with steps (buffers rounded to chunks)."""
    state, slope = float(rng.uniform(1, 40)) * 2**30, float(rng.uniform(1e3, 2e6))
    if kind == "affine":
        return lambda t: int(state + slope * t)
    if kind == "quadratic":
        square = float(rng.uniform(1, 400))
        return lambda t: int(state + slope * t + square * t * t)
    chunk = int(rng.choice([512, 4096, 65536]))
    return lambda t: int(state + slope * t + 2**28 * (-(-t // chunk) % 3))


@pytest.mark.parametrize("kind", ["affine", "quadratic", "steps"])
def test_largest_under_finds_what_the_bisection_finds_in_fewer_compiles(kind):
    """Against the doubling bisection (`largest_fitting`, itself checked against brute force
    above) on 40 fresh peaks each: the same answer; for the affine peaks 4 calls at most, and
    fewer calls than the bisection over all of them."""
    rng = np.random.default_rng(["affine", "quadratic", "steps"].index(kind))
    ours, theirs = 0, 0
    for _ in range(40):
        peak, memory = _peaks(kind, rng), 80 * 2**30
        granularity, limit = int(rng.choice([1024, 16384])), 1 << 21
        calls = []

        def counted(t):
            calls.append(t)
            return peak(t)
        got = largest_under(counted, memory, granularity=granularity, limit=limit)
        want_calls = []
        want = largest_fitting(lambda t: want_calls.append(t) or peak(t) <= memory,
                               granularity=granularity, limit=limit)
        assert got == want, (kind, got, want)
        assert all(t % granularity == 0 and t <= limit for t in calls)
        assert len(set(calls)) == len(calls)                  # no length compiled twice
        if kind == "affine":
            assert len(calls) <= 4, calls
        ours, theirs = ours + len(calls), theirs + len(want_calls)
    assert ours < theirs, (ours, theirs)


def test_largest_fitting_refuses_a_granularity_above_the_limit():
    with pytest.raises(ValueError, match="granularity=4096, limit=1024"):
        largest_fitting(lambda t: True, granularity=4096, limit=1024)


def test_the_figures_are_the_step_compiled_the_normal_way():
    """An independent path: the model built for real, `step.init()`, a host batch, and
    `memory_report` of `step.compile`: the same bytes, part by part."""
    mesh = zeroxla.make_mesh(2, 4)
    figures = plan_memory(_config(), mesh, seq_len=SEQ, device_memory=2**30, stage=3,
                          dtype="bfloat16", remat="full")
    step = zeroxla.make_step(models.Llama(_config(), rngs=nnx.Rngs(0)), mesh,
                             config=zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16",
                                                       remat="full"))
    state = step.init()
    tokens = np.zeros((8, SEQ), np.int32)
    compiled = step.compile(state, {"inputs": tokens, "targets": tokens})
    report = memory_report(compiled, state, layout=step.layout)
    assert (figures.temporaries, figures.arguments, figures.outputs, figures.aliased) == (
        report.temporaries, report.arguments, report.outputs, report.aliased)
    assert figures.peak == report.peak_estimate
    assert figures.state["master"] + figures.state["compute_copy"] == report.params
    assert figures.state["optimizer"] == report.optimizer
    assert figures.state["other"] == 4 + report.loss_scale        # the int32 step counter
    assert figures.fits and not figures.derived and figures.host_residuals == 0


def test_the_offload_figures_are_the_step_compiled_the_normal_way_less_the_host_inputs():
    """remat "offload", by the same independent path as "full": the model built for real,
    `step.init()`, a host batch, `memory_report` of `step.compile`. XLA:CPU has one memory, so
    its temporaries still hold the layer inputs the program places in host memory: the
    planner's device figure is them less L x B_local x T x D bf16, plus one layer's, which the
    backward brings back (counted here from the config, not from the program)."""
    cfg, mesh = _config(), zeroxla.make_mesh(2, 4)
    figures = plan_memory(cfg, mesh, seq_len=SEQ, device_memory=2**30, stage=3,
                          dtype="bfloat16", remat="offload")
    step = zeroxla.make_step(models.Llama(cfg, rngs=nnx.Rngs(0)), mesh,
                             config=zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16",
                                                       remat="offload"))
    state = step.init()
    tokens = np.zeros((8, SEQ), np.int32)
    report = memory_report(step.compile(state, {"inputs": tokens, "targets": tokens}), state,
                           layout=step.layout)
    layer = 1 * SEQ * cfg.d_model * jnp.dtype(jnp.bfloat16).itemsize     # B_local = 1
    host = cfg.num_layers * layer
    assert figures.derived and figures.host_residuals == host
    assert (figures.arguments, figures.outputs, figures.aliased) == (
        report.arguments, report.outputs, report.aliased)
    assert figures.temporaries == report.temporaries - host + layer
    assert figures.peak == report.peak_estimate - host + layer
    assert figures.state["optimizer"] == report.optimizer


def test_offload_host_bytes_are_each_layers_input():
    """remat "offload" keeps each layer's input carry [B_local, T, D] (bf16) in host memory:
    L x B_local x T x D x 2 bytes, counted apart from the device figure (derived on CPU)."""
    cfg = _config()
    mesh = zeroxla.make_mesh(2, 4)
    figures = plan_memory(cfg, mesh, seq_len=SEQ, device_memory=2**30, remat="offload")
    carry = cfg.num_layers * 1 * SEQ * cfg.d_model * jnp.dtype(jnp.bfloat16).itemsize
    assert figures.host_residuals == carry
    assert figures.derived                      # XLA:CPU: one memory


def test_one_layers_host_residuals_count_on_the_device():
    """Backward brings the layer it differentiates back to the device (XLA:CPU does it as
    nothing): one layer's input carry, which the derived device figure adds back."""
    cfg = _config()
    step = make_step(model_factory(cfg), zeroxla.make_mesh(2, 4),
                     config=ZeroConfig(stage=3, compute_dtype="bfloat16", remat="offload"))
    traced = trace_abstract(step, step.layout.data_size, SEQ)
    layer = 1 * SEQ * cfg.d_model * jnp.dtype(jnp.bfloat16).itemsize
    assert host_residual_layer_bytes(traced) == layer
    assert host_residual_bytes(traced) == cfg.num_layers * layer


def test_settings_sweep_the_fields_the_config_has():
    settings, missing = sweep_settings(_config(), ("full",))
    fields = {f for s in settings for f, _ in s.fields}
    assert fields == {"mlp_chunk"} and not missing
    assert [dict(s.fields)["mlp_chunk"] for s in settings] == [_config().mlp_chunk, 4096]
    assert len({s.label for s in settings}) == len(settings)
    asked, _ = sweep_settings(_config(), ("full", "offload"), attention=("naive",))
    assert len(asked) == 2 * 2 * 2          # remat x mlp_chunk x (own attention, naive)
    assert {dict(s.fields)["attention"] for s in asked} == {_config().attention, "naive"}


def _lowered_text(setting, seq_len):
    """The StableHLO (no debug info) of the step `plan_memory` compiles for `setting` at
    `seq_len`, lowered only."""
    config = _config().replace(max_seq_len=seq_len, **dict(setting.fields))
    step = make_step(model_factory(config), zeroxla.make_mesh(1, 8),
                     config=ZeroConfig(stage=3, compute_dtype="bfloat16", remat=setting.remat))
    return trace_abstract(step, 8, seq_len).lower().as_text(debug_info=False)


def test_settings_equal_at_a_length_lower_to_one_program():
    """`Setting.program_at`, what `zeroxla plan` compiles once per length, against the
    programs themselves: mlp_chunk None and 4096 at T = 32 (both untiled) lower to the same
    StableHLO, mlp_chunk 16 (two chunks) to another; at T = 8 chunk 16 holds every token."""
    untiled, big, tiled = (Setting("full", (("mlp_chunk", c),)) for c in (None, 4096, 16))
    assert untiled.program_at(32) == big.program_at(32) != tiled.program_at(32)
    assert tiled.program_at(8) == untiled.program_at(8)
    assert tiled.program_at(32).fields == (("mlp_chunk", 16),)
    texts = {c: _lowered_text(s, 32) for c, s in ((None, untiled), (4096, big), (16, tiled))}
    assert texts[None] == texts[4096] != texts[16]
