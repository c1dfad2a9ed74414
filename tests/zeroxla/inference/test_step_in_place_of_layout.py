"""One rule for the public functions that take a step's `ZeroLayout` (`zeroxla.engine.
layout_argument`): the `ZeroStep` itself, as the docs and notebooks passed it before the step
held its layout (`HybridEngine(step)`), is read as `step.layout` with a DeprecationWarning
worded as `gathered_model(step, state)`'s. Reference: the unsharded model's greedy tokens (a
full forward per token)."""

import re

import numpy as np
import pytest

from inference_helpers import greedy_reference, prompts_of, zero3_step
from zeroxla.inference import (HybridEngine, HybridEngineConfig, SingleDeviceGenerator,
                               Zero3Generator)


def deprecated(old, new):
    return pytest.warns(DeprecationWarning,
                        match=re.escape(f"{old} is deprecated; call {new}"))


@pytest.fixture(scope="module")
def step_and_state():
    step = zero3_step("gpt-tiny")           # init_std 0.2: greedy continuations vary
    return step, step.init()


def test_hybrid_engine_given_the_step_warns_and_generates_as_given_its_layout(step_and_state):
    """The tokens of `HybridEngine(step.layout)` (test_hybrid_engine): the unsharded model's."""
    step, state = step_and_state
    with deprecated("HybridEngine(step, ...)", "HybridEngine(step.layout, ...)"):
        engine = HybridEngine(step, HybridEngineConfig(inference_tp_size=2, max_out_tokens=16))
    assert engine.plan is step.layout.plan
    prompts = prompts_of()
    outs = engine.generate(state, prompts, max_new_tokens=4)
    for out, ref in zip(outs, greedy_reference(state, prompts, 4)):
        np.testing.assert_array_equal(out, ref)
    assert len({tuple(o[p.size:]) for o, p in zip(outs, prompts)}) > 1, "degenerate model"


def test_generators_given_the_step_warn_and_read_its_layout(step_and_state):
    """(`save(..., layout=step)`: test_checkpoint; `memory_report`: test_memory, both slow.)"""
    step, _ = step_and_state
    with deprecated("Zero3Generator(step, ...)", "Zero3Generator(step.layout, ...)"):
        assert Zero3Generator(step, max_out_tokens=16).layout is step.layout
    with deprecated("SingleDeviceGenerator(step, ...)", "SingleDeviceGenerator(step.layout, ...)"):
        single = SingleDeviceGenerator(step, max_out_tokens=16)
    assert single.plan is step.layout.plan and single.model_def is step.layout.model_def
