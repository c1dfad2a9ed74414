"""The Mixture-of-Experts MLP: a float32 top-k router, dropless SwiGLU experts
(`grouped_matmul`), an optional shared expert (Qwen2-MoE), and the router statistics the
auxiliary load-balancing loss is made of.

Routing as transformers 5.23 computes it (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`,
`OlmoeTopKRouter`, `Qwen2MoeTopKRouter`): probabilities = softmax(h @ router) in float32, the
k largest (`lax.top_k`: equal probabilities go to the lower expert index), renormalised to sum 1
when `norm_topk_prob`. A token's output is the routing-weighted sum of its k experts' outputs.

The auxiliary loss (Switch Transformer eqs. 4-6, transformers' `load_balancing_loss_func`) is
E x sum_e f_e P_e over every layer's rows at once: f_e = top-k assignments to e / rows, P_e = the
mean probability of e. Both are sums over tokens, so each layer adds its `RouterStats` (counts,
probability sums, rows) to the ones the stack carries (`Routed`), and `aux_loss` forms the
product once at the end; the training step sums the statistics over the data devices first
(one device's loss over the same tokens, whatever the split; per micro-batch under gradient
accumulation: `zeroxla.engine.router_aux`).

Under expert parallelism the layer holds E / EP of the experts and is told so by its call's
`experts` argument (an `ExpertParallel`, threaded from the model's forward through the stack as
`sequence=` is); a layer holding fewer than E experts called without it is refused by name
(`check_expert_split`), never run on a slice of its experts as if it were all of them.

Routing replay (R3, "rollout routing replay"): called with `replay`, a recorded selection int32
[B, T, k] (a rollout engine's, so that training routes each token as the rollout did), the layer
sends each token to the recorded experts and weighs them by the live router's probabilities at
those experts, softmax(h @ router) gathered there (renormalised when `norm_topk_prob`, as
`route` does for its own choice): the router keeps its gradient, the selection is fixed. A
token whose record is negative (-1 in its first slot: none recorded) routes live. The auxiliary
loss's statistics stay the live router's (its probabilities and its own top-k counts), as
Megatron-LM's router computes them under `moe_enable_routing_replay`
(`compute_routing_scores_for_aux_loss` takes its own top-k of the live scores; only the
dispatch is replayed). `replay_mismatches` counts the tokens whose live choice differs from
the record.

Built with `invariant=True` (an MoE Llama's `batch_invariant`), the layer routes, computes its
experts and combines their outputs with every sum in a fixed order (`models.invariant_moe`):
a token's routing and output bits do not depend on how many tokens are computed with it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes, invariant_moe
from .expert_parallel import ExpertParallel, expert_parallel_ffn
from .grouped_matmul import ExpertBiases, expert_ffn, swiglu
from .layers import normal, param


class RouterStats(NamedTuple):
    """Router statistics summed over tokens (and layers), in the router's dtype (float32, or
    float64 in a float64 run): counts [E] (top-k assignments per expert), prob_sum [E] (router
    probabilities per expert), rows [] (tokens routed, once per layer)."""

    counts: jax.Array
    prob_sum: jax.Array
    rows: jax.Array

    @classmethod
    def zeros(cls, num_experts: int, dtype=jnp.float32) -> "RouterStats":
        """No tokens yet, in `dtype` (float32, float64 in a float64 run)."""
        return cls(jnp.zeros(num_experts, dtype), jnp.zeros(num_experts, dtype),
                   jnp.zeros((), dtype))

    def __add__(self, other: "RouterStats") -> "RouterStats":       # type: ignore[override]
        return RouterStats(*(a + b for a, b in zip(self, other)))


class Routed(NamedTuple):
    """What a stack of MoE blocks carries in training: the hidden states [B, T, D] and the
    router statistics of the layers so far."""

    hidden: jax.Array
    stats: RouterStats


def aux_loss(stats: RouterStats) -> jax.Array:
    """transformers' `load_balancing_loss_func` of the statistics: E x sum_e (counts_e / rows) x
    (prob_sum_e / rows) (0 when no row was routed)."""
    rows = jnp.maximum(stats.rows, 1e-9)
    return stats.counts.shape[0] * jnp.sum((stats.counts / rows) * (stats.prob_sum / rows))


def replayed_weights(probs: jax.Array, chosen: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """The routing weights [N, k] of the experts `chosen` int32 [N, k] under the router's
    `probs` [N, E]: the probabilities at those experts, renormalised to sum 1 when
    `norm_topk_prob`. For the router's own top-k, `route`'s weights bit for bit."""
    weights = jnp.take_along_axis(probs, chosen, axis=-1)                    # [N, k]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights


def replay_mismatches(live: jax.Array, replay: jax.Array, mask: jax.Array | None) -> jax.Array:
    """int32 [B, T]: 1 where a token with a record (`replay` int32 [B, T, k], first slot >= 0)
    that `mask` [B, T] keeps (None: all) has a live choice `live` int32 [B, T, k] that is not
    the recorded set of experts (the order within the k is not compared), else 0."""
    differ = jnp.any(jnp.sort(live, axis=-1) != jnp.sort(replay, axis=-1), axis=-1)
    differ &= replay[..., 0] >= 0
    if mask is not None:
        differ &= mask.astype(bool)
    return differ.astype(jnp.int32)


def route(h: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [N, D], router [D, E] (and its `bias` [E], gpt-oss') -> (weights float32 [N, k],
    experts int32 [N, k], probabilities float32 [N, E]); float32 whatever h's dtype (a float64
    run stays float64). gpt-oss' softmax over the k largest logits is this with
    `norm_topk_prob`: the k probabilities renormalised."""
    dtype = jnp.promote_types(h.dtype, jnp.float32)
    logits = jnp.dot(h.astype(dtype), router.astype(dtype))                  # [N, E]
    if bias is not None:
        logits = logits + bias.astype(dtype)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)                            # [N, k]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


class MoeMLP(nnx.Module):
    """E SwiGLU experts behind a top-k router, plus a sigmoid-gated shared SwiGLU expert when
    `shared_expert_mlp_dim` > 0 (Qwen2-MoE). Parameters: router [D, E] (its E named `router`:
    whole on every device, which routes over all experts); w_gate / w_up
    [E, D, F], w_down [E, F, D] (F = expert_mlp_dim; named `experts`, `expert_mlp`: tensor-
    parallel generation leaves them whole); shared_gate / shared_up [D, S], shared_down [S, D],
    shared_expert_gate [D]. `invariant` (static): the batch-invariant mode's sums
    (`models.invariant_moe`)."""

    def __init__(self, cfg, rngs: nnx.Rngs, *, invariant: bool = False):
        d, e, f, s = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim, cfg.shared_expert_mlp_dim
        init = normal(cfg.init_std)
        self.top_k, self.norm_topk_prob = cfg.experts_per_token, cfg.norm_topk_prob   # static
        self.invariant = invariant                                            # static
        self.tile, self.implementation = cfg.expert_tile, cfg.expert_implementation
        self.router = param(rngs, init, (d, e), (axes.EMBED, axes.ROUTER))
        self.w_gate = param(rngs, init, (e, d, f), (axes.EXPERTS, axes.EMBED, axes.EXPERT_MLP))
        self.w_up = param(rngs, init, (e, d, f), (axes.EXPERTS, axes.EMBED, axes.EXPERT_MLP))
        self.w_down = param(rngs, init, (e, f, d), (axes.EXPERTS, axes.EXPERT_MLP, axes.EMBED))
        if s:
            self.shared_gate = param(rngs, init, (d, s), (axes.EMBED, axes.MLP))
            self.shared_up = param(rngs, init, (d, s), (axes.EMBED, axes.MLP))
            self.shared_down = param(rngs, init, (s, d), (axes.MLP, axes.EMBED))
            self.shared_expert_gate = param(rngs, init, (d,), (axes.EMBED,))

    def __call__(self, h: jax.Array, mask: jax.Array | None = None,
                 experts: ExpertParallel | None = None, replay: jax.Array | None = None
                 ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """h [B, T, D] -> (output [B, T, D], this layer's `RouterStats` over the tokens `mask`
        [B, T] (1: a real token; None: all) keeps, the experts the live router chooses int32
        [B, T, k]). `experts`: the expert axis this layer's E / EP experts are split over
        (inside `shard_map`, `models.expert_parallel`); None: it holds all E. `replay`: a
        recorded selection int32 [B, T, k] the tokens are sent to instead (module docstring:
        the weights from the live router, the statistics the live choice's)."""
        b, t, d = h.shape
        x = h.reshape(b * t, d)                                               # [N, D]
        # the batch-invariant mode's router sums in a fixed order (`models.invariant_moe`)
        route_fn, weights_fn = ((invariant_moe.route, invariant_moe.replayed_weights)
                                if self.invariant else (route, replayed_weights))
        weights, chosen, probs = route_fn(x, self.router[...], self.top_k, self.norm_topk_prob,
                                          self.router_bias())
        used = chosen
        if replay is not None:
            record = replay.reshape(b * t, self.top_k).astype(jnp.int32)     # [N, k]
            used = jnp.where(record[:, :1] >= 0, record, chosen)
            weights = weights_fn(probs, used, self.norm_topk_prob)
        if self.invariant:
            out = self._invariant_mix(x, used, weights, experts).astype(h.dtype)   # [N, D]
        else:
            out = self._experts(x, used, weights.astype(h.dtype), experts)   # [N, D]
            if getattr(self, "shared_gate", None) is not None:
                gate = jax.nn.sigmoid(x @ self.shared_expert_gate[...].astype(h.dtype))  # [N]
                inner = jax.nn.silu(x @ self.shared_gate[...]) * (x @ self.shared_up[...])
                out = out + gate[:, None] * (inner @ self.shared_down[...])
        m = jnp.ones((b * t,), probs.dtype) if mask is None else mask.reshape(b * t)
        m = jax.lax.stop_gradient(m.astype(probs.dtype))
        counts = jnp.zeros(probs.shape[1], probs.dtype).at[chosen.reshape(-1)].add(
            jnp.repeat(m, self.top_k))
        stats = RouterStats(counts, jnp.sum(probs * m[:, None], axis=0), jnp.sum(m))
        return out.reshape(b, t, d), stats, chosen.reshape(b, t, self.top_k)

    def _invariant_mix(self, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                       experts: ExpertParallel | None) -> jax.Array:
        """The batch-invariant mode's output float32 [N, D] of x [N, D]: each token's k
        `chosen` [N, k] experts weighed by `weights` [N, k], then the gated shared expert's
        output when there is one, added in that order (`models.invariant_moe`)."""
        invariant_moe.check_unsplit(experts)
        if self.expert_biases(jnp.float32) is not None:
            raise ValueError(f"batch_invariant=True with expert biases ({type(self).__name__}):"
                             " not built; accepted: batch_invariant=False")
        w = [getattr(self, name)[...] for name in ("w_gate", "w_up", "w_down")]
        y = invariant_moe.expert_outputs(x, chosen, *w, self.activation)      # [N, k, D]
        if getattr(self, "shared_gate", None) is not None:
            shared, gate = invariant_moe.shared_expert(
                x, *(getattr(self, n)[...] for n in ("shared_expert_gate", "shared_gate",
                                                     "shared_up", "shared_down")))
            y = jnp.concatenate([y, shared[:, None]], axis=1)                 # [N, k + 1, D]
            weights = jnp.concatenate([weights, gate[:, None]], axis=1)
        return invariant_moe.combine(y, weights)

    def router_bias(self) -> jax.Array | None:
        """The router's bias [E]: none here (gpt-oss' router has one, `models.gpt_oss`)."""
        return None

    def expert_biases(self, dtype) -> ExpertBiases | None:
        """The experts' projection biases in `dtype`: none here (gpt-oss' experts have them)."""
        return None

    def activation(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The experts' inner activation of the gate and up projections [.., F]: SwiGLU."""
        return swiglu(gate, up)

    def _experts(self, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                 experts: ExpertParallel | None) -> jax.Array:
        """x [N, D], chosen [N, k], weights [N, k] -> the weighted sum of each token's k
        experts [N, D]: all E here, or E / EP here and the rest on the expert axis."""
        w = [getattr(self, name)[...].astype(x.dtype) for name in ("w_gate", "w_up", "w_down")]
        check_expert_split(w[0].shape[0], self.router[...].shape[-1], experts)
        options = dict(tile=self.tile, implementation=self.implementation,
                       biases=self.expert_biases(x.dtype), activation=self.activation)
        if experts is not None:
            return expert_parallel_ffn(x, chosen, weights, *w, experts, **options)
        y, _, _ = expert_ffn(x, chosen, *w, **options)                        # [N, k, D]
        return jnp.sum(y * weights[..., None], axis=1)


def check_expert_split(held: int, routed: int, experts: ExpertParallel | None) -> None:
    """ValueError unless a layer holding `held` experts of the `routed` its router chooses
    from was told how they are split: all of them with `experts` None, routed / EP of them
    with `experts` an `ExpertParallel` of EP devices. A layer called without the argument
    under a mesh that split its experts would otherwise compute with a slice of its experts
    as if it were all of them (and route tokens to experts it does not hold)."""
    ep = 1 if experts is None else experts.size
    if held * ep != routed:
        raise ValueError(
            f"MoeMLP holds {held} of the {routed} experts its router chooses from, called with "
            f"experts={experts!r}: {held} x {ep} != {routed}. Accepted: experts=None when the "
            f"layer holds all {routed}, or experts=ExpertParallel(axis, EP) with {held} x EP = "
            f"{routed} (the ZeRO step passes it to the model as `experts=`, beside "
            "`sequence=`, under a mesh with an expert axis)")
