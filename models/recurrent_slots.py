"""Per-sequence recurrent state under continuous batching: the slots a recurrent layer (Gated
DeltaNet's conv window and [H, K, V] state) keeps beside a paged KV cache
(`paged_attention.PagedKV.recurrent`).

A continuous-batching step feeds N token places per data group, decode tokens and prompt chunks
of many sequences mixed (`paged_attention`'s module docstring). A KV cache is indexed by
position, so the places may come in any order; a recurrent state is not: each sequence's
tokens must pass through its state one after the other, in position order. So the state of
every sequence lives in a slot of a pool, and the step says for each place which slot it
feeds and in which order the places run:

    RecurrentSlots(pools, slots, order)
        pools  {entry: [L, D, S + 1, ...]}   the model's state entries (its `init_cache`'s
                                             beyond "k" / "v", the row dim now D groups x S + 1
                                             slots); slot S is the null slot, which the step's
                                             filler places read and write and nothing else reads
        slots  int32 [D, N]                  each place's slot (S for a filler)
        order  int32 [D, N]                  the places in feed order: each sequence's places in
                                             position order (a permutation of 0..N-1)

A place at position 0 starts its sequence: the slot's state is reset there (a slot freed by a
finished or preempted sequence and taken by another holds the old one's state until then).

`scan_places` runs a layer's one-token step over the places: a `lax.scan` over the N places in
`order`, each gathering its slot's state, stepping it and scattering it back. It is exact and
simple, and costs N sequential one-token steps per layer per engine step (the recurrent form's
flops, O(N H K V), but no parallelism across a prompt chunk's tokens: a long prefill chunk is
as slow as decoding its tokens one by one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RecurrentSlots:
    """The slot pools of a recurrent model and the step's place-to-slot map (module
    docstring): pools {entry: [L, D, S + 1, ...]}, slots and order int32 [D, N]."""

    pools: dict[str, jax.Array]
    slots: jax.Array
    order: jax.Array

    def read(self, layer: jax.Array | int) -> dict[str, jax.Array]:
        """Block `layer`'s entries, each [D, S + 1, ...]."""
        return {name: pool[layer] for name, pool in self.pools.items()}

    def write(self, layer: jax.Array | int, states: dict[str, jax.Array]) -> "RecurrentSlots":
        """These slots with block `layer`'s entries replaced by `states` ([D, S + 1, ...])."""
        return self.replace(pools={name: pool.at[layer].set(states[name].astype(pool.dtype))
                                   for name, pool in self.pools.items()})


def scan_places(step: Callable[[Any, Any], tuple[Any, Any]], states: Any, inputs: Any,
                positions: jax.Array, slots: jax.Array, order: jax.Array) -> tuple[Any, Any]:
    """Each group's N places through `step(state, x) -> (state, y)` in `order`, each place
    against its slot's state (reset to zeros at position 0).

    states: a pytree of [D, S + 1, ...] (one layer's slots); inputs: a pytree of [D, N, ...]
    (each place's x); positions, slots, order int32 [D, N] (`RecurrentSlots`). Returns
    (states after the step, outputs: a pytree of [D, N, ...], place p's y at p)."""

    def group(states_S, inputs_N, positions_N, slots_N, order_N):
        def place(states_S, p):
            slot = slots_N[p]
            fresh = positions_N[p] == 0
            state = jax.tree.map(lambda pool: jnp.where(fresh, jnp.zeros_like(pool[slot]),
                                                        pool[slot]), states_S)
            state, y = step(state, jax.tree.map(lambda x: x[p], inputs_N))
            states_S = jax.tree.map(lambda pool, new: pool.at[slot].set(new.astype(pool.dtype)),
                                    states_S, state)
            return states_S, y

        states_S, fed = jax.lax.scan(place, states_S, order_N)     # fed[i]: place order[i]'s
        return states_S, jax.tree.map(lambda y: jnp.zeros_like(y).at[order_N].set(y), fed)

    return jax.vmap(group)(states, inputs, positions, slots, order)


__all__ = ["RecurrentSlots", "scan_places"]
