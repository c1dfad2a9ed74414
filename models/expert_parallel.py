"""Expert parallelism for the Mixture-of-Experts MLP (`moe.MoeMLP`): each device of the mesh's
"expert" axis holds E / EP experts and runs them for the tokens of its whole expert group.

DeepSpeed-MoE dispatches with an all-to-all whose sizes follow the routing (or a capacity that
drops tokens). Here the dispatch is an all-gather and the combine a reduce-scatter (the
"ring of experts"), so every shape is static and every device runs the same collectives
whatever the routing, with nothing dropped:

    x [N, D], experts [N, k], weights [N, k]     this device's tokens, routed over all E
      --all-gather over "expert"-->  [EP, N, D], [EP, N, k], [EP, N, k]
    for each of the EP source devices' N tokens (`lax.map`, each chunk rematerialized):
      the E / EP local experts on the assignments that name them (`expert_ffn`'s tiles; the
      assignments to other devices' experts are one skipped group: they run nothing)
      y [N, D] = sum_k weight x expert output (zero where the expert is another device's)
    y [EP, N, D] --reduce-scatter (sum) over "expert"-->  [N, D]: every token's k experts

One chunk at a time, the tile buffers are those of N tokens, as without expert parallelism:
a static buffer for the group's EP N k assignments at once would cost EP times the activation
memory (dropless means a device's buffer must hold every assignment of its input, since all of
them may name its experts), and each chunk's backward recomputes its forward (`jax.checkpoint`)
so only one chunk's intermediates are ever live.

Each device's local experts see every token of the group that chose them, so the gradient of an
expert's weights on its device is the sum over the group's tokens; the engine then reduces it
over the expert-data group only (the data devices holding the same experts). Backward the
all-gather's transpose is a reduce-scatter and the reduce-scatter's an all-gather: the tokens'
gradients come home summed over the experts that used them.

Bytes per layer and device: the all-gather and the reduce-scatter each move (EP - 1) / EP of
EP x N x D activations, against an all-to-all's (EP - 1) / EP of N x k x D at perfect balance:
the static shapes cost EP / k times the all-to-all's bytes, and no capacity factor is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from .grouped_matmul import ExpertBiases, expert_ffn, swiglu


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The expert axis an MoE layer runs under: its mesh axis name and size EP. The ZeRO step
    passes it to the model's forward as `experts=`, beside `sequence=`, and the MoE family
    threads it through its stack to every MoE layer's call (`MoeMLP(h, mask, experts=...)`);
    None everywhere else: the layer then holds all E experts. A static pytree (no leaves), as
    `SequenceParallel` is: it travels through layer stacks, scans and custom VJPs with the
    other stack arguments."""

    axis: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"ExpertParallel.size={self.size!r}: a positive integer")


jax.tree_util.register_static(ExpertParallel)


def expert_parallel_ffn(x: jax.Array, experts: jax.Array, weights: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                        ep: ExpertParallel, *, tile: int, implementation: str,
                        biases: ExpertBiases | None = None,
                        activation: Callable[[jax.Array, jax.Array], jax.Array] = swiglu
                        ) -> jax.Array:
    """x [N, D], experts int [N, k] (global ids in [0, E)), weights [N, k], this device's
    experts w_gate / w_up [E / EP, D, F], w_down [E / EP, F, D] (and `biases`, this device's
    E / EP of them; `activation`: `grouped_matmul.expert_ffn`'s) -> the routed experts'
    weighted sum [N, D] for this device's tokens (module docstring). Runs inside `shard_map`
    over `ep.axis`."""
    local = w_gate.shape[0]                                                   # E / EP
    xs = lax.all_gather(x, ep.axis)                                           # [EP, N, D]
    es = lax.all_gather(experts, ep.axis)                                     # [EP, N, k]
    ws = lax.all_gather(weights, ep.axis)                                     # [EP, N, k]
    first = lax.axis_index(ep.axis) * local

    @jax.checkpoint
    def chunk(piece):
        xc, ec, wc = piece                                        # [N, D], [N, k], [N, k]
        ids = jnp.where((ec >= first) & (ec < first + local), ec - first, local)  # E/EP: skip
        y, _, _ = expert_ffn(xc, ids, w_gate, w_up, w_down, tile=tile,
                             implementation=implementation, skip_foreign=True,
                             biases=biases, activation=activation)             # [N, k, D]
        return jnp.sum(y * wc.astype(y.dtype)[..., None], axis=1)             # [N, D]

    out = lax.map(chunk, (xs, es, ws))                                        # [EP, N, D]
    return lax.psum_scatter(out, ep.axis, scatter_dimension=0)                # [N, D]
