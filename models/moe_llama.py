"""Llama with Mixture-of-Experts MLPs: the module of the MoE families (`models.families`:
Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE), each option a `MoeLlamaConfig` field.

Every layer is sparse (an MoE MLP, `models.moe`); the attention is Llama's with the family's
options (biases, per-head q/k norms, OLMoE's norms over the whole q and k projections, a
sliding window). In training the stack carries `moe.Routed` (hidden states and router
statistics) and `routed_token_logprobs` returns the statistics beside the log-probs, which the
step turns into the auxiliary loss; `replayed_token_logprobs` carries `Replayed` (routing
replay: every layer sends each token to a recorded selection, `models.moe`) and returns the
statistics and the per-token count of layers whose live choice differs from the record;
`router_choices` carries `Chosen` (the experts of each layer) through a full forward or the
KV-cached decode, and `decode_choices` returns them beside the decode's logits; inference
paths (`__call__`, `decode`) carry plain hidden states. `moe_residual` is a layer's MoE half
for every carry, shared with `models.qwen3_5_moe`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from . import axes, invariant
from .grouped_matmul import TILE, check_expert_implementation
from .layers import at_least_float32, forward_stack, stack_args
from .expert_parallel import ExpertParallel
from .llama import Block, Llama, LlamaConfig
from .moe import MoeMLP, Routed, RouterStats, replay_mismatches
from .sequence_parallel import SequenceParallel
from .tiled_mlp import tiled_map

QK_NORM_SCOPES = ("head", "projection")


@dataclasses.dataclass(frozen=True)
class MoeLlamaConfig(LlamaConfig):
    """A Llama config whose MLPs are Mixture-of-Experts layers.

    num_experts            E experts per layer (HF `num_experts`, Mixtral's `num_local_experts`)
    experts_per_token      k experts per token (`num_experts_per_tok`)
    expert_mlp_dim         an expert's inner size (`moe_intermediate_size`; Mixtral's and
                           OLMoE's `intermediate_size`)
    norm_topk_prob         renormalise the k routing weights to sum 1 (Mixtral: always)
    shared_expert_mlp_dim  a sigmoid-gated shared SwiGLU expert of this size, 0: none (Qwen2-MoE)
    router_aux_loss_coef   weight of the auxiliary load-balancing loss in the training loss
    output_router_logits   whether training adds it (transformers adds it only then)
    qk_norm_scope          "head" (Qwen3-MoE: RMSNorm per head) or "projection" (OLMoE: over the
                           whole q and k projections), when `qk_norm`
    expert_tile            rows per tile of the grouped matmul (`models.grouped_matmul`)
    expert_implementation  "auto", "tiled" or "ragged_dot" (`grouped_matmul.expert_ffn`)
    """

    num_experts: int = 8
    experts_per_token: int = 2
    expert_mlp_dim: int = 32
    norm_topk_prob: bool = True
    shared_expert_mlp_dim: int = 0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = True
    qk_norm_scope: str = "head"
    expert_tile: int = TILE
    expert_implementation: str = "auto"
    family: str = dataclasses.field(default="moe_llama", init=False)

    POSITIVE_FIELDS = LlamaConfig.POSITIVE_FIELDS + ("num_experts", "experts_per_token",
                                                     "expert_mlp_dim", "expert_tile")
    # A family with no dense MLP whose config.json has one intermediate_size, the experts'
    # (Mixtral, OLMoE): mlp_dim must equal expert_mlp_dim.
    ONE_INTERMEDIATE_SIZE: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.ONE_INTERMEDIATE_SIZE and self.mlp_dim != self.expert_mlp_dim:
            raise ValueError(f"{name}.mlp_dim={self.mlp_dim} != expert_mlp_dim="
                             f"{self.expert_mlp_dim}: the family has no dense MLP, and its "
                             "config.json's intermediate_size is the experts' size; accepted: "
                             "equal values")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"{name}.experts_per_token={self.experts_per_token} exceeds "
                             f"num_experts={self.num_experts}; accepted: 1..{self.num_experts}")
        if not isinstance(self.shared_expert_mlp_dim, int) or self.shared_expert_mlp_dim < 0:
            raise ValueError(f"{name}.shared_expert_mlp_dim={self.shared_expert_mlp_dim!r} is "
                             "invalid; accepted: 0 (none) or an integer >= 1")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"{name}.router_aux_loss_coef={self.router_aux_loss_coef!r} is "
                             "invalid; accepted: a number >= 0")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"{name}.qk_norm_scope={self.qk_norm_scope!r} is invalid; "
                             f"accepted: {', '.join(QK_NORM_SCOPES)}")
        check_expert_implementation(self.expert_implementation, f"{name}.expert_implementation")

    @property
    def moe_layers(self) -> int:
        """L, the MoE layers a routing record indexes ([B, T, L, k]): one per block of the
        stack here (gpt-oss, whose block is a pair of layers: two)."""
        return self.num_layers

    @property
    def aux_loss_weight(self) -> float:
        """What the training loss adds times the auxiliary loss: router_aux_loss_coef when
        output_router_logits (transformers' rule), else 0."""
        return float(self.router_aux_loss_coef) if self.output_router_logits else 0.0


class ProjectionRMSNorm(nnx.Module):
    """RMSNorm over a whole projection [.., H, K] at once (OLMoE's q_norm / k_norm over
    hidden_size), its scale [H, K]; float32 (float64 for float64 input). `invariant`: the
    batch-invariant mode's ordered sum of squares."""

    def __init__(self, heads: int, head_dim: int, *, eps: float, head_axis: str,
                 invariant: bool = False):
        self.eps, self.invariant = eps, invariant                              # static
        self.scale = nnx.Param(jnp.ones((heads, head_dim), jnp.float32),
                               logical_axes=(head_axis, axes.HEAD_DIM))

    def __call__(self, x: jax.Array) -> jax.Array:
        acc = at_least_float32(x.dtype)
        h = x.astype(acc)
        if self.invariant:                   # the squares summed in order (`models.invariant`)
            h = invariant.rms_norm(h.reshape(*h.shape[:-2], -1), self.eps).reshape(h.shape)
        else:
            h = h * jax.lax.rsqrt(jnp.square(h).mean((-2, -1), keepdims=True) + self.eps)
        return (h * self.scale[...].astype(acc)).astype(x.dtype)


def token_mask(segment_ids: jax.Array | None) -> jax.Array | None:
    """The tokens the router statistics count: a packed batch's non-padding ones (segment id >
    0), else all (None): transformers' `attention_mask`."""
    return None if segment_ids is None else segment_ids > 0


class Chosen(NamedTuple):
    """A stack's carry that records routing: the hidden states [B, T, D], the experts of the
    layers so far int32 [L, B, T, k] (layer `layer` next)."""

    hidden: jax.Array
    experts: jax.Array
    layer: jax.Array


class Replayed(NamedTuple):
    """A stack's carry under routing replay: the hidden states [B, T, D], the router statistics
    of the layers so far, the next layer's index `layer` (int32 []), and per token the number
    of layers so far whose live choice differed from the record (`mismatches` int32 [B, T]).
    The record itself, int32 [L, B, T, k], reaches every block as an argument (read once, not
    carried: a layer's kept input carry would hold it once per layer)."""

    hidden: jax.Array
    stats: RouterStats
    layer: jax.Array
    mismatches: jax.Array


class Observed(Replayed):
    """`Replayed`'s carry where every token routes live and the record is only compared with
    the live choice: the mismatch count of a forward trained without replay."""


def replayed_stack(model, tokens: jax.Array, replay: jax.Array, moe_layers: int, *,
                   positions: jax.Array | None, segment_ids: jax.Array | None,
                   sequence: SequenceParallel | None, experts: ExpertParallel | None,
                   follow_record: bool) -> Replayed:
    """The stack run every MoE family's `replayed_token_logprobs` makes: `replay` int32
    [B, T, L, k] checked against (B, T, `moe_layers`, k), the tokens embedded
    (`model.embed(tokens, positions)`) and run through `model.blocks` with a `Replayed` carry
    (`Observed` when not `follow_record`) and the record [L, B, T, k] as the stack's last input.
    Returns the final carry: the hidden states [B, T, D] before the final norm, the live
    router's statistics, per token the layers whose live choice is not the record [B, T]."""
    c = model.config
    b, t = tokens.shape
    want = (b, t, moe_layers, c.experts_per_token)
    if tuple(replay.shape) != want:
        raise ValueError(f"replay {tuple(replay.shape)} must be [B, T, L, k] = {want}: "
                         "per input token, every MoE layer's k recorded experts")
    c.check_seq_len(t * (1 if sequence is None else sequence.size), "sequence length")
    args = stack_args(tokens, positions, segment_ids, sequence, experts)
    record = jnp.moveaxis(replay.astype(jnp.int32), 2, 0)                    # [L, B, T, k]
    args = (*args, *(None,) * (4 - len(args)), record)
    x = model.embed(tokens, args[0])
    carry = (Replayed if follow_record else Observed)(
        x, RouterStats.zeros(c.num_experts, at_least_float32(x.dtype)), jnp.int32(0),
        jnp.zeros((b, t), jnp.int32))
    out, _ = model.blocks(carry, *args)
    return out


class MoeBlock(Block):
    """x + attn(norm(x)), then x + moe(norm(x)). Called with a `Routed` carry it returns one,
    this layer's router statistics added; with a `Replayed` one (and the record `replay`),
    the same with the layer's tokens sent to the recorded experts and its mismatches counted;
    with a `Chosen` one, this layer's experts recorded; with plain hidden states, plain hidden
    states."""

    def __init__(self, cfg: MoeLlamaConfig, rngs: nnx.Rngs):
        super().__init__(cfg.replace(qk_norm=cfg.qk_norm and cfg.qk_norm_scope == "head"), rngs)
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":
            self.q_norm = ProjectionRMSNorm(cfg.num_heads, cfg.head_dim, eps=cfg.norm_eps,
                                            head_axis=axes.HEADS, invariant=cfg.batch_invariant)
            self.k_norm = ProjectionRMSNorm(cfg.num_kv_heads, cfg.head_dim, eps=cfg.norm_eps,
                                            head_axis=axes.KV_HEADS,
                                            invariant=cfg.batch_invariant)

    def init_mlp(self, cfg: MoeLlamaConfig, rngs: nnx.Rngs) -> None:
        self.moe = MoeMLP(cfg, rngs, invariant=cfg.batch_invariant)

    def __call__(self, x, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None, replay: jax.Array | None = None,
                 cache: dict | None = None):
        """x [B, T, D], `Routed`, `Replayed` or `Chosen` -> (the same kind, cache); the MoE
        runs over all the tokens at once (`mlp_chunk` tiles the attention's per-token parts
        only), its experts split over `experts` when given (`MoeMLP`); `replay` int32
        [L, B, T, k] (with a `Replayed` carry): every layer's recorded selection."""
        h = x if isinstance(x, jax.Array) else x.hidden
        a, cache = self.attend(h, positions, segment_ids, sequence, cache)
        h = tiled_map(self.attention_out, (h, a), self.mlp_chunk)
        return moe_residual(self.moe, self.mlp_norm, x, h, segment_ids, experts, replay), cache


def moe_residual(moe: MoeMLP, norm, x, h: jax.Array, segment_ids: jax.Array | None,
                 experts: ExpertParallel | None = None, replay: jax.Array | None = None):
    """A layer's MoE half: h [B, T, D] (the carry `x`'s hidden states after the layer's mixer)
    plus `moe(norm(h))`, returned as the kind `x` is: plain hidden states, `Routed` with the
    layer's statistics added, `Replayed` / `Observed` with the tokens sent to the layer's entry
    of `replay` int32 [L, B, T, k] (compared only: `Observed`) and its mismatches counted, or
    `Chosen` with the layer's experts recorded. Every MoE family's layer ends in it."""
    mask = token_mask(segment_ids)
    record = None
    if isinstance(x, Replayed):              # `Observed` too: the record compared only
        record = jax.lax.dynamic_index_in_dim(replay, x.layer, 0, keepdims=False)
    y, stats, chosen = moe(norm(h), mask, experts, None if isinstance(x, Observed) else record)
    h = h + y
    if isinstance(x, Replayed):
        return type(x)(h, x.stats + stats, x.layer + 1,
                       x.mismatches + replay_mismatches(chosen, record, mask))
    if isinstance(x, Routed):
        return Routed(h, x.stats + stats)
    if isinstance(x, Chosen):
        return Chosen(h, jax.lax.dynamic_update_index_in_dim(x.experts, chosen, x.layer, 0),
                      x.layer + 1)
    return h


class MoeLlama(Llama):
    """Llama with MoE blocks; `routed_token_logprobs` adds the router statistics (the
    auxiliary loss's terms) to the chunked log-probs. Every forward over whole rows takes
    `experts=` beside `sequence=` (an `ExpertParallel`: the MoE layers' experts split over a
    mesh axis) and hands it to each block; the decode paths run with every expert held."""

    BLOCK = MoeBlock

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 experts: ExpertParallel | None = None) -> jax.Array:
        """`Llama.__call__`'s logits float32 [B, T, V], the experts split over `experts`."""
        return self.logits(forward_stack(self, tokens, positions, segment_ids, sequence,
                                         experts=experts))                           # [B, T, V]

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               sequence: SequenceParallel | None = None,
               experts: ExpertParallel | None = None) -> jax.Array:
        """`Llama.hidden`'s final hidden states [B, T, D], the experts split over `experts`."""
        return self.final_norm(forward_stack(self, tokens, positions, segment_ids, sequence,
                                             experts=experts))

    def token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       vocab_limit: jax.Array | int | None = None,
                       sequence: SequenceParallel | None = None,
                       experts: ExpertParallel | None = None) -> jax.Array:
        """`Llama.token_logprobs`' float32 [B, T], the experts split over `experts`."""
        h = self.hidden(tokens, positions, segment_ids, sequence, experts)          # [B, T, D]
        return self.head_logprobs(h, labels, vocab_limit)

    def routed_token_logprobs(self, tokens: jax.Array, labels: jax.Array, *,
                              positions: jax.Array | None = None,
                              segment_ids: jax.Array | None = None,
                              vocab_limit: jax.Array | int | None = None,
                              sequence: SequenceParallel | None = None,
                              experts: ExpertParallel | None = None
                              ) -> tuple[jax.Array, RouterStats]:
        """(`token_logprobs(...)` float32 [B, T], the `RouterStats` of every layer over these
        tokens)."""
        e = self.config.num_experts
        out = forward_stack(self, tokens, positions, segment_ids, sequence, carry=lambda x: Routed(
            x, RouterStats.zeros(e, at_least_float32(x.dtype))), experts=experts)
        return self.head_logprobs(self.final_norm(out.hidden), labels, vocab_limit), out.stats

    def replayed_token_logprobs(self, tokens: jax.Array, labels: jax.Array, replay: jax.Array,
                                *, positions: jax.Array | None = None,
                                segment_ids: jax.Array | None = None,
                                vocab_limit: jax.Array | int | None = None,
                                sequence: SequenceParallel | None = None,
                                experts: ExpertParallel | None = None,
                                follow_record: bool = True
                                ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """`routed_token_logprobs` with every layer's routing replayed (`models.moe`): `replay`
        int32 [B, T, L, k] the experts layer l sent the token at input position t to (the
        token `tokens[:, t]`, whose output predicts `labels[:, t]`; a negative first slot: none
        recorded, routed live). Returns (log-probs float32 [B, T], the live router's
        `RouterStats`, per token the number of layers whose live choice is not the record,
        int32 [B, T]; 0 where the token has no record or is padding). `follow_record=False`:
        every token routes live (`routed_token_logprobs`' values) and the record is only
        compared (the mismatches of a forward that does not replay)."""
        out = replayed_stack(self, tokens, replay, self.config.moe_layers, positions=positions,
                             segment_ids=segment_ids, sequence=sequence, experts=experts,
                             follow_record=follow_record)
        logprobs = self.head_logprobs(self.final_norm(out.hidden), labels, vocab_limit)
        return logprobs, out.stats, out.mismatches

    def router_choices(self, tokens: jax.Array, positions: jax.Array | None = None,
                       cache: dict | None = None) -> tuple[jax.Array, dict | None]:
        """(the experts every layer routes each token to, int32 [L, B, T, k], the cache): a
        full forward, or with `cache` the KV-cached decode (`decode`'s path) of `tokens` at
        `positions`: what routing parity between a rollout and training compares."""
        _, experts, cache = self._chosen_forward(tokens, positions, cache)
        return experts, cache

    def decode_choices(self, tokens: jax.Array, positions: jax.Array,
                       cache: dict[str, jax.Array]
                       ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """`decode`'s (logits float32 [B, T, V], cache) with the experts every layer routed
        each token to, int32 [L, B, T, k], between them: what a rollout records for routing
        replay (`zeroxla.inference.decode`)."""
        hidden, experts, cache = self._chosen_forward(tokens, positions, cache)
        return self.logits(hidden), experts, cache

    def _chosen_forward(self, tokens: jax.Array, positions: jax.Array | None,
                        cache: dict | None) -> tuple[jax.Array, jax.Array, dict | None]:
        """(the final hidden states [B, T, D], the experts int32 [L, B, T, k], the cache) of a
        stack carrying `Chosen`."""
        c = self.config
        args = stack_args(tokens, positions, None)
        b, t = tokens.shape
        chosen = Chosen(self.embed(tokens, args[0]),
                        jnp.zeros((c.moe_layers, b, t, c.experts_per_token), jnp.int32),
                        jnp.int32(0))
        out, cache = self.blocks(chosen, *args, cache=cache)
        return out.hidden, out.experts, cache
