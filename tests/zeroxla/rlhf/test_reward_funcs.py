"""Reward functions of the GRPO family (zeroxla/rlhf/reward_funcs.py) and the bundled arithmetic
task (arithmetic_task.py): answers extracted as written, weighted sums, failures named, and the
task deterministic, disjoint and correct (its answers recomputed here from the prompt text)."""

import math
import re

import numpy as np
import pytest

from zeroxla.rlhf import arithmetic_task as task
from zeroxla.rlhf.reward_funcs import (RewardFunctionError, RewardFunctions, accuracy_reward,
                                       extract_answer, format_reward, load_reward_func)


@pytest.mark.parametrize("text, want", [
    ("#### 85\n", "85"), ("so 3 + 4 = 7 #### 7", "7"), ("#### 1,234", "1234"),
    ("the answer is \\boxed{42}.", "42"), ("\\boxed{ -3 }", "-3"), ("####12 then #### 13", "13"),
    ("no answer 85", None), ("####", None), ("\\boxed{x}", None)])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_accuracy_and_format():
    completions = ["#### 85\n", "#### 84\n", "\\boxed{85}", "85", "#### 85.0"]
    assert accuracy_reward([""] * 5, completions, answer=["85"] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert format_reward([""] * 5, completions) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_weighted_sum():
    funcs = RewardFunctions((accuracy_reward, format_reward), (2.0, 0.5))
    total, parts = funcs(["p"] * 3, ["#### 1", "#### 2", "1"], {"answer": ["1", "1", "1"]})
    np.testing.assert_array_equal(total, [2.5, 0.5, 0.0])
    assert set(parts) == {"accuracy_reward", "format_reward"}
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        RewardFunctions((accuracy_reward,), (1.0, 2.0))


def nan_on_second(prompts, completions, **_):
    return [0.0, math.nan] + [0.0] * (len(completions) - 2)


def none_reward(prompts, completions, **_):
    return [None] * len(completions)


def raising_reward(prompts, completions, **_):
    raise KeyError("answer")


@pytest.mark.parametrize("fn, message", [
    (nan_on_second, r"nan_on_second returned nan for sample 1 \(prompt 'q1'"),
    (none_reward, r"none_reward returned None for sample 0"),
    (raising_reward, r"raising_reward raised KeyError"),
    (lambda p, c: [1.0], r"returned 1 rewards for 3 completions")])
def test_bad_reward_stops_naming_function_and_sample(fn, message):
    with pytest.raises(RewardFunctionError, match=message):
        RewardFunctions((fn,))(["q0", "q1", "q2"], ["a", "b", "c"], {})


def test_load_reward_func():
    assert load_reward_func("accuracy") is accuracy_reward
    assert load_reward_func("zeroxla.rlhf.reward_funcs:format_reward") is format_reward
    with pytest.raises(ValueError, match="accepted: accuracy | format or module:function"):
        load_reward_func("nocolon")
    with pytest.raises(ValueError, match="zeroxla.rlhf:missing"):
        load_reward_func("zeroxla.rlhf:missing")


def test_task_is_deterministic_disjoint_and_right():
    train, test = task.split_problems(300, 50, seed=3)
    assert (train, test) == task.split_problems(300, 50, seed=3)
    assert train != task.split_problems(300, 50, seed=4)[0]
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    width = task.prompt_width(2)
    for p in train + test:
        assert len(p["prompt"]) == width and set(p["prompt"] + p["completion"]) <= set(
            task.ALPHABET)
        a, b = (int(x) for x in re.findall(r"\d+", p["prompt"]))
        want = a - b if "gives away" in p["prompt"] else a + b
        assert p["completion"] == f"#### {want}\n" and p["answer"] == str(want)
        assert accuracy_reward([p["prompt"]], [p["completion"]], answer=[p["answer"]]) == [1.0]
