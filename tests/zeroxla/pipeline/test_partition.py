"""Layer partitioning against DeepSpeed's own functions (vendored) and DeepSpeed's unit tests."""

import random

import pytest

import deepspeed_partition_reference as ds
from zeroxla.pipeline import partition_balanced, partition_layers, partition_uniform

# Trainable parameters of torchvision's AlexNet, layer by layer (features, avgpool, classifier).
ALEXNET = [23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0, 0, 0, 0, 37752832, 0,
           0, 16781312, 0, 40970]


def _sums(weights, parts):
    return [sum(weights[a:b]) for a, b in zip(parts[:-1], parts[1:])]


def _assert_valid(weights, parts, num_parts):
    """DeepSpeed's `assert_valid_partition`."""
    assert len(parts) == num_parts + 1
    assert parts[0] == 0 and parts[-1] == len(weights)
    assert all(a <= b for a, b in zip(parts[:-1], parts[1:]))
    assert all(type(p) is int for p in parts)


@pytest.mark.parametrize("num_parts,expected", [(2, [0, 19, 22]), (4, [0, 8, 16, 19, 22])])
def test_alexnet(num_parts, expected):
    assert partition_balanced(ALEXNET, num_parts) == expected
    assert ds.partition_balanced(ALEXNET, num_parts) == expected


# --- DeepSpeed's tests/unit/utils/test_partition_balanced.py -------------------------------

@pytest.mark.parametrize("weights,num_parts,target_diff", [
    ([1, 2, 1], 4, 2),
    ([1, 1, 1, 1], 4, 0),
    ([1, 1, 1, 1, 1], 4, 1),
    ([1, 1, 1, 1, 0, 1], 4, 1),
])
def test_deepspeed_partition_balanced(weights, num_parts, target_diff):
    sums = _sums(weights, partition_balanced(weights, num_parts))
    assert max(sums) - min(sums) == target_diff


# --- DeepSpeed's tests/unit/runtime/utils/test_partition.py ---------------------------------

def test_deepspeed_valid_partition():
    weights = [1] * 10
    _assert_valid(weights, partition_balanced(weights, 1), 1)


def test_deepspeed_short_partition_uniform():
    _assert_valid([1] * 2, partition_uniform(2, 4), 4)


def test_deepspeed_short_partition():
    _assert_valid([1] * 2, partition_balanced([1] * 2, 4), 4)


def test_deepspeed_easy_balance_uniform():
    parts = partition_uniform(8, 4)
    _assert_valid([1] * 8, parts, 4)
    assert _sums([1] * 8, parts) == [2, 2, 2, 2]


def test_deepspeed_easy_balance_balanced():
    parts = partition_balanced([1] * 8, 4)
    _assert_valid([1] * 8, parts, 4)
    assert _sums([1] * 8, parts) == [2, 2, 2, 2]


def test_deepspeed_int_balanced():
    weights = [0, 1, 2, 3, 3, 3]
    parts = partition_balanced(weights, 4)
    assert parts == [0, 3, 4, 5, 6]
    assert _sums(weights, parts) == [3, 3, 3, 3]


def test_deepspeed_float_balanced():
    assert partition_balanced([0., 1.1, 1.9, 3., 3., 3.], 4) == [0, 3, 4, 5, 6]


def test_deepspeed_float_lastheavy():
    """DeepSpeed skips this test ("variance-minimizing partitioning returns a different result"
    than its [0, 4, 5]); we pin what DeepSpeed's function does return."""
    weights = [0., 1.1, 1.9, 3., 30.]
    assert partition_balanced(weights, 2) == ds.partition_balanced(weights, 2) == [0, 4, 5]


def test_deepspeed_float_midheavy():
    assert partition_balanced([0., 1.1, 30, 3.], 3) == [0, 2, 3, 4]


def test_deepspeed_balance_bert():
    # Parameters per layer of a 24-layer transformer with hidden size 1024.
    weights = [52559872] + [12596224] * 24 + [0, 52559872]
    parts = partition_balanced(weights, 8)
    _assert_valid(weights, parts, 8)
    assert parts == ds.partition_balanced(weights, 8)


# --- Against the vendored DeepSpeed functions -----------------------------------------------

@pytest.mark.parametrize("num_parts", range(1, 11))
def test_uniform_matches_deepspeed(num_parts):
    for num_items in range(0, 41):
        parts = partition_uniform(num_items, num_parts)
        assert parts == ds.partition_uniform(num_items, num_parts), num_items
        sizes = _sums([1] * num_items, parts)
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kind", ["small_int", "large_int", "float", "with_zeros"])
def test_balanced_matches_deepspeed(kind):
    rng = random.Random(kind)
    draw = {"small_int": lambda: rng.randint(0, 3),           # many ties
            "large_int": lambda: rng.randint(0, 10**8),
            "float": lambda: rng.uniform(0.0, 10.0),
            "with_zeros": lambda: rng.choice([0, 0, 1, 5, 1000])}[kind]
    for _ in range(150):
        weights = [draw() for _ in range(rng.randint(0, 14))]
        num_parts = rng.randint(1, 7)
        parts = partition_balanced(weights, num_parts)
        assert parts == [int(p) for p in ds.partition_balanced(weights, num_parts)], (
            weights, num_parts)
        _assert_valid(weights, parts, num_parts)
        if len(weights) > num_parts:
            assert all(a < b for a, b in zip(parts[:-1], parts[1:])), "a part is empty"


def test_balanced_keeps_deepspeeds_suboptimal_answer():
    """DeepSpeed's dynamic program is not exact (docstring): we return its answer, not the
    optimum [0, 1, 3, 6, 7] (sums 5, 11, 11, 5)."""
    weights = [5, 7, 4, 4, 0, 7, 5]
    assert partition_balanced(weights, 4) == ds.partition_balanced(weights, 4) == [0, 2, 5, 6, 7]


def test_balanced_ties_go_to_the_latest_split():
    assert partition_balanced([1, 0, 0, 1], 2) == [0, 3, 4]
    assert partition_balanced([0, 0, 0], 2) == [0, 2, 3]


# --- partition_layers: DeepSpeed's PipelineModule partition methods --------------------------

GPT = ([("Embedding", 10_000_000)] + [("ParallelTransformerLayer", 1_000_000)] * 8
       + [("LayerNorm", 2_048), ("LMHead", 10_000_000)])


def test_layers_parameters_balances_counts():
    assert partition_layers(GPT, 2, "parameters") == partition_balanced([n for _, n in GPT], 2)
    assert partition_layers(GPT, 2) == partition_layers(GPT, 2, "Parameters")


def test_layers_uniform():
    assert partition_layers(GPT, 4, "uniform") == partition_uniform(len(GPT), 4) == [
        0, 3, 6, 9, 11]


def test_layers_type_regex_balances_matching_layers():
    parts = partition_layers(GPT, 4, "type:transformer")      # re.search, case-insensitive
    # DeepSpeed: binary weights (1 where the class name matches), then partition_balanced.
    expected = ds.partition_balanced([1 if "Transformer" in n else 0 for n, _ in GPT], 4)
    assert parts == [int(p) for p in expected]
    blocks = [sum(n == "ParallelTransformerLayer" for n, _ in GPT[a:b])
              for a, b in zip(parts[:-1], parts[1:])]
    assert blocks == [2, 2, 2, 2]


def test_layers_type_regex_keeps_case_and_colons():
    r"""DeepSpeed lower-cases the whole method (so \W becomes \w) and cuts the pattern at its
    first ':' (so "(?:" breaks); we use the pattern as written. Weights [0, 1, 0, 1] split as
    [0, 3, 4] (ties go to the latest split); all-ones weights would split as [0, 2, 4]."""
    layers = [("MyBlock", 1), ("Block", 1), ("MyBlock", 1), ("Block", 1)]
    assert partition_layers(layers, 2, r"type:^(?:block)$") == [0, 3, 4]
    assert partition_layers(layers, 2, r"type:^\W*BLOCK$") == [0, 3, 4]
    assert partition_layers(layers, 2, r"type:^\w*BLOCK$") == [0, 2, 4]


class Linear:
    def __init__(self, n):
        self.num_params = n


def relu(x):
    return x


def test_layers_objects():
    layers = [Linear(100), relu, Linear(100), relu, Linear(300)]
    assert partition_layers(layers, 2, "parameters") == partition_balanced(
        [100, 0, 100, 0, 300], 2)
    assert partition_layers(layers, 3, "type:relu") == partition_balanced([0, 1, 0, 1, 0], 3)
    assert partition_layers(layers, 2, "type:linear") == partition_balanced([1, 0, 1, 0, 1], 2)


def test_layers_object_without_parameter_count():
    with pytest.raises(ValueError, match=r"layers\[0\] \(object\) has no parameter count"):
        partition_layers([object()], 1, "parameters")


@pytest.mark.parametrize("method", ["profile", "params", "types:x", 3])
def test_unknown_method(method):
    with pytest.raises(ValueError, match=r"method=.* accepted: \"parameters\", \"uniform\", "
                                         r"\"type:<regex>\""):
        partition_layers(GPT, 2, method)


def test_type_regex_errors():
    with pytest.raises(ValueError, match=r"method='type:conv' matches no layer; layer names"):
        partition_layers(GPT, 2, "type:conv")
    with pytest.raises(ValueError, match=r"not a regular expression"):
        partition_layers(GPT, 2, "type:(")


@pytest.mark.parametrize("call", [
    lambda: partition_uniform(4, 0),
    lambda: partition_balanced([1, 2], 0),
    lambda: partition_layers(GPT, -1, "uniform"),
    lambda: partition_uniform(4, 2.0),
])
def test_num_parts_validation(call):
    with pytest.raises(ValueError, match=r"num_parts=.* is invalid; accepted: an integer >= 1"):
        call()


def test_num_items_and_param_count_validation():
    with pytest.raises(ValueError, match=r"num_items=-1 is invalid"):
        partition_uniform(-1, 2)
    with pytest.raises(ValueError, match=r"layers\[1\] has num_params=-5"):
        partition_layers([("a", 1), ("b", -5)], 2, "parameters")
