"""Dropless expert compute: a grouped matmul over tiles of expert-sorted tokens (Megablox,
Gale et al. 2023), only the tiles that hold tokens run.

A Mixture-of-Experts layer sends each of its A = N x k (token, expert) assignments to one
expert. Sorted by expert and each expert's group padded to a multiple of `tile` rows, the
assignments fill at most `max_tiles(A, E, tile)` = A // tile + min(E, A) tiles of one expert
each (`TilePlan`): a static bound, so every device compiles the same program whatever the
routing, while the tiles past `tiles_used` (known only at run time) are skipped by a
`lax.cond`. Executed FLOPs are `tiles_used` x tile FLOPs <= (A + E x (tile - 1)) rows: nothing
dropped, nothing multiplied by E, as `jax.lax.ragged_dot`'s CPU lowering (a masked dense product
over every group) does.

`grouped_matmul` is a `jax.custom_vjp`: forward and backward are each one scan over the tiles,
the weight gradient accumulated in place per expert (autodiff of a dynamic slice would add a
whole [E, D, F] zero array per tile). `expert_matmul` picks it or `ragged_dot` per platform,
as the attention does (`EXPERT_IMPLEMENTATIONS`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .layers import at_least_float32

TILE = 64                    # rows per tile of sorted tokens
# "auto": ragged_dot where the platform lowers it natively (TPU's Megablox kernel), the tiled
# scan elsewhere (XLA:CPU expands ragged_dot to a dense product over every expert).
EXPERT_IMPLEMENTATIONS = ("auto", "tiled", "ragged_dot")
NATIVE_RAGGED_DOT = ("tpu",)


def check_expert_implementation(name: str, what: str) -> None:
    """ValueError naming `what` (e.g. "Qwen3MoeConfig.expert_implementation") unless `name` is
    one of EXPERT_IMPLEMENTATIONS."""
    if name not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(f"{what}={name!r} is not built; accepted: "
                         f"{', '.join(EXPERT_IMPLEMENTATIONS)}")


def max_tiles(assignments: int, num_experts: int, tile: int) -> int:
    """The static tile count: groups padded to `tile` rows take at most
    A // tile + min(E, A) tiles (each non-empty group adds at most one partial tile)."""
    return assignments // tile + min(num_experts, assignments)


class TilePlan(NamedTuple):
    """Where the sorted assignments go.

    order        int32 [A]: assignment indices sorted by expert (stable: ties keep token order)
    rows         int32 [A]: the padded row of each sorted assignment, in [0, tiles * tile)
    tile_expert  int32 [tiles]: the expert of each tile (the last expert past `tiles_used`)
    tiles_used   int32 []: tiles holding at least one assignment
    group_sizes  int32 [E]: assignments per expert (the per-expert load)
    """

    order: jax.Array
    rows: jax.Array
    tile_expert: jax.Array
    tiles_used: jax.Array
    group_sizes: jax.Array


def plan_tiles(experts: jax.Array, num_experts: int, tile: int = TILE, *,
               skip_last: bool = False) -> TilePlan:
    """The tile plan of `experts` int [A] (each assignment's expert, in [0, E)). `skip_last`:
    expert E - 1 is a group that runs nothing (expert parallelism's assignments to another
    device's experts, `expert_parallel`): sorted last, its tiles are past `tiles_used`, and
    `tile_expert` stays below E - 1 (the weights hold E - 1 experts)."""
    a = experts.shape[0]
    sizes = jnp.zeros(num_experts, jnp.int32).at[experts].add(1)            # [E]
    tiles_per = -(-sizes // tile)                                             # [E]
    padded_start = (jnp.cumsum(tiles_per) - tiles_per) * tile                 # [E]
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)               # [A]
    sorted_experts = experts[order]
    group_start = jnp.cumsum(sizes) - sizes                                   # [E]
    rank = jnp.arange(a, dtype=jnp.int32) - group_start[sorted_experts]
    rows = padded_start[sorted_experts] + rank                                # [A]
    n_tiles = max_tiles(a, num_experts, tile)
    tile_end = jnp.cumsum(tiles_per)                                          # [E]
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right")
    real = num_experts - 1 if skip_last else num_experts
    used = tile_end[real - 1] if real > 0 else jnp.zeros((), tile_end.dtype)
    return TilePlan(order, rows.astype(jnp.int32),
                    jnp.minimum(tile_expert, max(real, 1) - 1).astype(jnp.int32),
                    used.astype(jnp.int32), sizes[:real])


def _tiles(x: jax.Array, tile: int) -> jax.Array:
    return x.reshape(x.shape[0] // tile, tile, *x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_matmul(x: jax.Array, w: jax.Array, tile_expert: jax.Array, tiles_used: jax.Array,
                   tile: int) -> jax.Array:
    """x [M, D] (M = tiles x tile rows, tile i all of expert tile_expert[i]) @ w [E, D, F] ->
    [M, F]; tiles from `tiles_used` on are zeros and cost nothing."""
    return _forward(x, w, tile_expert, tiles_used, tile)


def _forward(x, w, tile_expert, tiles_used, tile):
    acc = at_least_float32(x.dtype)        # float32, float64 in a float64 run (never rounded)

    def body(_, piece):
        i, xt, e = piece

        def run():
            return jnp.dot(xt, w[e], preferred_element_type=acc).astype(x.dtype)

        return None, lax.cond(i < tiles_used, run, lambda: jnp.zeros((tile, w.shape[2]),
                                                                     x.dtype))

    n = x.shape[0] // tile
    _, out = lax.scan(body, None, (jnp.arange(n), _tiles(x, tile), tile_expert))
    return out.reshape(x.shape[0], w.shape[2])                                 # [M, F]


def _fwd(x, w, tile_expert, tiles_used, tile):
    return _forward(x, w, tile_expert, tiles_used, tile), (x, w, tile_expert, tiles_used)


def _bwd(tile, residuals, dy):
    x, w, tile_expert, tiles_used = residuals
    n = x.shape[0] // tile
    acc = at_least_float32(x.dtype)        # float32, float64 in a float64 run (never rounded)

    def body(dw, piece):
        i, xt, dyt, e = piece

        def run(dw):
            we = lax.dynamic_index_in_dim(w, e, 0, keepdims=False)            # [D, F]
            dx = jnp.dot(dyt, we.T, preferred_element_type=acc).astype(x.dtype)
            g = lax.dynamic_index_in_dim(dw, e, 0, keepdims=False)
            g = g + jnp.dot(xt.T, dyt, preferred_element_type=acc)
            return lax.dynamic_update_index_in_dim(dw, g, e, 0), dx

        def skip(dw):
            return dw, jnp.zeros_like(xt)

        return lax.cond(i < tiles_used, run, skip, dw)

    dw0 = jnp.zeros(w.shape, acc)
    dw, dx = lax.scan(body, dw0, (jnp.arange(n), _tiles(x, tile), _tiles(dy, tile), tile_expert))
    return dx.reshape(x.shape), dw.astype(w.dtype), None, None


grouped_matmul.defvjp(_fwd, _bwd)


def resolve(implementation: str) -> str:
    """The expert implementation "auto" means on this platform ("tiled" or "ragged_dot")."""
    if implementation != "auto":
        return implementation
    return "ragged_dot" if jax.default_backend() in NATIVE_RAGGED_DOT else "tiled"


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's inner activation: silu(gate) * up (the MoE families' experts)."""
    return jax.nn.silu(gate) * up


class ExpertBiases(NamedTuple):
    """Per-expert biases of the three projections (gpt-oss' experts): gate and up [E, F],
    down [E, D]; under expert parallelism this device's E / EP of them."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


def expert_ffn(x: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array, *, tile: int = TILE, implementation: str = "auto",
               skip_foreign: bool = False, biases: ExpertBiases | None = None,
               activation: Callable[[jax.Array, jax.Array], jax.Array] = swiglu
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each assignment's gated expert: tokens x [N, D], experts int [N, k] (token n's k
    experts) -> (y [N, k, D], y[n, j] = down_e(activation(gate_e x_n, up_e x_n)) with e =
    experts[n, j]; group_sizes int [E]; tiles_used int []), weights w_gate / w_up [E, D, F],
    w_down [E, F, D]; `activation` SwiGLU's silu(gate) * up by default; `biases` (None: none)
    added to each projection's output. The sorted rows gather their tokens directly (no
    [N k, D] copy of the tokens first). "tiled" runs `grouped_matmul` over the padded sorted
    rows; "ragged_dot" runs `lax.ragged_dot` on the sorted rows (its tiles_used is what the
    tiled layout would run, for the FLOP count). `skip_foreign`: an expert id E (one past the
    weights' experts) marks an assignment to no expert here (another device's, under expert
    parallelism): its y is zero and it runs nothing."""
    num_experts, (n, k) = w_gate.shape[0], experts.shape
    plan = plan_tiles(experts.reshape(n * k), num_experts + skip_foreign, tile,
                      skip_last=skip_foreign)
    sorted_x = x[plan.order // k]                                             # [A, D]
    if resolve(implementation) == "ragged_dot":
        row_expert = experts.reshape(n * k)[plan.order]                      # [A]

        def mm(a, w, b=None):
            out = lax.ragged_dot(a, w, plan.group_sizes)
            return out if b is None else out + b.astype(out.dtype)[row_expert]
        y_sorted = _gated(mm, sorted_x, (w_gate, w_up, w_down), biases, activation)  # [A, D]
    else:
        m = plan.tile_expert.shape[0] * tile
        rows = jnp.zeros((m, x.shape[1]), x.dtype).at[plan.rows].set(sorted_x)  # [M, D]

        def mm(a, w, b=None):
            out = grouped_matmul(a, w, plan.tile_expert, plan.tiles_used, tile)
            # a tile's bias rows: its expert's, repeated (padding rows are never read back)
            return out if b is None else out + jnp.repeat(
                b.astype(out.dtype)[plan.tile_expert], tile, axis=0)
        y_sorted = _gated(mm, rows, (w_gate, w_up, w_down), biases, activation)[plan.rows]
    if biases is not None and skip_foreign:          # another device's assignments: no bias
        real = experts.reshape(n * k)[plan.order] < num_experts                # [A]
        y_sorted = jnp.where(real[:, None], y_sorted, 0)
    y = jnp.zeros_like(y_sorted).at[plan.order].set(y_sorted)                 # [A, D]
    return y.reshape(n, k, -1), plan.group_sizes, plan.tiles_used


def _gated(mm: Callable, rows: jax.Array, weights: tuple[jax.Array, jax.Array, jax.Array],
           biases: ExpertBiases | None, activation: Callable) -> jax.Array:
    """down(activation(gate(rows), up(rows))) through the grouped product `mm(a, w, bias)`:
    rows [R, D] -> [R, D]."""
    w_gate, w_up, w_down = weights
    b = (None, None, None) if biases is None else biases
    h = activation(mm(rows, w_gate, b[0]), mm(rows, w_up, b[1]))             # [R, F]
    return mm(h, w_down, b[2])
