"""Bytes a step keeps in host memory between its forward and backward (remat "offload").

Under `ZeroConfig.remat="offload"` (`zeroxla.engine.remat`) each gathered unit's inputs are
moved to the `pinned_host` memory kind after forward and back before its backward. In the
traced program they are values typed for host memory (`jax.memory.Space.Host`): per layer a
`device_put` inside the forward layer loop, stacked over the layers by the loop (`scan`) into
one host-typed array `[L, B, T, D]` (a 16-bit one as its uint16 bits, `remat._from_bits`);
the loss's chunked head keeps its input, the final hidden states, there too. This module counts
those per device from the program's jaxpr, before any compile:

    host bytes = the host-typed results of `scan`s and `device_put`s outside any loop body,
                 inside the step's `shard_map` (local, per-device shapes)

A loop body's host values are counted through the loop's stacked result, not per iteration,
and host-typed views of a counted array (a `bitcast_convert_type` of the whole stack, a slice)
are not counted again. State the step keeps in host memory (ZeRO-Offload) is in its
arguments, counted from their shardings (`abstract_step.state_bytes`), not here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jex_core

# Primitives whose host-typed results are new host buffers (not views of one counted already).
_HOLDERS = frozenset({"scan", "device_put"})
# Primitives whose bodies run many times: their per-iteration values are not buffers of their own.
_LOOPS = frozenset({"scan", "while"})


def _is_host(aval: Any) -> bool:
    space = getattr(aval, "memory_space", None)
    return space is not None and "host" in str(space).lower()


def _bytes(aval: Any) -> int:
    return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize


def _sub_jaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _host_buffers(jaxpr: Any, inside_shard_map: bool) -> Iterator[tuple[str, int, int]]:
    """(primitive, bytes, bytes of one layer) of each host buffer: a scan's stack holds one
    layer's per row of its leading dim; a `device_put` outside loops holds one layer's (the
    last layer's, computed after the layer loop)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if inside_shard_map and name in _HOLDERS:
            for v in eqn.outvars:
                if _is_host(v.aval):
                    rows = v.aval.shape[0] if name == "scan" and v.aval.shape else 1
                    yield name, _bytes(v.aval), _bytes(v.aval) // max(rows, 1)
        if name in _LOOPS:
            continue
        for sub in _sub_jaxprs(eqn):
            yield from _host_buffers(sub, inside_shard_map or name == "shard_map")


def host_residual_bytes(traced: Any) -> int:
    """Per-device bytes of the host-typed buffers a traced step makes inside its `shard_map`
    (`traced`: a `jax.stages.Traced`, e.g. `jax.jit(step_fn).trace(state, batch)`)."""
    return sum(total for _, total, _ in _host_buffers(traced.jaxpr.jaxpr, False))


def host_residual_layer_bytes(traced: Any) -> int:
    """Per-device bytes of one unit's host residuals: what backward brings back to the device
    for the unit it differentiates (0 when nothing is in host memory): the largest row of a
    stack (a layer computed in a loop) or buffer put outside loops (the last layer; the loss's
    input). remat "offload" keeps one array per unit, its float input."""
    return max((layer for _, _, layer in _host_buffers(traced.jaxpr.jaxpr, False)), default=0)


__all__ = ["host_residual_bytes", "host_residual_layer_bytes"]
