"""The batch-invariant mode's Mixture-of-Experts MLP (`LlamaConfig.batch_invariant` on an MoE
Llama, `models.moe.MoeMLP`): the router, the softmax, the k routing weights, the experts and
the combine of their outputs with every sum in a fixed order (`models.invariant`), so a token
is routed to the same experts with the same weights, and gets the same output bits, whether it
is computed among the training forward's [B, T] rows or alone in a decode step. With it a
rollout and the training forward cannot disagree on routing at tp 1, replay or not.

Why each piece is so:
- router logits h @ router: `invariant.matmul` (a dot's order depends on the row count);
- softmax over E and the renormalisation over k: the row maximum as a chain of elementwise
  maxima (after a reduce, XLA:CPU's exp rounds by the row count: `invariant.max_last`), then the
  sum of exp in index order (`invariant.sum_last`); `lax.top_k` compares and moves values;
- experts: every expert's SwiGLU on every token, each projection an ordered sum over its
  contracted dim, then each token's k chosen outputs taken (dense over the experts: E / k
  times the grouped matmul's work, no [N, k, D, F] copy of weights; the grouped matmul's tiles
  and `ragged_dot` sum in an order the group sizes pick);
- combine: ((0 + w_0 y_0) + w_1 y_1 ...) + g s (the shared expert's gated output last), one
  ordered sum of exact products, so no fused multiply-add rounds one term differently.
Expert parallelism is refused by name: its outputs are summed over devices.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from . import invariant


def softmax(logits: jax.Array) -> jax.Array:
    """softmax over the last dim of logits [..., E]: the row maximum as elementwise maxima
    (`invariant.max_last`), the sum of exp in index order."""
    exp = jnp.exp(logits - jax.lax.stop_gradient(invariant.max_last(logits))[..., None])
    return exp / invariant.sum_last(exp)[..., None]


def renormalized(weights: jax.Array) -> jax.Array:
    """weights [N, k] / their sum over k, the sum in slot order."""
    return weights / invariant.sum_last(weights)[..., None]


def route(h: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`moe.route`'s contract (h [N, D], router [D, E] -> weights float32 [N, k], experts int32
    [N, k], probabilities float32 [N, E]) with every sum ordered."""
    logits = invariant.matmul(h, router)                                      # [N, E]
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    probs = softmax(logits)
    weights, experts = jax.lax.top_k(probs, top_k)                            # [N, k]
    if norm_topk_prob:
        weights = renormalized(weights)
    return weights, experts.astype(jnp.int32), probs


def replayed_weights(probs: jax.Array, chosen: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """`moe.replayed_weights`' contract (the probabilities [N, E] at `chosen` int32 [N, k],
    renormalised when `norm_topk_prob`), the renormalisation's sum ordered."""
    weights = jnp.take_along_axis(probs, chosen, axis=-1)                    # [N, k]
    return renormalized(weights) if norm_topk_prob else weights


def expert_outputs(x_ND: jax.Array, chosen_NK: jax.Array, w_gate_EDF: jax.Array,
                   w_up_EDF: jax.Array, w_down_EFD: jax.Array,
                   activation: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Each token's k chosen experts' outputs [N, k, D]: down_e(activation(gate_e x, up_e x))
    for e = chosen[n, j], float32, every expert computed on every token."""
    gate_NEF = invariant.einsum("ND,DEF->NEF", x_ND, jnp.moveaxis(w_gate_EDF, 1, 0))
    up_NEF = invariant.einsum("ND,DEF->NEF", x_ND, jnp.moveaxis(w_up_EDF, 1, 0))
    inner_FNE1 = jnp.moveaxis(activation(gate_NEF, up_NEF), -1, 0)[..., None]
    n, e, d = x_ND.shape[0], w_down_EFD.shape[0], w_down_EFD.shape[-1]
    out_NED = invariant.ordered_sum(jnp.zeros((n, e, d), inner_FNE1.dtype), inner_FNE1,
                                    jnp.moveaxis(w_down_EFD, 1, 0)[:, None].astype(jnp.float32))
    return jnp.take_along_axis(out_NED, chosen_NK[..., None], axis=1)        # [N, k, D]


def combine(y_NKD: jax.Array, weights_NK: jax.Array) -> jax.Array:
    """sum_j weights[n, j] y[n, j] -> [N, D] (float32), the terms added in slot order."""
    y_KND = jnp.moveaxis(y_NKD.astype(jnp.float32), 1, 0)
    w_KN1 = jnp.moveaxis(weights_NK.astype(jnp.float32), 1, 0)[..., None]
    return invariant.ordered_sum(jnp.zeros(y_KND.shape[1:], jnp.float32), y_KND, w_KN1)


def shared_expert(x_ND: jax.Array, gate_D: jax.Array, w_gate_DS: jax.Array,
                  w_up_DS: jax.Array, w_down_SD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qwen2-MoE's shared SwiGLU expert of x [N, D]: (its output [N, D], its sigmoid gate
    [N]), each projection summed in order; the caller adds gate x output as `combine`'s last
    term."""
    gate_N = jax.nn.sigmoid(invariant.matmul(x_ND, gate_D[:, None])[:, 0])
    inner_NS = (jax.nn.silu(invariant.matmul(x_ND, w_gate_DS))
                * invariant.matmul(x_ND, w_up_DS))
    return invariant.matmul(inner_NS, w_down_SD), gate_N


def check_unsplit(experts) -> None:
    """ValueError naming batch_invariant unless the layer holds every expert (`experts` None or
    an `ExpertParallel` of one device): expert parallelism sums a token's outputs over devices."""
    if experts is not None and experts.size > 1:
        raise ValueError(f"batch_invariant=True with expert parallelism (experts={experts!r}): "
                         "a token's expert outputs are summed over the expert devices; "
                         "accepted: batch_invariant=False, or a mesh without an expert axis")


__all__ = ["check_unsplit", "combine", "expert_outputs", "renormalized", "replayed_weights",
           "route", "shared_expert", "softmax"]
