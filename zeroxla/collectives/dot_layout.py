"""A weight gradient reduce-scattered in the dim order of the dot that produced it.

JAX's transpose rule for `dot_general` makes a weight's cotangent as a dot in the dot's own dim
order (its output dims, then its input dims) followed by a `transpose` into the weight's order:
for `x @ W` with `W[D, F]` that is `dot(ct, x) -> [F, D]`, then `transpose -> [D, F]`. XLA:CPU's
algebraic simplifier folds that transpose into the dot, and the folded dot (its left operand
contracted on its major dim) is one XLA:CPU's fast dot library (YNNPACK) refuses, so it runs on
Eigen's generic contraction instead: on gpt-small (2x4, `benchmarks/zero.py`) the MLP weight
gradients alone made ZeRO-3's step ~7% slower than GSPMD FSDP's (whose program keeps the
transpose apart).

`Permuted` carries such a cotangent as the dot made it (`natural`) with the permutation that
puts it in the weight's order. `reduce_scatter_permuted` sums it over the data devices and
scatters it, on CPU, in the dot's order, then transposes only this device's shard (1/N of the
bytes): the transpose never meets the dot, which stays as autodiff wrote it. Every other
backend transposes first and scatters in the weight's order, autodiff's own program (the
choice is made per platform when the program is lowered, as `wire`'s). The values are
identical: the same sums of the same elements, moved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from zeroxla.sharding.leaf_plan import pad_along


@dataclasses.dataclass(frozen=True)
class Permuted:
    """A cotangent equal to `lax.transpose(natural, permutation)` (dim i of it is dim
    `permutation[i]` of `natural`), kept untransposed until it is scattered."""

    natural: jax.Array
    permutation: tuple[int, ...]

    def value(self) -> jax.Array:
        return lax.transpose(self.natural, self.permutation)


def as_array(grad: Any) -> Any:
    """`grad` in the weight's dim order (a `Permuted` transposed; anything else as it is)."""
    return grad.value() if isinstance(grad, Permuted) else grad


def reduce_scatter_permuted(grad: Permuted, dim: int, pad: int,
                            scatter: Callable[[jax.Array, int], jax.Array]) -> jax.Array:
    """`scatter(padded, dim)` of the cotangent in the weight's order, `padded` it with `pad`
    zeros appended along `dim`; `scatter(x, d)` reduce-scatters `x` along its dim `d` (any
    dim). On CPU `x` is the dot's own array (padded along the dim that becomes `dim`) and the
    shard is transposed after; elsewhere the transpose comes first."""
    natural_dim = grad.permutation[dim]

    def padded(x: jax.Array, d: int) -> jax.Array:
        return pad_along(x, d, pad) if pad else x

    def dot_order(natural):                                # XLA:CPU
        return lax.transpose(scatter(padded(natural, natural_dim), natural_dim),
                             grad.permutation)

    def weight_order(natural):
        return scatter(padded(lax.transpose(natural, grad.permutation), dim), dim)
    return lax.platform_dependent(grad.natural, cpu=dot_order, default=weight_order)
