"""The layer loop of a gathered stack: one `lax.scan` over the layers, gathering ahead.

`layer_loop` runs `step` over a stack's layers (last to first in backward), each on its
parameters just gathered, with `ZeroConfig.prefetch`: the gather of the next layer is issued
beside the current layer's compute, so at most two layers' parameters are ever live.

Memory is the point of how the loop reads its per-layer inputs. Everything stacked on a layer
dim (the shards to gather, the per-layer xs, what forward kept for backward) is indexed *inside*
the loop body at the layer being computed (`_Stacked.at`), never sliced into a copy beforehand
or carried from one iteration to the next, and at an index XLA cannot know before the layer runs
(`_index_after`), so that no layer's copy is made early: a layer's residuals are read where
forward left them, one layer at a time. Forward computes its last layer after the scan (with
prefetch, its gather of the next layer would have nothing to gather), so that layer's residuals
lie outside forward's stack (`Peeled`) and live only until backward, which starts there,
computes that layer before its scan. gpt-small, AdamW, 2x4 (`benchmarks/zero.py`): ZeRO-3's
peak 128.9 -> 97.1 MiB (GSPMD FSDP's: 112.3), 94.1 MiB without prefetch. The loop this replaced
carried the next layer's residuals in the scan's state (two layers' residuals beside the stack)
and sliced backward's last layer out before its scan (one more, held through it).

16-bit float stacks are indexed as their raw bits (uint16): XLA:CPU has no 16-bit float
`dynamic-slice`; its float normalization converts the operand, the whole stack, to float32 inside
the loop, and loop-invariant code motion hoists that convert out of it, a float32 image of every
16-bit stack the loop reads (stage 2's bf16 compute copy of the layers: twice its bytes) live
across both loops. A uint16 slice is native; XLA:CPU materialises the bitcast as a uint16 copy
(half the float32 image), other backends reinterpret it in place. gpt-small, bf16 ZeRO-2:
temporaries 19.1 -> 10.2 MiB. Used inside custom VJPs only (`GatheredStack`, the pipeline
executor): bitcasts have no derivative, and nothing here is differentiated through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.collectives.wire import is_16bit_float


class _Stacked:
    """A pytree of arrays stacked on a leading layer dim, read one layer at a time (`at`), 16-bit
    floats through their raw bits (see the module docstring)."""

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


@dataclasses.dataclass(frozen=True)
class Peeled:
    """Per-layer values of a `layer_loop`, left where the loop made them: `scanned` stacked
    for the layers `start, start + 1, ...` the scan computed (None if it computed none), and
    `outside`, one per layer of `outside_layers` (static), the layers computed before or after
    it. Joining the two would copy every layer's values; a loop over the same layers reads
    them where they are (`reader`)."""

    scanned: Any
    outside: tuple[Any, ...]
    start: int = 0
    outside_layers: tuple[int, ...] = ()

    def reader(self) -> Callable[[int | jax.Array], Any]:
        """`at(layer)`: the values of `layer` (an outside one's, else `scanned`'s, read at a
        layer index given static or traced; its bits taken once, here, outside any loop)."""
        stacked = None if self.scanned is None else _Stacked(self.scanned)

        def at(layer):
            if isinstance(layer, int) and layer in self.outside_layers:
                return self.outside[self.outside_layers.index(layer)]
            return stacked.at(layer - self.start)
        return at


jax.tree_util.register_dataclass(Peeled, ["scanned", "outside"], ["start", "outside_layers"])


def _join(lower: list[Any], stacked: Any, upper: list[Any], scanned: bool) -> Any:
    """Per-layer values in layer order: single layers `lower`, then the scan's stack (if
    `scanned`), then single layers `upper`."""
    parts = ([jax.tree.map(lambda a: a[None], x) for x in lower] + ([stacked] if scanned else [])
             + [jax.tree.map(lambda a: a[None], x) for x in upper])
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _schedule(num_layers: int, reverse: bool, kept: Peeled | None
              ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """`(head, scanned, tail)`: the layers computed before the scan, in it, and after it, each
    in the order computed. `head` are the first layers whose kept values lie outside `kept`'s
    stack (backward starting at forward's last layer). The last layer runs after the scan
    (`tail`): with prefetch its gather of the next layer would have nothing to gather, and
    either way forward's last residuals, which backward consumes first, stay out of the stack."""
    order = tuple(range(num_layers))[::-1] if reverse else tuple(range(num_layers))
    outside = () if kept is None else kept.outside_layers
    head = 0
    while head < len(order) and order[head] in outside:
        head += 1
    stop = max(head, len(order) - 1)
    scanned, tail = order[head:stop], order[stop:]
    if any(layer in outside for layer in scanned + tail):
        raise AssertionError(f"layers {outside} kept outside the stack fall after the head")
    return order[:head], scanned, tail


def _index_after(layer: int | jax.Array, dependency: Any) -> int | jax.Array:
    """`layer` as an index XLA cannot know before `dependency` exists. A stack read at a
    static index (a layer after the scan, or inside a scan of one trip, which XLA inlines) may
    be sliced as soon as the stack exists, and XLA:CPU's scheduler does so: backward's last
    layer then holds a copy of its residuals through the whole backward scan (gpt-small:
    12 MiB). A NaN in `dependency` (the layer's input carry: in backward its cotangent, whose
    NaN makes every gradient NaN anyway) moves the index one layer on (`dynamic-slice` clamps
    it into range)."""
    floats = [leaf for leaf in jax.tree.leaves(dependency)
              if jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size]
    if not floats:
        return layer
    probe = floats[0].reshape(-1)[0]
    return layer + (probe != probe).astype(jnp.int32)


def layer_loop(step: Callable, gather: Callable, gather_inputs: Any, xs: Any, carry: Any, *,
               num_layers: int, reverse: bool, prefetch: bool,
               kept: Peeled | None = None) -> tuple[Any, Any, Peeled]:
    """Runs `carry, y_i, k_i = step(carry, full_i, xs_i, kept_i)` over layers (last to first if
    `reverse`).

    `full_i, saved_i = gather(gather_inputs_i, carry)` (the carry lets a gather depend on it).
    With `prefetch`, the gather of the next layer is issued before the current layer's compute
    and independent of it, so XLA can overlap the two (the first gather happens before the
    scan); without, each layer is gathered just before it runs. Either way exactly `num_layers`
    gathers run, and the last layer is computed after the scan (`_schedule`). `kept` is what a
    loop over the same layers in the other direction returned as its `k`s (forward's residuals,
    for backward; None: `kept_i` is None). `gather_inputs`, `xs` and `kept` are read at the
    layer computed, inside the scan (`_Stacked`). Returns `(carry, (ys, saveds), ks)`: ys and
    saveds stacked in layer order, ks `Peeled`.
    """
    gins, per_layer = _Stacked(gather_inputs), _Stacked(xs)
    head, scanned, tail = _schedule(num_layers, reverse, kept)
    order = head + scanned + tail
    results: dict[int, tuple[Any, Any, Any]] = {}          # outside layers: (y, saved, k)
    kept_at = (lambda _: None) if kept is None else kept.reader()

    def run(c, full, layer):
        if kept is not None and isinstance(layer, int) and layer in kept.outside_layers:
            return step(c, full, per_layer.at(_index_after(layer, c)), kept_at(layer))
        index = _index_after(layer, c)           # read when the layer runs, not before
        return step(c, full, per_layer.at(index), kept_at(index))

    full = saved = None
    if prefetch:
        full, saved = gather(gins.at(order[0]), carry)
    for p, layer in enumerate(head):
        if prefetch:                             # next gather issued before this compute
            upcoming = gather(gins.at(order[p + 1]), carry) if p + 1 < len(order) else None
        else:
            full, saved = gather(gins.at(layer), carry)
        carry, y, k = run(carry, full, layer)
        results[layer] = (y, saved, k)
        if prefetch and upcoming is not None:
            full, saved = upcoming

    stacked = (None, None, None)
    if scanned:
        carry, full, saved, stacked = _scan(run, gather, gins, carry, full, saved,
                                            scanned, reverse, prefetch)
    for layer in tail:
        if not prefetch:
            full, saved = gather(gins.at(layer), carry)
        carry, y, k = run(carry, full, layer)
        results[layer] = (y, saved, k)

    first = min(scanned) if scanned else num_layers
    lower = sorted(layer for layer in results if layer < first)
    upper = sorted(layer for layer in results if layer >= first)
    ys, saveds = (_join([results[i][j] for i in lower], stacked[j], [results[i][j] for i in upper],
                        bool(scanned)) for j in (0, 1))
    outside = tuple(sorted(results))
    return carry, (ys, saveds), Peeled(stacked[2], tuple(results[i][2] for i in outside),
                                       first if scanned else 0, outside)


def _scan(run: Callable, gather: Callable, gins: _Stacked, carry: Any, full: Any, saved: Any,
          layers: tuple[int, ...], reverse: bool, prefetch: bool) -> tuple[Any, Any, Any, Any]:
    """The scan over `layers` (consecutive, in the order computed): `(carry, full, saved,
    (ys, saveds, ks))`, the last three stacked in layer order; with `prefetch` `full, saved`
    are the gather of the layer after the last."""
    direction = -1 if reverse else 1
    index = jnp.arange(min(layers), max(layers) + 1, dtype=jnp.int32)

    def body(state, i):
        c, full, saved = state
        if prefetch:
            upcoming = gather(gins.at(i + direction), c)     # prefetch the next layer
        else:
            full, saved = gather(gins.at(i), c)
        c, y, k = run(c, full, i)
        if prefetch:
            return (c, *upcoming), (y, saved, k)
        return (c, None, None), (y, saved, k)

    init = (carry, full, saved) if prefetch else (carry, None, None)
    (carry, full, saved), stacked = lax.scan(body, init, index, reverse=reverse)
    return carry, full, saved, stacked
