"""The frozen reference model of PPO, optionally held as int8 codes (DeepSpeed-Chat's MixZ++).

The reference only ever runs forward, to give the log-probs the KL penalty compares the actor
with, so DeepSpeed-Chat lets ZeRO++ store it quantized (`zero_quantized_nontrainable_weights`,
"MixZ++"): int8 codes in groups, dequantized just before use. Here the reference is a plain
model on one device; with `int8=True` every floating parameter of at least one group is kept as
symmetric int8 codes in groups of `GROUP_SIZE` elements (one float32 step per group: about 1/4
of the float32 bytes) and dequantized inside the jitted forward, so the float copy exists only
while the forward runs. Smaller parameters (norm scales, biases) stay as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zeroxla.pallas_kernels import QuantizedArray
from zeroxla.pallas_kernels.quantization import dequantize, quantize

GROUP_SIZE = 256


def _is_codes(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _encode(x: jax.Array) -> Any:
    if jnp.issubdtype(x.dtype, jnp.floating) and x.size >= GROUP_SIZE:
        return quantize(x, bits=8, group_size=GROUP_SIZE)
    return x


@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def _forward(fn: Callable, graphdef: Any, params: Any, tokens: jax.Array,
             answer_length: int) -> jax.Array:
    """`fn(model, tokens, answer_length)` with the codes dequantized first: [B, G]."""
    params = jax.tree.map(lambda x: dequantize(x) if _is_codes(x) else x, params,
                          is_leaf=_is_codes)
    return fn(nnx.merge(graphdef, params), tokens, answer_length)


class FrozenReference:
    """`reference(fn, tokens, answer_length)`: `fn` (e.g. `answer_logprobs`) on a frozen copy
    of `model` placed on `device`, stored as int8 codes when `int8`."""

    def __init__(self, model: nnx.Module, *, device: Any, int8: bool = False):
        self.graphdef, params = nnx.split(nnx.clone(model))
        if int8:
            params = jax.tree.map(_encode, params)
        self.params = jax.device_put(params, device)
        self.int8 = int8

    def __call__(self, fn: Callable, tokens: jax.Array, answer_length: int) -> jax.Array:
        return _forward(fn, self.graphdef, self.params, tokens, answer_length)

    @property
    def nbytes(self) -> int:
        """Bytes the reference holds on its device (codes, steps and unquantized leaves)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.params))


__all__ = ["FrozenReference", "GROUP_SIZE"]
