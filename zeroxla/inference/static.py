"""The Hybrid Engine's static batching (`batching="static"`): one compiled decode program per
(batch bucket, prompt bucket, sampling, outputs asked for), each running the prefill and a
`lax.while_loop` over new tokens until the last row ends (`decode.decode_loop`), its KV cache
donated in and out and kept between calls unless `release_inference_cache`.

    static = StaticDecoder(model_def, layout, config, cache_shape, kv_heads)
    outputs, drawn, routing = static.run(params, model_state, rows, key, news, sampling, eos_id,
                                         with_logprobs=True, with_routing=False)

The outputs asked for beside the tokens are the drawn log-probs (`with_logprobs`) and an MoE
model's routing record (`with_routing`: the experts each layer chose for every token fed,
`decode.unpack_routing`), each computed inside the program.

A recurrent model's cache carries its state entries beside "k" / "v" (`checks` module
docstring): each made for the batch bucket in its model dtype, KV-head dims replicated as the
parameters' are, laid out from its dims' names (`layout.entry_spec`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.inference.checks import KV_ENTRIES
from zeroxla.inference.decode import (bucket, decode_loop, pack, unpack, unpack_logprobs,
                                      unpack_routing)
from zeroxla.models.axes import KV_HEADS
from zeroxla.inference.sampling import Sampling


class StaticDecoder:
    """The static path of one engine (module docstring): its compiled programs and kept
    caches. `layout` the engine's `TensorParallelLayout`, `cache_shape` the model's KV cache
    [L, 1, S, G, K] (`checks.check_decodable`), `kv_heads` the heads the layout holds,
    `recurrent` a recurrent model's further cache entries (`checks.recurrent_entries`)."""

    def __init__(self, model_def: Any, layout: Any, config: Any, cache_shape: tuple,
                 kv_heads: int, recurrent: dict[str, tuple] | None = None):
        self.model_def, self.layout, self.config = model_def, layout, config
        self.cache_shape, self.kv_heads = tuple(cache_shape), kv_heads
        self.recurrent = dict(recurrent or {})
        self.programs: dict[tuple, Any] = {}
        self.caches: dict[int, dict[str, jax.Array]] = {}

    def program(self, batch: int, prompt: int, sampling: Sampling, with_logprobs: bool,
                with_routing: bool) -> Any:
        """(the compiled decode of `batch` rows of `prompt`-token prompts, its caches'
        shardings)."""
        key = (batch, prompt, sampling, with_logprobs, with_routing)
        if key not in self.programs:
            max_len = self.config.max_out_tokens
            layout = self.layout

            def run(params, model_state, cache, tokens, lengths, live, max_new, eos_id, key):
                model = self.model_def.module(params, model_state)
                model.eval()
                return decode_loop(model, cache, tokens, lengths, live, max_new, eos_id, key,
                                   sampling, max_len, with_logprobs=with_logprobs,
                                   with_routing=with_routing)

            cache_sharding = self.shardings()
            rows = layout.batch_sharding(1)
            rep = layout.replicated()
            extra = ((layout.batch_sharding(2),) if with_logprobs else ()) + (
                (layout.batch_sharding(4),) if with_routing else ())
            jitted = jax.jit(run, donate_argnums=(2,), in_shardings=(
                layout.param_shardings(), rep, cache_sharding, layout.batch_sharding(2), rows,
                rows, rep, rep, rep), out_shardings=(layout.batch_sharding(2), rep,
                                                     cache_sharding) + extra)
            self.programs[key] = (jitted, cache_sharding)
        return self.programs[key]

    def shardings(self) -> dict[str, jax.sharding.NamedSharding]:
        """Each cache entry's sharding: the KV cache's `layout.cache_spec`, a recurrent
        entry's from its dims' names (`layout.entry_spec`)."""
        layout = self.layout
        kv = jax.sharding.NamedSharding(layout.mesh, layout.cache_spec(self.kv_heads))
        return {**{k: kv for k in KV_ENTRIES},
                **{name: jax.sharding.NamedSharding(layout.mesh, layout.entry_spec(
                    names, self.entry_shape(name, 1))) for name, (_, names)
                   in self.recurrent.items()}}

    def entry_shape(self, name: str, batch: int) -> tuple[int, ...]:
        """Cache entry `name`'s shape for `batch` rows in the inference layout: its KV-head
        dims replicated `layout.kv_repeat` times, as the parameters' are."""
        if name in KV_ENTRIES:
            shape = list(self.cache_shape)
            shape[1], shape[3] = batch, self.kv_heads
            return tuple(shape)
        value, names = self.recurrent[name]
        return tuple(batch if i == 1 else size * (self.layout.kv_repeat if dim == KV_HEADS
                                                   else 1)
                     for i, (size, dim) in enumerate(zip(value.shape, names)))

    def cache(self, batch: int, sharding: dict[str, Any]) -> dict[str, jax.Array]:
        """A kept cache of `batch` rows, else a new one of zeros (the KV cache in the engine's
        `rollout_dtype`, a recurrent entry in its model dtype)."""
        if batch in self.caches:
            return self.caches.pop(batch)
        dtypes = {name: value.dtype for name, (value, _) in self.recurrent.items()}
        return jax.jit(lambda: {name: jnp.zeros(self.entry_shape(name, batch),
                                                dtypes.get(name, self.config.rollout_dtype))
                                for name in sharding}, out_shardings=sharding)()

    def run(self, params: dict[str, Any], model_state: Any, rows: list[np.ndarray],
            key: jax.Array, news: list[int], sampling: Sampling, eos_id: int | None,
            with_logprobs: bool, with_routing: bool
            ) -> tuple[list[np.ndarray], list[Any], list[Any]]:
        """One padded batch of `rows` decoded until every row has its most new tokens or EOS,
        each row cut to its own: (outputs, drawn log-probs or Nones, routing records int32
        [len(output), L, k] or Nones)."""
        layout = self.layout
        batch = bucket(len(rows), multiple=layout.data_size)
        prompt = bucket(max(row.size for row in rows), limit=self.config.max_out_tokens)
        program, cache_sharding = self.program(batch, prompt, sampling, with_logprobs,
                                               with_routing)
        # Host inputs are placed on the inference mesh explicitly: with several processes jit
        # refuses numpy arguments that carry a non-replicated sharding.
        rows_sharding, rep = layout.batch_sharding(1), layout.replicated()
        tokens, lengths, live = jax.device_put(
            pack(rows, batch, prompt), (layout.batch_sharding(2), rows_sharding, rows_sharding))
        model_state = jax.device_put(model_state, rep)
        scalars = jax.device_put((np.int32(max(news)),
                                  np.int32(-1 if eos_id is None else eos_id), key), rep)
        buffer, steps, cache, *extra = program(
            params, model_state, self.cache(batch, cache_sharding), tokens, lengths, live,
            *scalars)
        buffer, steps = np.asarray(buffer), int(steps)
        if self.config.release_inference_cache:
            jax.tree.map(lambda x: x.delete(), cache)
        else:
            self.caches[batch] = cache
        outputs = [out[:row.size + new]
                   for out, row, new in zip(unpack(rows, buffer, steps, eos_id), rows, news)]
        drawn = (unpack_logprobs(rows, outputs, np.asarray(extra.pop(0))) if with_logprobs
                 else [None] * len(rows))
        routing = (unpack_routing(outputs, np.asarray(extra.pop(0))) if with_routing
                   else [None] * len(rows))
        return outputs, drawn, routing

    def release(self) -> None:
        """Frees every kept cache; the compiled programs stay."""
        for cache in self.caches.values():
            jax.tree.map(lambda x: x.delete(), cache)
        self.caches = {}


__all__ = ["StaticDecoder"]
