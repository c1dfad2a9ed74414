"""The ZeRO-3 re-gather baseline generates what the unsharded model does, and its compiled
decode step gathers the whole model per token while the Hybrid Engine's moves far less."""

import numpy as np
import pytest

from inference_helpers import greedy_reference, prompts_of
from zeroxla import comm_report
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.inference.baseline import SingleDeviceGenerator, Zero3Generator


@pytest.mark.slow
def test_baseline_greedy_matches_unsharded_model(trained):
    step, state = trained("gpt-tiny")
    prompts = prompts_of()
    outs = Zero3Generator(step.layout, max_out_tokens=32).generate(state, prompts, max_new_tokens=6)
    for out, ref in zip(outs, greedy_reference(state, prompts, 6)):
        np.testing.assert_array_equal(out, ref)


def test_bytes_per_token_baseline_regathers_engine_does_not(trained):
    step, state = trained("gpt-tiny")
    n = step.layout.axes.data_size
    param_bytes = sum(4 * leaf.numel for leaf in step.layout.plan.leaves if leaf.params_partitioned)
    assert param_bytes == 4 * step.layout.plan.total_numel()
    baseline = comm_report(Zero3Generator(step.layout, 32).token_program(state, 8),
                           mesh=step.layout.mesh)
    # every partitioned parameter gathered once per token: (N-1)/N of it received per device
    assert baseline.total_bytes >= param_bytes * (n - 1) / n * 0.99
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    tp = comm_report(engine.token_program(state, 8), mesh=engine.mesh)
    assert tp.total_bytes * 5 < baseline.total_bytes
    engine.release()


@pytest.mark.slow
def test_baseline_samples_what_the_engine_samples(trained):
    """Same seed, same prompts: the same sampled tokens, whichever device a row lands on (the
    keys come from the seed and each row's own prompt)."""
    step, state = trained("gpt-tiny")
    prompts = prompts_of()
    kwargs = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    baseline = Zero3Generator(step.layout, max_out_tokens=32).generate(state, prompts, **kwargs)
    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=2, max_out_tokens=32))
    for a, b in zip(baseline, engine.generate(state, prompts, **kwargs)):
        np.testing.assert_array_equal(a, b)
    engine.release()


@pytest.mark.slow
def test_single_device_generator_is_the_unsharded_model(trained):
    step, state = trained("gpt-tiny")
    prompts = prompts_of()
    single = SingleDeviceGenerator(step.layout, max_out_tokens=32)
    outs = single.generate(state, prompts, max_new_tokens=6)
    for out, ref in zip(outs, greedy_reference(state, prompts, 6)):
        np.testing.assert_array_equal(out, ref)
    assert {x.devices().pop() for x in single.params(state).values()} == {single.device}
