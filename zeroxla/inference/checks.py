"""What the Hybrid Engine refuses, by name, before it compiles or runs anything: a layout that is
not a step's `ZeroLayout`, a model it cannot decode, and a training state it must not read (one of
another step, or one whose buffers were donated to the training step).

The model protocol the engine decodes with (`models.GPT` and `models.Llama` implement it; a
model with the `embed` / `blocks` / `head` protocol gets it from `models.layers.init_kv_cache`
and `models.layers.decode`):

    init_cache(batch, max_len) -> {"k": [L, batch, S, G, K], "v": the same}   S >= max_len
    decode(tokens int32 [B, T], positions int32 [B, T], cache) -> (logits [B, T, V], cache)

A model with recurrent layers (Qwen3.5's Gated DeltaNet) keeps per-row state beside the KV
cache: its `init_cache` returns further entries, each [L, batch, ...] (a conv window, a [H, K, V]
state), and its `cache_axes()` names every entry's dims with the logical axis names parameters
carry (`models.axes`), so the engine creates and lays them out as it does parameters (batch over
the data axes, heads over `tensor` where they split: `layout.entry_spec`). Such a model's decode
takes the prefill's pad mask: `decode(tokens, positions, cache, segment_ids=...)`, int32 [B, T],
0 on a right pad and 1 on a prompt token, so a recurrent state ends at each row's last prompt
token rather than after its pads (a KV cache needs no mask: a pad's slot is overwritten before
it is read); one-token steps pass no mask. A row whose first position is 0 starts a sequence,
its state reset whatever a kept cache held. `recurrent_entries` lists the entries; under
continuous batching they live in per-sequence slots beside the pages (`PagedKV.recurrent`,
`models.recurrent_slots`: each entry [L, D, S + 1, ...]).

`check_decodable` verifies it on abstract values (shapes only, nothing computed), and
`paged_refusal` whether the model's decode also takes a paged cache (continuous batching).
A rollout that records routing (`return_routing=True`) needs an MoE model's
`decode_choices(tokens, positions, cache) -> (logits, experts [L, B, T, k], cache)`, taking
the same caches as its `decode` and, for a recurrent model, its prefill's `segment_ids=`
(`check_routing`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.models import axes as logical
from zeroxla.models.layers import KV_CACHE_AXES
from zeroxla.models.paged_attention import PagedKV
from zeroxla.models.recurrent_slots import RecurrentSlots
from zeroxla.sharding.model_def import ModelDef
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.state import TrainState

PROTOCOL = ("init_cache(batch, max_len) returning {'k', 'v'} arrays [L, batch, max_len, G, K] "
            "and decode(tokens [B, T], positions [B, T], cache) returning (logits [B, T, V], "
            "cache); a model with embed / blocks / head gets both from models.layers "
            "(init_kv_cache, decode), as models.GPT does; a recurrent model's further entries "
            "[L, batch, ...] are named by its cache_axes() and its decode takes segment_ids")

# A decode cache's KV entries; any further entry is a recurrent model's per-row state.
KV_ENTRIES = ("k", "v")


def state_entries(cache: Mapping[str, Any]) -> list[str]:
    """The entries of a decode cache beyond its KV cache's (a recurrent model's state), sorted."""
    return sorted(set(cache) - set(KV_ENTRIES))


def cache_axes(model: Any) -> dict[str, tuple[str | None, ...]]:
    """The logical names of each decode-cache entry's dims: the model's `cache_axes()`, else a
    KV cache's ({"k", "v"}: `models.layers.KV_CACHE_AXES`)."""
    method = getattr(model, "cache_axes", None)
    return dict(method()) if callable(method) else {k: KV_CACHE_AXES for k in KV_ENTRIES}


def recurrent_entries(model_def: ModelDef, max_out_tokens: int
                      ) -> dict[str, tuple[jax.ShapeDtypeStruct, tuple[str | None, ...]]]:
    """Each decode-cache entry beyond "k" / "v" of `model_def`'s model (`check_decodable`
    accepted them): (its one-row abstract value [L, 1, ...], its dims' logical names); {} for a
    model with a KV cache alone."""
    abstract = model_def.abstract_module()
    cache = jax.eval_shape(lambda: abstract.init_cache(1, max_out_tokens))
    names = cache_axes(abstract)
    return {entry: (cache[entry], tuple(names[entry])) for entry in state_entries(cache)}


def _check_state_entries(model: Any, cache: Mapping[str, Any], recurrent_state: bool) -> None:
    """ValueError naming the entry unless each state entry of `cache` (one row) is [L, 1, ...]
    with its dims named (layers, batch, ...) by the model's `cache_axes()`, or naming the
    generator when it carries no recurrent state (`recurrent_state` False)."""
    name, extra = type(model).__name__, state_entries(cache)
    if extra and not recurrent_state:
        raise ValueError(f"{name}'s decode cache holds recurrent state ({', '.join(extra)}) "
                         "beside its KV cache, which this generator does not carry; accepted: "
                         "HybridEngine (its static path), or a model whose init_cache returns "
                         "{'k', 'v'} alone")
    names, layers = cache_axes(model), cache["k"].shape[0]
    for entry in extra:
        shape, dims = tuple(getattr(cache[entry], "shape", ())), names.get(entry)
        if (dims is None or len(dims) != len(shape) or shape[:2] != (layers, 1)
                or tuple(dims[:2]) != (logical.LAYERS, logical.BATCH)):
            raise ValueError(f"HybridEngine cannot decode {name}: its cache entry {entry!r} is "
                             f"{shape} with dims named {dims}; accepted: [L={layers}, batch, "
                             f"...] named ('layers', 'batch', ...) by {name}.cache_axes() "
                             f"({PROTOCOL})")


def check_layout(layout: Any, who: str = "HybridEngine") -> None:
    """ValueError naming what `layout` is unless it is the `ZeroLayout` of a step."""
    if not isinstance(layout, ZeroLayout):
        raise ValueError(f"{who}: layout is a {type(layout).__name__}; accepted: the ZeroLayout "
                         "of the training step (step.layout, for a step zeroxla.make_step "
                         "returns)")


def _shapes(tree: Any) -> Any:
    """`tree` with each array as (shape, dtype), for messages and comparisons."""
    return jax.tree.map(lambda x: (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", x))),
                        tree)


def decode_shapes(model_def: ModelDef, cache: Any, tokens: int) -> Any:
    """What the model's `decode(tokens [1, T], positions [1, T], cache)` returns, traced on
    shapes alone (`jax.eval_shape`); whatever it raises propagates."""

    def probe(values, model_state, cache):
        model = model_def.module(values, model_state)
        model.eval()
        ids = jnp.zeros((1, tokens), jnp.int32)
        return model.decode(ids, ids, cache)

    return jax.eval_shape(probe, *model_def.abstract_values(), cache)


def check_decodable(model_def: ModelDef, max_out_tokens: int, vocab_size: int,
                    recurrent_state: bool = False) -> tuple[int, ...]:
    """The KV cache shape of one row, [L, 1, S, G, K], once `model_def`'s model is seen to
    follow the protocol (module docstring) for `max_out_tokens` positions: ValueError naming the
    model class, what is missing or wrong, and what to add. `recurrent_state`: whether the
    caller carries a recurrent model's further cache entries (else they are refused)."""
    abstract = model_def.abstract_module()
    name = type(abstract).__name__
    missing = [m for m in ("init_cache", "decode") if not callable(getattr(abstract, m, None))]
    if missing:
        raise ValueError(f"HybridEngine cannot decode {name}: it has no "
                         f"{' and no '.join(missing)} method (no KV-cache path); add {PROTOCOL}")
    try:
        cache = jax.eval_shape(lambda: abstract.init_cache(1, max_out_tokens))
    except ValueError as err:         # the model's own refusal, e.g. past learned positions
        raise ValueError(f"HybridEngineConfig.max_out_tokens={max_out_tokens} does not fit the "
                         f"model: {err}") from None
    except Exception as err:
        raise ValueError(f"HybridEngine cannot decode {name}: {name}.init_cache(1, "
                         f"{max_out_tokens}) raised {type(err).__name__}: {err}; accepted: "
                         f"{PROTOCOL}") from err
    shapes = ([tuple(getattr(cache[k], "shape", ())) for k in KV_ENTRIES]
              if isinstance(cache, Mapping) and set(KV_ENTRIES) <= set(cache) else None)
    if not (shapes and shapes[0] == shapes[1] and len(shapes[0]) == 5 and shapes[0][1] == 1
            and shapes[0][2] >= max_out_tokens):
        raise ValueError(f"HybridEngine cannot decode {name}: {name}.init_cache(1, "
                         f"{max_out_tokens}) returned {_shapes(cache)}; accepted: {PROTOCOL}")
    _check_state_entries(abstract, cache, recurrent_state)

    try:
        out = decode_shapes(model_def, cache, 1)
    except Exception as err:
        raise ValueError(f"HybridEngine cannot decode {name}: {name}.decode(tokens [1, 1], "
                         f"positions [1, 1], cache) raised {type(err).__name__}: {err}; "
                         f"accepted: {PROTOCOL}") from err
    ok = (isinstance(out, tuple) and len(out) == 2
          and getattr(out[0], "shape", None) == (1, 1, vocab_size)
          and _shapes(out[1]) == _shapes(cache))
    if not ok:
        raise ValueError(f"HybridEngine cannot decode {name}: {name}.decode(tokens [1, 1], "
                         f"positions [1, 1], cache) returned {_shapes(out)}; accepted: logits "
                         f"[1, 1, {vocab_size}] (the vocabulary of {name}.__call__) and a cache "
                         f"of the shapes init_cache gave ({PROTOCOL})")
    return shapes[0]


PAGED = ("a model whose layers attend through zeroxla.models.attention.cached_attention (every "
         "family here, and an embed / blocks / head model using models.layers' blocks) decodes "
         "a PagedKV cache unchanged")


def paged_refusal(model_def: ModelDef, kv_shape: tuple[int, ...], page_size: int,
                  vocab_size: int, recurrent: Mapping[str, tuple] | None = None) -> str | None:
    """Why `model_def`'s model cannot decode a paged KV cache (`models.paged_attention`), or
    None when it can: its `decode(tokens [1, 2], positions [1, 2], PagedKV)` is traced on
    shapes alone and must return logits [1, 2, V] and a `PagedKV` of the shapes it was given.
    `kv_shape`: the dense cache's [L, 1, S, G, K] (`check_decodable`); `recurrent`: a recurrent
    model's state entries (`recurrent_entries`), given to it as one slot each
    (`PagedKV.recurrent`)."""
    model = model_def.abstract_module()
    if getattr(getattr(model, "config", None), "batch_invariant", False):
        return (f"{type(model).__name__} has batch_invariant=True: its attention sums a dense "
                "cache's keys in a fixed order, and the paged attention's sums are not "
                "batch-invariant")
    layers, _, _, kv_heads, head_dim = kv_shape
    pool = jax.ShapeDtypeStruct((layers, 1, kv_heads, 2, page_size, head_dim), jnp.float32)
    places = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    slots = (RecurrentSlots({entry: jax.ShapeDtypeStruct(value.shape[:1] + (1, 2)
                                                         + value.shape[2:], value.dtype)
                             for entry, (value, _) in recurrent.items()}, places, places)
             if recurrent else None)                  # a slot and the null slot per entry
    cache = PagedKV(pool, pool, jax.ShapeDtypeStruct((1, 2, 1), jnp.int32),
                    jax.ShapeDtypeStruct((), jnp.int32), slots)
    name = type(model).__name__

    try:
        out = decode_shapes(model_def, cache, 2)
    except Exception as err:                         # the model's own cache handling
        return (f"{name}.decode(tokens, positions, PagedKV) raised {type(err).__name__}: "
                f"{str(err)[:200]}")
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], PagedKV)
            and getattr(out[0], "shape", None) == (1, 2, vocab_size)
            and _shapes(out[1]) == _shapes(cache)):
        return (f"{name}.decode(tokens, positions, PagedKV) returned {_shapes(out)}; accepted: "
                f"logits [1, 2, {vocab_size}] and the PagedKV it was given, updated")
    return None


def _describe(plan: ShardingPlan) -> str:
    return (f"ZeRO-{plan.stage} over {plan.data_size} data devices"
            + (f" ({plan.mesh_description})" if plan.mesh_description else ""))


def check_routing(model_def: ModelDef) -> tuple[int, int]:
    """(L, k): the MoE layers and experts per token of a model whose decode records its
    routing (either batching); ValueError naming `return_routing` for a model without
    `decode_choices` (read from its class)."""
    model = model_def.abstract_module()
    if not callable(getattr(type(model), "decode_choices", None)):
        raise ValueError(f"return_routing=True with a {type(model).__name__}: it has no "
                         "decode_choices (a Mixture-of-Experts model's decode returning each "
                         "layer's experts); accepted: return_routing=False, or an MoE model "
                         "(models.moe_llama, gpt_oss, qwen3_5_moe, gemma4 with num_experts > 0)")
    if not model.config.moe_layers:
        raise ValueError(f"return_routing=True with a {type(model).__name__} of no MoE layers "
                         f"(num_experts={getattr(model.config, 'num_experts', 0)}): nothing is "
                         "routed; accepted: return_routing=False, or a config with the MoE "
                         "block (num_experts > 0)")
    return model.config.moe_layers, model.config.experts_per_token


def check_state(state: Any, plan: ShardingPlan, model_def: ModelDef) -> None:
    """ValueError naming the field unless `state` is a live TrainState of the step whose `plan`
    and `model_def` are given: not a TrainState, a state of another step (another model or
    another sharding plan), or a state whose buffers are deleted (donated to the step)."""
    if not isinstance(state, TrainState):
        raise ValueError(f"state is a {type(state).__name__}; accepted: a TrainState of the "
                         "engine's step (step.init(), or what step(state, batch) returned)")
    if state.model_def is not model_def and state.model_def != model_def:
        ours, theirs = set(model_def.paths), set(state.model_def.paths)
        what = (f"parameters {sorted(theirs - ours)[:3]} the engine's model lacks"
                if theirs - ours else f"no parameters {sorted(ours - theirs)[:3]}"
                if ours - theirs else "another model structure (shapes or dtypes)")
        raise ValueError(f"state is a TrainState of another step: its model has {what}; "
                         "accepted: a state of the step given to HybridEngine (step.init(), or "
                         "what step(state, batch) returned)")
    if state.plan is not plan and state.plan != plan:
        raise ValueError(f"state is a TrainState of another step: state.plan is "
                         f"{_describe(state.plan)}, the engine's step's is {_describe(plan)} "
                         "(or their leaves differ); accepted: a state of the step given to "
                         "HybridEngine (step.init(), or what step(state, batch) returned)")
    for field in ("params", "model_state"):
        for path, value in getattr(state, field).items():
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(value)):
                raise ValueError(
                    f"state.{field}[{path!r}] is deleted: the state was donated to the training "
                    "step (`state, metrics = step(state, batch)` consumes the state it is "
                    "given); use the state the step returned")


__all__ = ["KV_ENTRIES", "PAGED", "PROTOCOL", "cache_axes", "check_decodable", "check_layout",
           "check_state", "paged_refusal", "recurrent_entries", "state_entries"]
