"""The `trained` fixture: one ZeRO-3 step per model, trained 3 steps, shared by the session.
Helpers live in `inference_helpers` (a plain module: conftest is not importable by name)."""

import functools

import pytest

from inference_helpers import train, zero3_step


@functools.cache
def _trained(name):
    step = zero3_step(name)
    return step, train(step, 3)


@pytest.fixture
def trained():
    """`trained(name)` -> (step, state after 3 steps), cached per model for the session.
    Tests must not step the returned state (the step donates it): `train(step, n)` makes
    a state of their own."""
    return _trained
