"""The sampling knobs accept any Python or NumPy real (temperature, top_p) or integer (top_k)
scalar in range, stored as the equal Python number, and refuse a bool (Python or NumPy), a
string, an array, nan, inf, a value out of range or one no float64 holds, naming the knob, the
value and what is accepted. Pure Python: no devices."""

import fractions
import re

import numpy as np
import pytest

from zeroxla.inference.sampling import (FLOAT32_MAX, FLOAT32_TINY, Sampling,
                                               check_temperature)

FLOATS = (np.float16, np.float32, np.float64, np.longdouble)
INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def test_float32_limits_are_numpys():
    assert FLOAT32_TINY == float(np.finfo(np.float32).tiny)
    assert FLOAT32_MAX == float(np.finfo(np.float32).max)


@pytest.mark.parametrize("kind", FLOATS + INTS)
def test_numpy_scalars_are_accepted_as_their_value(kind):
    sampling = Sampling(temperature=kind(3), top_k=3 if kind in FLOATS else kind(3),
                        top_p=kind(1) if kind in INTS else kind(0.5))
    expected = Sampling(temperature=3.0, top_k=3, top_p=1.0 if kind in INTS else 0.5)
    assert sampling == expected and hash(sampling) == hash(expected)    # one program for both
    assert type(sampling.temperature) is float and type(sampling.top_k) is int
    assert type(sampling.top_p) is float


@pytest.mark.parametrize("temperature", [np.float32(0.1), np.float16(0.1), 0.1,
                                         fractions.Fraction(1, 10), 7, np.int64(7)])
def test_temperature_keeps_the_value_given(temperature):
    # np.float32(0.1) is 0.100000001490116...: the value the user holds, not a rounded 0.1
    assert Sampling(temperature).temperature == float(temperature)


def test_the_issues_knobs():
    sampling = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float32(0.5))
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 3, 0.5)


@pytest.mark.parametrize("temperature,greedy,uniform", [
    (0, True, False), (np.nextafter(FLOAT32_TINY, 0), True, False),
    (FLOAT32_TINY, False, False), (1.0, False, False), (FLOAT32_MAX, False, False),
    (np.nextafter(FLOAT32_MAX, np.inf), False, True), (1e300, False, True),
    (10 ** 300, False, True)])
def test_temperature_limits(temperature, greedy, uniform):
    sampling = Sampling(temperature)
    assert (sampling.greedy, sampling.uniform) == (greedy, uniform)


@pytest.mark.parametrize("field,value", [
    ("temperature", True), ("temperature", np.bool_(False)), ("temperature", "0.5"),
    ("temperature", None), ("temperature", float("nan")), ("temperature", np.float32("inf")),
    ("temperature", -1), ("temperature", np.float16(-0.5)), ("temperature", 10 ** 400),
    ("temperature", np.array([0.5])), ("temperature", 1j),
    ("top_k", True), ("top_k", 0), ("top_k", np.int64(-2)), ("top_k", 3.0),
    ("top_k", np.float64(3)), ("top_k", "3"),
    ("top_p", False), ("top_p", 0), ("top_p", np.float32(1.5)), ("top_p", float("nan")),
    ("top_p", np.int64(2)), ("top_p", "0.5")])
def test_bad_knobs_are_refused_by_name(field, value):
    accepted = {"temperature": r"0 \(greedy\) or a finite positive number",
                "top_k": r"None or an integer >= 1", "top_p": r"None or a number in \(0, 1\]"}
    with pytest.raises(ValueError) as info:
        Sampling(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}={value!r} is invalid; accepted: ")
    assert "(a Python or NumPy scalar, not a bool)" in message
    assert re.search(accepted[field], message)


def test_check_temperature_returns_a_python_float():
    assert type(check_temperature(np.float16(2))) is float
    assert check_temperature(0) == 0.0
