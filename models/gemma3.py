"""Gemma 3 text (Gemma Team 2025; transformers 5.23 `models/gemma3/`): Gemma 2's decoder
(`models.gemma2`: sqrt(d)-scaled embedding, (1 + w) RMSNorm before and after both sub-layers,
GeGLU MLP, scores scaled by query_pre_attn_scalar^-1/2, the tied head, the final logits
soft-capped where configured; the attention scores are not, as in transformers) with
per-head (1 + w) RMSNorm of q and k before RoPE, and five sliding-window layers to one global
layer, each kind with its own RoPE: the local layers' base (`rope_local_theta`,
transformers' `rope_local_base_freq`, 10000) and the global layers' base and scaling
(`rope_theta`, 1e6; `rope_type` "linear" with `rope_factor` for the 4B-27B checkpoints).

The pattern is built into the block: one `Period` is `sliding_window_pattern - 1` sliding
layers (an `nnx.List`) then the global one, so every block of the `LayerStack` has one shape
and static windows and the engine, the pipeline and the Hybrid Engine run it as Gemma 2's
pairs. `Gemma3Config.num_layers` counts periods (HF's num_hidden_layers // pattern). A period's
KV cache holds its layers' keys side by side on the head_dim, {"k", "v"} [L, B, S, G, P K]
(`gemma2.run_layers`).

A layer count that is not whole periods (transformers' Gemma 3 1B: 26 layers, 4 periods of 6
and 2 sliding layers) ends in a `Tail` of `tail_layers` sliding layers: one block of a
`LayerStack` of its own after the periods' (`Gemma3.tail`), so ZeRO-3 gathers it as it gathers
a period, and every forward (training, packing, sequence parallelism) runs it after the
periods on the same arguments (`layers.forward_stack`). Its KV cache is one more row of the
periods' shape, [L + 1, B, S, G, P K], its t layers in the first t K entries of the last dim
(the other (P - t) K unused: (P - t) / P of one period's cache); a dense cache is split into
the periods' rows and the tail's and joined again each step (a copy of the cache), a paged one
is carried whole, the tail's stack writing its layer L. A pipeline splits the periods alone
and refuses a model with a stack after them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .gemma2 import Gemma2, Gemma2Config, Layer, run_layers
from .layers import LayerStack
from .paged_attention import is_paged
from .rope import inv_freq
from .sequence_parallel import SequenceParallel

# transformers' rope_type values this module builds for the global layers (the local ones: plain)
GLOBAL_ROPE_TYPES = ("default", "linear")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    """Shape of a Gemma 3 text model; `num_layers` counts periods of `sliding_window_pattern`
    layers (pattern - 1 sliding, then one global). `rope_theta`, `rope_type`, `rope_factor`:
    the global layers' RoPE; `rope_local_theta`: the sliding layers'."""

    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    sliding_window_pattern: int = 6
    tail_layers: int = 0          # sliding layers after the periods (num_hidden_layers % P)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    family: str = dataclasses.field(default="gemma3", init=False)

    POSITIVE_FIELDS = Gemma2Config.POSITIVE_FIELDS + ("sliding_window_pattern",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window_pattern < 2:
            raise ValueError(f"Gemma3Config.sliding_window_pattern={self.sliding_window_pattern}"
                             " is invalid; accepted: an integer >= 2 (sliding layers, then one "
                             "global layer)")
        if not 0 <= self.tail_layers < self.sliding_window_pattern:
            raise ValueError(f"Gemma3Config.tail_layers={self.tail_layers} is invalid; "
                             "accepted: 0 to sliding_window_pattern - 1 = "
                             f"{self.sliding_window_pattern - 1} (the sliding layers after the "
                             "whole periods)")
        if self.rope_type not in GLOBAL_ROPE_TYPES:
            raise ValueError(f"Gemma3Config.rope_type={self.rope_type!r} is not built; accepted: "
                             f"{', '.join(GLOBAL_ROPE_TYPES)}")
        if self.attn_softcap is not None:
            raise ValueError(f"Gemma3Config.attn_softcap={self.attn_softcap!r} is not built: "
                             "transformers' Gemma 3 attention does not soft-cap (it normalises "
                             "q and k); accepted: None")
        if not self.rope_factor > 0:
            raise ValueError(f"Gemma3Config.rope_factor={self.rope_factor!r} is invalid; "
                             "accepted: a positive number")

    @property
    def layers_per_block(self) -> int:
        """HF layers per block of the stack (`models.hf`'s `{unit[j]}` names)."""
        return self.sliding_window_pattern


class Period(nnx.Module):
    """`sliding_window_pattern - 1` sliding-window layers (`local`), then a global one
    (`glob`): one block of the stack, HF layers P*i .. P*i + P - 1 of block i."""

    def __init__(self, cfg: Gemma3Config, rngs: nnx.Rngs):
        k = cfg.head_dim
        local = inv_freq(k, cfg.rope_local_theta)
        glob = inv_freq(k, cfg.rope_theta, cfg.rope_type, factor=cfg.rope_factor)
        self.local = nnx.List([Layer(cfg, cfg.sliding_window, local, rngs, qk_norm=True)
                               for _ in range(cfg.sliding_window_pattern - 1)])
        self.glob = Layer(cfg, None, glob, rngs, qk_norm=True)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: object = None) -> tuple[jax.Array, object]:
        """x [B, T, D] -> (x, cache); with `cache` [B, S, G, P K] layer j reads and writes
        [..., j K:(j + 1) K] (`run_layers`). `segment_ids` (a packed batch) and `sequence`
        reach every layer."""
        return run_layers((*self.local, self.glob), x, positions, segment_ids, sequence, cache)


class Tail(nnx.Module):
    """The `tail_layers` sliding layers after the whole periods (`sliding`, HF layers P L ..
    P L + t - 1): the one block of `Gemma3.tail`. With a cache [B, S, G, P K] layer j reads and
    writes [..., j K:(j + 1) K] and the rest is kept (`run_layers`)."""

    def __init__(self, cfg: Gemma3Config, rngs: nnx.Rngs):
        local = inv_freq(cfg.head_dim, cfg.rope_local_theta)
        self.sliding = nnx.List([Layer(cfg, cfg.sliding_window, local, rngs, qk_norm=True)
                                 for _ in range(cfg.tail_layers)])
        self.kv_widths = (cfg.head_dim,) * cfg.tail_layers                     # static

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
                 sequence: SequenceParallel | None = None,
                 cache: object = None) -> tuple[jax.Array, object]:
        return run_layers(tuple(self.sliding), x, positions, segment_ids, sequence, cache,
                          self.kv_widths)


class Gemma3(Gemma2):
    """Gemma 3 text: scaled embed -> stacked periods (sliding layers, then a global one) ->
    the tail of sliding layers where the layer count is not whole periods -> (1 + w) norm ->
    tied head -> logits, soft-capped where configured."""

    BLOCK = Period

    def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        if cfg.tail_layers:
            self.tail = LayerStack(lambda r: Tail(cfg, r), 1, rngs)

    def decode(self, tokens: jax.Array, positions: jax.Array,
               cache: Any) -> tuple[jax.Array, Any]:
        """Logits float32 [B, T, V] of `tokens` at `positions` against and into `cache`: the
        periods on its first L rows, the tail on the last (a paged cache's layer L)."""
        if self.tail is None:
            return super().decode(tokens, positions, cache)
        x = self.embed(tokens, positions)
        if is_paged(cache):                    # the tail's stack continues at layer L
            x, cache = self.blocks(x, positions, cache=cache)
            x, cache = self.tail(x, positions, cache=cache)
            return self.head(x), cache
        periods = self.config.num_layers
        x, head = self.blocks(x, positions, cache={n: c[:periods] for n, c in cache.items()})
        x, tail = self.tail(x, positions, cache={n: c[periods:] for n, c in cache.items()})
        return self.head(x), {n: jnp.concatenate([head[n], tail[n]]) for n in cache}
