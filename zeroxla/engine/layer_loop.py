"""The layer loop of a gathered stack (`GatheredStack`): one `lax.scan` over its layers,
gathering each layer's parameters just before (or, with prefetch, one layer ahead of) its
compute, its per-layer values read and written in place.

`layer_loop` serves both directions: forward (first to last layer, keeping each layer's
residuals for backward) and backward (last to first, consuming them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.wire import is_16bit_float
from zeroxla.engine.remat import is_float


class _Stacked:
    """A pytree of arrays stacked on a leading layer dim, read one layer at a time (`at`), 16-bit
    floats through their raw bits.

    XLA:CPU has no 16-bit float `dynamic-slice`: its float normalization (bf16) converts the
    operand, the whole stack, to float32 inside the loop, and loop-invariant code motion hoists
    that convert out of it. A float32 image of every 16-bit stack a loop reads (stage 2's bf16
    compute copy of the layers: twice its bytes) is then live from before the forward loop to
    after the backward one, which reads the same stack. A uint16 slice is native; XLA:CPU
    materialises the bitcast as a uint16 copy of the stack (half the float32 image), and other
    backends, which slice bf16 natively, reinterpret it in place. gpt-small, bf16 ZeRO-2:
    temporaries 10.2 MiB slicing the bits, 19.1 MiB slicing bf16. Used inside custom VJPs only
    (`GatheredStack`, the pipeline executor): bitcasts have no derivative, and nothing here is
    differentiated through."""

    def __init__(self, tree: Any):
        leaves, self._treedef = jax.tree.flatten(tree)
        self._dtypes = [leaf.dtype if is_16bit_float(leaf.dtype) else None for leaf in leaves]
        self._bits = [lax.bitcast_convert_type(leaf, jnp.uint16) if dtype else leaf
                      for leaf, dtype in zip(leaves, self._dtypes)]

    def at(self, i: int | jax.Array) -> Any:
        """Layer `i` (a static int, or traced inside a loop) of every leaf."""
        if isinstance(i, int):
            sliced = [b[i] for b in self._bits]
        else:
            sliced = [lax.dynamic_index_in_dim(b, i, 0, keepdims=False) for b in self._bits]
        return jax.tree.unflatten(self._treedef, [
            lax.bitcast_convert_type(x, dtype) if dtype else x
            for x, dtype in zip(sliced, self._dtypes)])


def _index_after(layer: int | jax.Array, dependency: Any) -> int | jax.Array:
    """`layer` as an index XLA cannot know before `dependency` exists. A stack read at a static
    index may be sliced as soon as the stack exists, and XLA:CPU's scheduler does so: backward's
    last layer (layer 0) would then hold a copy of its residuals through the whole backward loop.
    A NaN in `dependency` (the layer's input carry: in backward its cotangent, whose NaN makes
    every gradient NaN anyway) moves the index one layer on (`dynamic-slice` clamps it)."""
    floats = [leaf for leaf in jax.tree.leaves(dependency) if is_float(leaf) and leaf.size]
    if not floats:
        return layer
    probe = floats[0].reshape(-1)[0]
    return layer + (probe != probe).astype(jnp.int32)


def _scan(body: Callable, carry: Any, xs: Any, *, reverse: bool) -> tuple[Any, Any]:
    """`lax.scan(body, carry, xs)` over layers, each layer's `xs` read inside the loop through
    `_Stacked` (16-bit floats as their raw bits)."""
    stacked = _Stacked(xs)
    num_layers = jax.tree.leaves(xs)[0].shape[0]
    return lax.scan(lambda c, i: body(c, stacked.at(i)), carry, jnp.arange(num_layers),
                    reverse=reverse)


def _written(buffers: Any, layer: int | jax.Array, values: Any) -> Any:
    """`buffers` (stacked on the layer dim) with layer `layer` set to `values`, in place."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, layer, 0),
                        buffers, values)


@dataclasses.dataclass(frozen=True)
class Peeled:
    """The per-layer values a forward `layer_loop` keeps for backward, where it made them:
    `scanned` stacked for the layers computed inside its loop, `outside` the last layer's,
    computed after it (None where the loop ran every layer: one layer, or nothing gathered)."""

    scanned: Any
    outside: Any


jax.tree_util.register_dataclass(Peeled, ["scanned", "outside"], [])


def layer_loop(step: Callable, gather: Callable, gather_inputs: Any, xs: Any, carry: Any, *,
               num_layers: int, reverse: bool, prefetch: bool, partitioned: bool,
               kept: Peeled | None = None) -> tuple[Any, Any, Peeled]:
    """Runs `carry, y_i, k_i = step(carry, full_i, xs_i, kept_i)` over layers (last to first if
    `reverse`).

    `full_i, saved_i = gather(gather_inputs_i, carry)` (the carry lets a gather depend on it).
    With `prefetch`, the gather of the next layer is issued in the same loop iteration as the
    current layer's compute, before it and independent of it, so XLA can overlap the two (the
    first gather happens before the loop); without, each layer is gathered just before it runs.
    Either way exactly `num_layers` gathers run, and the last layer is computed after the loop.
    A stack with no `partitioned` parameters (ZeRO-2's: its "gather" is the identity) runs as one
    plain scan over all its layers: computing one layer apart costs a second compile of the
    layer for one layer's residuals. `kept` is what the forward loop returned as its `k`s, for the backward
    one (`reverse`; None: `kept_i` is None). Returns `(carry, (ys, saveds), ks)`: ys and saveds
    stacked in layer order, ks `Peeled`.

    Memory is the point of how a gathered stack's loop reads and writes its per-layer values:
    `gather_inputs` and `xs` are read inside the loop at the layer it computes (`_Stacked.at`),
    never sliced into copies beforehand; ys and saveds, the last layer's included, are written
    in place into one stack each (`_written`), never joined by a concatenation. Forward's last
    layer's residuals stay outside its stack (`Peeled.outside`), and backward, which starts
    there, holds one layer's residuals at a time in its loop state: it uses them, then reads the
    next layer's from the stack into the same buffer (at an index that depends on the layer's
    result, so not before). At backward's first layer the residuals live are then the stack's
    L-1 layers and that one, not the stack's L and a copy of one. gpt-small, AdamW, 2x4
    (`benchmarks/zero.py`), ZeRO-3's compiled peak: 105.9 MiB read and written this way,
    128.9 MiB with the stacks sliced into copies before the loop, joined by concatenation after
    it, and the next layer's residuals carried beside the current ones (GSPMD FSDP's: 112.3).
    """
    if num_layers == 1 or not partitioned:
        def body(c, inputs):
            gin, x, k_in = inputs
            full, saved = gather(gin, c)
            c, y, k = step(c, full, x, k_in)
            return c, (y, saved, k)
        carry, (ys, saveds, ks) = _scan(
            body, carry, (gather_inputs, xs, None if kept is None else kept.scanned),
            reverse=reverse)
        return carry, (ys, saveds), Peeled(ks, None)
    if kept is not None and not reverse:
        raise AssertionError("only a backward (reverse) loop reads a forward loop's kept values")

    gins, per_layer = _Stacked(gather_inputs), _Stacked(xs)
    stacked_kept = None if kept is None else _Stacked(kept.scanned)
    first, last, ahead = (num_layers - 1, 0, -1) if reverse else (0, num_layers - 1, 1)
    k_in = None if kept is None else kept.outside          # backward's first layer's
    gathered = (gather(gins.at(first), carry) if prefetch
                else jax.eval_shape(lambda: gather(gins.at(first), carry)))
    # ys and saveds have a row for every layer, the last one's written after the loop; the
    # loop's ks are its own output (forward computes layers 0..L-2 in it, in row order).
    # `gathered` is abstract without prefetch: an argument of eval_shape, not a closed-over value.
    y_shape = jax.eval_shape(lambda full: step(carry, full, per_layer.at(first), k_in),
                             gathered[0])[1]
    ys_saveds = jax.tree.map(lambda a: jnp.zeros((num_layers, *a.shape), a.dtype),
                             (y_shape, gathered[1]))
    gathered = gathered if prefetch else None

    def body(state, p):
        c, gathered, k_in, ys_saveds = state
        layer = num_layers - 1 - p if reverse else p
        if prefetch:                   # the next layer's gather, issued beside this compute
            (full, saved), gathered = gathered, gather(gins.at(layer + ahead), c)
        else:
            full, saved = gather(gins.at(layer), c)
        c, y, k = step(c, full, per_layer.at(layer), k_in)
        if kept is not None:           # the next layer's residuals, read after this one's use
            k_in = stacked_kept.at(_index_after(layer + ahead, c))
        return (c, gathered, k_in, _written(ys_saveds, layer, (y, saved))), k

    (carry, gathered, k_in, ys_saveds), ks = lax.scan(
        body, (carry, gathered, k_in, ys_saveds), jnp.arange(num_layers - 1))
    full, saved = gathered if prefetch else gather(gins.at(last), carry)
    carry, y, k_last = step(carry, full, per_layer.at(_index_after(last, carry)), k_in)
    ys, saveds = _written(ys_saveds, last, (y, saved))
    return carry, (ys, saveds), Peeled(ks, k_last)
