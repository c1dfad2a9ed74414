"""Which layers go to which pipeline stage: DeepSpeed's layer partitioning, in plain Python.

A partition of `n` layers into `p` stages is given, as in DeepSpeed, by its `p + 1` boundaries
`parts`: stage `s` owns layers `parts[s] : parts[s + 1]`, `parts[0] == 0`, `parts[p] == n`.

    partition_uniform(n, p)          the same number of layers per stage (± 1)
    partition_balanced(weights, p)   contiguous parts whose weight sums are as even as possible
    partition_layers(layers, p, m)   PipelineModule's `partition_method`: "parameters",
                                     "uniform" or "type:<regex>"

The results are identical to DeepSpeed >= 0.12.5 (`deepspeed/runtime/utils.py`), so a model split
by DeepSpeed and by zeroxla puts the same layers on the same stage.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Sequence

PARTITION_METHODS = ('"parameters"', '"uniform"', '"type:<regex>"')


def _check_num_parts(num_parts: int) -> None:
    if not isinstance(num_parts, int) or isinstance(num_parts, bool) or num_parts < 1:
        raise ValueError(f"num_parts={num_parts!r} is invalid; accepted: an integer >= 1")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` parts of `num_items` items, sizes differing by at most one.

    The first `num_items % num_parts` parts get the extra item (DeepSpeed >= 0.10.1, #4053).
    With fewer items than parts, the first `num_items` parts get one item each and the rest none.
    """
    _check_num_parts(num_parts)
    if not isinstance(num_items, int) or isinstance(num_items, bool) or num_items < 0:
        raise ValueError(f"num_items={num_items!r} is invalid; accepted: an integer >= 0")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` non-empty contiguous parts of `weights` minimising
    max(part sum) - min(part sum).

    This is DeepSpeed's dynamic program (#4312, in 0.12.5), kept step for step so that ties
    resolve the same way: among equally good splits the last part starts as late as possible
    (DeepSpeed compares with `>=`). Each prefix remembers the (max, min) of one chosen split
    only, and max - min does not decompose over prefixes, so the result is not always optimal:
    [5, 7, 4, 4, 0, 7, 5] in 4 parts gives sums 12, 8, 7, 5 (range 7) although 5, 11, 11, 5
    (range 6) exists. We return what DeepSpeed returns.
    With `len(weights) <= num_parts` it falls back to `partition_uniform` (some parts empty).
    """
    _check_num_parts(num_parts)
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)

    # prefix[i] = sum(weights[:i]); DeepSpeed sums in the weights' own type, then takes float64.
    prefix = [0.0] + [float(s) for s in itertools.accumulate(weights)]
    inf = math.inf
    # best[i][j] = (cost, max_sum, min_sum) for weights[:i] in j parts; split[i][j] = where the
    # j-th part starts. DeepSpeed initialises min_sum of the empty prefix to +inf, not 0.
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    max_sum = [[inf] * (m + 1) for _ in range(n + 1)]
    min_sum = [[inf] * (m + 1) for _ in range(n + 1)]
    split = [[0] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = max_sum[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):                          # last part = weights[k:i]
                last = prefix[i] - prefix[k]
                hi = max(max_sum[k][j - 1], last)
                lo = min(min_sum[k][j - 1], last)
                if cost[i][j] >= hi - lo:               # `>=`: ties go to the later k
                    cost[i][j], max_sum[i][j], min_sum[i][j] = hi - lo, hi, lo
                    split[i][j] = k

    parts = [n]
    for j in range(m, 0, -1):
        parts.append(split[parts[-1]][j])
    return parts[::-1]


def _layer_name(layer: Any) -> str:
    """The name `type:<regex>` is matched against: a class's or function's own `__name__` (as for
    DeepSpeed's LayerSpec and function layers), else the class name of an instance."""
    if isinstance(layer, tuple):
        return str(layer[0])
    name = getattr(layer, "__name__", None)
    return name if isinstance(name, str) else type(layer).__name__


def _layer_params(index: int, layer: Any) -> int:
    """A layer's parameter count: the second item of a `(name, num_params)` pair, an object's
    `num_params` attribute, or 0 for a class or function (DeepSpeed counts parameters of built
    modules only; a function layer such as an activation has none)."""
    if isinstance(layer, tuple):
        return layer[1]
    count = getattr(layer, "num_params", None)
    if count is not None:
        return count
    if isinstance(getattr(layer, "__name__", None), str):
        return 0
    raise ValueError(
        f"layers[{index}] ({type(layer).__name__}) has no parameter count; pass a "
        "(name, num_params) pair or an object with a `num_params` attribute")


def partition_layers(layers: Sequence[Any], num_parts: int, method: str = "parameters"
                     ) -> list[int]:
    """Boundaries splitting `layers` over `num_parts` pipeline stages, as DeepSpeed's
    `PipelineModule(partition_method=method)` splits its layer specs.

    `layers` holds `(name, num_params)` pairs, or objects (named by their class, or by their own
    `__name__` for classes and functions; counted by a `num_params` attribute).
    `method` (case-insensitive keyword, as in DeepSpeed):
      "parameters"     balance the parameter counts (`partition_balanced`), DeepSpeed's default;
      "uniform"        the same number of layers per stage (`partition_uniform`);
      "type:<regex>"   balance the number of layers whose name matches `regex` (`re.search`,
                       case-insensitive), e.g. "type:transformer" to give each stage the same
                       number of transformer blocks whatever the embedding's size.
    """
    _check_num_parts(num_parts)
    if not isinstance(method, str):
        raise ValueError(f"method={method!r} is invalid; accepted: {', '.join(PARTITION_METHODS)}")
    keyword = method.lower()
    if keyword == "uniform":
        return partition_uniform(len(layers), num_parts)
    if keyword == "parameters":
        counts = [_layer_params(i, layer) for i, layer in enumerate(layers)]
        for i, count in enumerate(counts):
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"layers[{i}] has num_params={count!r}; accepted: an integer >= 0")
        return partition_balanced(counts, num_parts)
    if keyword.startswith("type:"):
        # DeepSpeed lower-cases the whole method and keeps only the text up to the next ':'.
        # We keep the pattern as written (after "type:"), so a ':' or an upper-case escape
        # such as \W inside the regex means what it says.
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise ValueError(f"method={method!r}: {pattern!r} is not a regular expression "
                             f"({err})") from None
        weights = [1 if regex.search(_layer_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({_layer_name(layer) for layer in layers})
            raise ValueError(f"method={method!r} matches no layer; layer names are {names}")
        return partition_balanced(weights, num_parts)
    raise ValueError(f"method={method!r} is not a partition method; accepted: "
                     f"{', '.join(PARTITION_METHODS)}")
