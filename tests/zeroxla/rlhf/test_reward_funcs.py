"""Reward functions of the GRPO family (zeroxla/rlhf/grpo/reward_funcs.py) and the bundled
arithmetic task (arithmetic_task.py): answers extracted as written, weighted sums, failures
named, and the task deterministic, disjoint and correct (its answers recomputed here from the
prompt text)."""

import math
import re
import sys

import numpy as np
import pytest

from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.reward_funcs import (RewardFunctionError, RewardFunctions, accuracy_reward,
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
    assert load_reward_func("zeroxla.rlhf.grpo.reward_funcs:format_reward") is format_reward
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


def write_module(directory, name, text):
    (directory / f"{name}.py").write_text(text)
    return directory / f"{name}.py"


@pytest.mark.parametrize("text, where, what", [
    ("def score(prompts, completions):\n    return [1.0 for c in completions\n", ":2",
     "SyntaxError"),
    ("import math\nraise RuntimeError('no GPU here')\n", ":2", "RuntimeError: no GPU here")])
def test_reward_module_that_fails_to_import_is_named_with_its_file(tmp_path, monkeypatch, text,
                                                                    where, what):
    name = f"zx_broken_reward_{len(text)}"
    path = write_module(tmp_path, name, text)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as refused:
        load_reward_func(f"{name}:score")
    message = str(refused.value)
    assert f"--reward-funcs {name}:score" in message and f"{path}{where}" in message, message
    assert what in message and "\n" not in message, message


def test_module_in_the_working_directory_is_found_without_it_on_sys_path(tmp_path, monkeypatch):
    """The `zeroxla` console script's sys.path lacks the working directory (`python -m`'s has
    it): a `module:function` there is found as TRL's scripts find it, and sys.path is left as
    it was."""
    write_module(tmp_path, "zx_cwd_reward", "def score(prompts, completions, **_):\n"
                                            "    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "zx_cwd_reward", raising=False)
    before = list(sys.path)
    fn = load_reward_func("zx_cwd_reward:score")
    assert fn(["p"], ["c"]) == [2.0] and sys.path == before
    monkeypatch.delitem(sys.modules, "zx_cwd_reward")


def huge_reward(prompts, completions, **_):
    return [1e300] + [0.0] * (len(completions) - 1)


def test_reward_beyond_float32_is_refused_naming_function_and_sample():
    """1e300 is a finite float64 but overflows float32, where the advantages are used."""
    with pytest.raises(RewardFunctionError, match=r"huge_reward returned 1e\+300 for sample 0 "
                                                  r".*float32"):
        RewardFunctions((huge_reward,))(["q0", "q1"], ["a", "b"], {})


def returning(value):
    def fn(prompts, completions, **_):
        return value
    return fn


@pytest.mark.parametrize("value, want", [
    ([True, False, True], [1.0, 0.0, 1.0]),
    (np.array([True, False, True]), [1.0, 0.0, 1.0]),
    (np.array([3, 0, -2], np.int64), [3.0, 0.0, -2.0]),
    (np.array([0.5, 0.25, 2.0], np.float32), [0.5, 0.25, 2.0]),
    ([np.float32(0.1), 1, np.True_], [float(np.float32(0.1)), 1.0, 1.0])])
def test_bools_and_numpy_arrays_convert_exactly(value, want):
    total, parts = RewardFunctions((returning(value),))(["q"] * 3, ["a", "b", "c"], {})
    assert total.dtype == np.float64 and total.tolist() == want


def test_torch_tensors_convert_exactly():
    torch = pytest.importorskip("torch")
    third = torch.tensor([1 / 3], dtype=torch.float32)
    for value, want in [
            (torch.tensor([1.0, 0.0, 2.5], requires_grad=True), [1.0, 0.0, 2.5]),
            (torch.tensor([True, False, True]), [1.0, 0.0, 1.0]),
            (torch.tensor([1, 0, 7]), [1.0, 0.0, 7.0]),
            (torch.tensor([0.5, 1.0, 3.0], dtype=torch.bfloat16), [0.5, 1.0, 3.0]),
            ([third[0], torch.tensor(1), 2.0], [float(np.float32(1 / 3)), 1.0, 2.0])]:
        total, _ = RewardFunctions((returning(value),))(["q"] * 3, ["a", "b", "c"], {})
        assert total.tolist() == want, value


@pytest.mark.parametrize("value, shown", [
    (["1", 0.0, 0.0], "'1'"), ([1 + 0j, 0.0, 0.0], r"\(1\+0j\)"),
    ([2 ** 60 + 1, 0, 0], str(2 ** 60 + 1)), (np.zeros((3, 1)), r"an array of shape \(3, 1\)")])
def test_values_that_are_not_exact_numbers_are_refused(value, shown):
    with pytest.raises(RewardFunctionError, match=shown):
        RewardFunctions((returning(value),))(["q"] * 3, ["a", "b", "c"], {})


def test_reward_module_whose_own_import_fails_is_named_with_its_line(tmp_path, monkeypatch):
    """A missing dependency of the module is not "no module named <the module>": the message
    names the line that imports it."""
    path = write_module(tmp_path, "zx_needs_missing", "x = 1\nimport zx_not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=re.escape(f"({path}:2)")):
        load_reward_func("zx_needs_missing:score")
    with pytest.raises(ValueError, match=r"module zeroxla.rlhf \(.*\) has no 'missing'"):
        load_reward_func("zeroxla.rlhf:missing")
