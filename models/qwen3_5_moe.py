"""Qwen3.5 MoE (Qwen Team 2026; transformers 5.23 `models/qwen3_5_moe/`; Qwen3.5-35B-A3B,
Qwen3.6-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's stack (`models.qwen3_5`: periods of Gated
DeltaNet layers and one gated attention layer) with the MLP of every layer a Mixture-of-Experts
MLP (`models.moe.MoeMLP`).

The MoE is transformers' `Qwen3_5MoeSparseMoeBlock`: a float32 softmax router over
`num_experts`, the `num_experts_per_tok` largest renormalised to sum 1 (`Qwen3_5MoeTopKRouter`
always renormalises: the config has no norm_topk_prob), SwiGLU experts of
`moe_intermediate_size`, plus a shared SwiGLU expert of `shared_expert_intermediate_size`
behind a sigmoid gate (`shared_expert_gate`: Qwen2-MoE's). In training the stack carries
`moe.Routed` through every layer of every period, so `routed_token_logprobs` returns the router
statistics of all HF layers, which the step turns into the auxiliary load-balancing loss
(`router_aux_loss_coef`, added when `output_router_logits`: transformers' rule).

Expert parallelism: every forward over whole rows takes `experts=` (an `ExpertParallel`) beside
`sequence=` and each period hands it to its layers' MoE MLPs, as `models.moe_llama` does.
Generation decodes as the dense model's does (`Qwen3_5.init_cache` / `decode`: the periods'
`decode`, each layer's MLP its MoE's `feed_forward`). Routing records and replay are
`models.moe_llama`'s, over every HF layer (`moe_layers` = periods x `attention_interval`):
each `MoeLayer` ends in `moe_llama.moe_residual` on the full forward, the cached decode and
the continuous-batching step, so `router_choices`, `decode_choices` (a right-padded
prefill's `segment_ids` too) and `replayed_token_logprobs` read and write records
[.., L, k] as `MoeLlama`'s do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from .expert_parallel import ExpertParallel
from .grouped_matmul import TILE, check_expert_implementation
from .layers import at_least_float32, forward_stack, stack_args
from .moe import MoeMLP, Routed, RouterStats
from .moe_llama import Chosen, moe_residual, replayed_stack, token_mask
from .paged_attention import is_paged
from .qwen3_5 import Layer, Period, Qwen3_5, Qwen3_5Config, paged_refusal
from .recurrent_slots import RecurrentSlots
from .sequence_parallel import SequenceParallel


@dataclasses.dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """A Qwen3.5 config whose MLPs are Mixture-of-Experts layers (`num_layers` counts periods).

    num_experts            E experts per layer (`num_experts`)
    experts_per_token      k experts per token (`num_experts_per_tok`)
    expert_mlp_dim         an expert's inner size (`moe_intermediate_size`)
    shared_expert_mlp_dim  the shared expert's inner size (`shared_expert_intermediate_size`)
    router_aux_loss_coef   weight of the auxiliary load-balancing loss in the training loss
    output_router_logits   whether training adds it (transformers adds it only then)
    expert_tile            rows per tile of the grouped matmul (`models.grouped_matmul`)
    expert_implementation  "auto", "tiled" or "ragged_dot" (`grouped_matmul.expert_ffn`)
    mlp_dim                0: no layer has a dense MLP (not settable)
    """

    mlp_dim: int = dataclasses.field(default=0, init=False)
    num_experts: int = 8
    experts_per_token: int = 2
    expert_mlp_dim: int = 32
    shared_expert_mlp_dim: int = 48
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = True
    expert_tile: int = TILE
    expert_implementation: str = "auto"
    family: str = dataclasses.field(default="qwen3_5_moe", init=False)

    POSITIVE_FIELDS = tuple(f for f in Qwen3_5Config.POSITIVE_FIELDS if f != "mlp_dim") + (
        "num_experts", "experts_per_token", "expert_mlp_dim", "shared_expert_mlp_dim",
        "expert_tile")

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"{name}.experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}; accepted: 1..{self.num_experts}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"{name}.router_aux_loss_coef={self.router_aux_loss_coef!r} is "
                             "invalid; accepted: a number >= 0")
        check_expert_implementation(self.expert_implementation, f"{name}.expert_implementation")

    @property
    def moe_layers(self) -> int:
        """L, the MoE layers a routing record holds: every HF layer (`attention_interval` per
        period)."""
        return self.num_layers * self.attention_interval

    @property
    def norm_topk_prob(self) -> bool:
        """The k routing weights are renormalised to sum 1: always (`Qwen3_5MoeTopKRouter`)."""
        return True

    @property
    def aux_loss_weight(self) -> float:
        """What the training loss adds times the auxiliary loss: router_aux_loss_coef when
        output_router_logits (transformers' rule), else 0."""
        return float(self.router_aux_loss_coef) if self.output_router_logits else 0.0


class MoeLayer(Layer):
    """One decoder layer: x + mixer(norm(x)), then x + moe(norm(x)) (`models.moe.MoeMLP`, with
    its shared expert); carries plain hidden states, `Routed` (adding its statistics),
    `Replayed` / `Observed` (routing replay) or `Chosen` (recording its experts), on every
    path: the full forward, the cached decode and the continuous-batching step
    (`moe_llama.moe_residual`)."""

    def init_mlp(self, cfg: Qwen3_5MoeConfig, rngs: nnx.Rngs) -> None:
        self.moe = MoeMLP(cfg, rngs)

    def __call__(self, x, positions: jax.Array, segment_ids: jax.Array | None,
                 sequence: SequenceParallel | None, experts: ExpertParallel | None = None,
                 replay: jax.Array | None = None):
        """x [B, T, D] or a carry -> the same kind; the MoE runs over all the tokens at once,
        its statistics over the real ones (segment id > 0), its experts split over `experts`
        when given; `replay` int32 [L, B, T, k] with a `Replayed` carry."""
        h = x if isinstance(x, jax.Array) else x.hidden
        h = h + self.mixer(self.attn_norm(h), positions, segment_ids, sequence)
        return moe_residual(self.moe, self.mlp_norm, x, h, segment_ids, experts, replay)

    def decode(self, x, positions: jax.Array, segment_ids: jax.Array | None,
               cache: dict[str, jax.Array]):
        """`Layer.decode` of x [B, T, D] or `Chosen` -> (the same kind, cache)."""
        h = x if isinstance(x, jax.Array) else x.hidden
        a, cache = self.mixer.decode(self.attn_norm(h), positions, segment_ids, cache)
        return moe_residual(self.moe, self.mlp_norm, x, h + a, segment_ids), cache

    def decode_slots(self, x, positions: jax.Array, slots: RecurrentSlots,
                     states: dict[str, jax.Array]):
        """`Layer.decode_slots` of the step's places x [D, N, D] or `Chosen` -> (the same
        kind, states)."""
        h = x if isinstance(x, jax.Array) else x.hidden
        a, states = self.mixer.decode_slots(self.attn_norm(h), positions, slots, states)
        return moe_residual(self.moe, self.mlp_norm, x, h + a, None), states

    def feed_forward(self, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """The MoE's residual branch of x [B, T, D] -> [B, T, D] (all E experts held: decode)."""
        return self.moe(self.mlp_norm(x), token_mask(segment_ids))[0]


class MoePeriod(Period):
    """`Period` of `MoeLayer`s: the DeltaNet layers, then the attention layer, each handed
    `experts`."""

    LAYER = MoeLayer

    def __call__(self, x, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None, replay: jax.Array | None = None,
                 cache: dict | None = None):
        """x [B, T, D] or a carry (`MoeLayer`) -> (the same kind, None): a pair, since a carry
        is itself a tuple (`layers.call_block`); `replay` int32 [L, B, T, k] reaches every
        layer. With `cache`: (x, cache) (`Period.decode`, a `Chosen` carry passing through)."""
        if cache is not None:
            return self.decode(x, positions, segment_ids, cache)
        for layer in self.linear:
            x = layer(x, positions, segment_ids, sequence, experts, replay)
        return self.full(x, positions, segment_ids, sequence, experts, replay), None


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5 with MoE MLPs: every forward over whole rows takes `experts=` beside
    `sequence=`; `routed_token_logprobs` adds the router statistics of every layer."""

    PERIOD = MoePeriod

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None,
               experts: ExpertParallel | None = None) -> jax.Array:
        """The final hidden states [B, T, D] after the final norm, the experts split over
        `experts`."""
        return self.head.norm(forward_stack(self, tokens, positions, segment_ids, sequence,
                                            experts=experts))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None) -> jax.Array:
        """`Qwen3_5.__call__`'s logits float32 [B, T, V], the experts split over `experts`."""
        return self.logits(self.hidden(tokens, positions, segment_ids, sequence, experts))

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None,
                       experts: ExpertParallel | None = None) -> jax.Array:
        """`Qwen3_5.token_logprobs`' float32 [B, T], the experts split over `experts`."""
        h = self.hidden(tokens, positions, segment_ids, sequence, experts)          # [B, T, D]
        return self.head_logprobs(h, labels, vocab_limit)

    def routed_token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                              positions: jax.Array | None = None,
                              segment_ids: jax.Array | None = None,
                              vocab_limit: jax.Array | int | None = None,
                              sequence: SequenceParallel | None = None,
                              experts: ExpertParallel | None = None
                              ) -> tuple[jax.Array, RouterStats]:
        """(`token_logprobs(...)` float32 [B, T], the `RouterStats` of every HF layer over
        these tokens)."""
        e = self.config.num_experts
        out = forward_stack(self, tokens, positions, segment_ids, sequence, carry=lambda x: Routed(
            x, RouterStats.zeros(e, at_least_float32(x.dtype))), experts=experts)
        return self.head_logprobs(self.head.norm(out.hidden), labels, vocab_limit), out.stats

    def replayed_token_logprobs(self, tokens: jax.Array, labels: jax.Array, replay: jax.Array,
                                *, positions: jax.Array | None = None,
                                segment_ids: jax.Array | None = None,
                                vocab_limit: jax.Array | int | None = None,
                                sequence: SequenceParallel | None = None,
                                experts: ExpertParallel | None = None,
                                follow_record: bool = True
                                ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """`MoeLlama.replayed_token_logprobs`' contract: `replay` int32 [B, T, L, k] (L every
        HF layer, `moe_layers`) -> (log-probs float32 [B, T], the live router's statistics,
        per token the layers whose live choice is not the record int32 [B, T])."""
        out = replayed_stack(self, tokens, replay, self.config.moe_layers, positions=positions,
                             segment_ids=segment_ids, sequence=sequence, experts=experts,
                             follow_record=follow_record)
        logprobs = self.head_logprobs(self.head.norm(out.hidden), labels, vocab_limit)
        return logprobs, out.stats, out.mismatches

    def router_choices(self, tokens: jax.Array, positions: jax.Array | None = None,
                       cache: dict | None = None) -> tuple[jax.Array, dict | None]:
        """(the experts every HF layer routes each token to, int32 [L, B, T, k], the cache): a
        full forward, or with `cache` the cached decode (`decode`'s path)."""
        _, experts, cache = self._chosen_forward(tokens, positions, cache)
        return experts, cache

    def decode_choices(self, tokens: jax.Array, positions: jax.Array, cache: dict,
                       segment_ids: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array, dict]:
        """`decode`'s (logits float32 [B, T, V], cache) with the experts every HF layer routed
        each token to, int32 [L, B, T, k], between them: what a rollout records for routing
        replay (`zeroxla.inference.decode`); `segment_ids` a right-padded prefill's pad mask."""
        hidden, experts, cache = self._chosen_forward(tokens, positions, cache, segment_ids)
        return self.logits(hidden), experts, cache

    def _chosen_forward(self, tokens: jax.Array, positions: jax.Array | None, cache: dict | None,
                        segment_ids: jax.Array | None = None):
        """(the normed final hidden states [B, T, D], the experts int32 [L, B, T, k], the
        cache) of the stack carrying `Chosen`."""
        c = self.config
        if is_paged(cache) and cache.recurrent is None:
            raise NotImplementedError(paged_refusal(c.family))
        args = stack_args(tokens, positions, segment_ids if cache is None else None)
        b, t = tokens.shape
        chosen = Chosen(self.embed(tokens, args[0]),
                        jnp.zeros((c.moe_layers, b, t, c.experts_per_token), jnp.int32),
                        jnp.int32(0))
        if cache is None:
            out, _ = self.blocks(chosen, *args)
        else:
            out, cache = self.blocks(chosen, args[0], segment_ids, cache=cache)
        return self.head.norm(out.hidden), out.experts, cache
