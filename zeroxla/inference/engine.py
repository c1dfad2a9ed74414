"""The Hybrid Engine: ZeRO-3 training and tensor-parallel KV-cached generation on one set of
devices, with DeepSpeed's names (`deepspeed/runtime/hybrid_engine.py`).

    engine = HybridEngine(step.layout, HybridEngineConfig(inference_tp_size=4, max_out_tokens=256))
    outs = engine.generate(state, prompts, max_new_tokens=32)   # list of int32 [P + new]
    engine.release()

Per generation (data flow):
0. check: every argument, naming it (`sampling.py`, `decode.check_prompts`), then the state: a
   state of another step (its `plan` and model are not the layout's), or one donated to
   `step(state, batch)` (its buffers deleted), is refused before any of its arrays is read
   (`checks.py`).
1. reshard (once while the parameters are pinned and no optimizer step has run since): one
   compiled program takes the training state's partitioned storage (`state.params`, split over
   the data axes) to the tensor-parallel inference layout (`layout.py`; trained with expert
   parallelism: through the logical values, `expert_reshard.py`); the state is only read.
2. decode, `batching="continuous"` (the default where the model takes a paged cache): one
   compiled step over a paged KV cache, run until every row is done; finished rows free their
   slot and pages for queued prompts, a group's prompt (`generate_group`) is prefilled once
   and its pages shared by its answers (`continuous.py`, `scheduler.py`, `pages.py`).
   `batching="static"`: one compiled program per (batch bucket, prompt bucket, sampling):
   prefill, then a `lax.while_loop` over new tokens until the last row ends (`static.py`,
   `decode.py`). Both record an MoE model's routing when asked (`return_routing=True`).
   Both run under GSPMD with the parameters' tensor layout and the rows split over the data
   groups; the KV cache or page pools are donated in and out.
3. the host cuts each row after its prompt + new tokens (and after EOS).

Row b's draws use keys folded from the seed, a hash of row b's prompt and the decode step
(`sampling.row_keys`), so a prompt's tokens do not depend on the other prompts of the call.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.compat.cache import check_persistent_cache
from zeroxla.engine.offload import on_device
from zeroxla.engine.state import TrainState
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.layout_argument import layout_argument
from zeroxla.inference.adapter_switch import frozen_paths, keep, trainable_reshard, unchanged
from zeroxla.inference.checks import (PAGED, check_decodable, check_layout, check_routing,
                                      check_state, paged_refusal, recurrent_entries)
from zeroxla.inference.config import HybridEngineConfig
from zeroxla.inference.expert_reshard import expert_reshard
from zeroxla.inference.continuous import (BatchShape, ContinuousBatcher, by_seed, make_requests,
                                          state_pools)
from zeroxla.inference.decode import (KNOBS, by_sampling, check_request, row_max_new,
                                      row_samplings)
from zeroxla.inference.layout import TensorParallelLayout, tensor_parallel_layout
from zeroxla.inference.reshard import reshard_function, storage_view
from zeroxla.inference.sampling import Sampling, seed_key
from zeroxla.inference.static import StaticDecoder


def _leaves(state: TrainState) -> list[Any]:
    return jax.tree.leaves(state.params)


class HybridEngine:
    """Generation from the training states of a step whose `ZeroLayout` it is given (see the
    module docstring): `HybridEngine(step.layout, config)`. Construction refuses, by name, a
    layout that is not a `ZeroLayout`, a tensor-parallel size the devices or heads do not
    allow, and a model without the KV-cache protocol (`zeroxla.inference.checks`). The older
    form `HybridEngine(step, config)` still works and warns (`engine.layout_argument`)."""

    def __init__(self, zero_layout: ZeroLayout, config: HybridEngineConfig | None = None):
        zero_layout = layout_argument(zero_layout, "HybridEngine(step, ...)",
                                      "HybridEngine(step.layout, ...)")
        check_layout(zero_layout)            # the training layout; `self.layout` is inference's
        self.config = config = config if config is not None else HybridEngineConfig()
        if not isinstance(config, HybridEngineConfig):
            raise ValueError(f"HybridEngine: config is a {type(config).__name__}; accepted: a "
                             "HybridEngineConfig (or None for DeepSpeed's defaults)")
        self.model_def = zero_layout.model_def
        self.plan = zero_layout.plan
        devices = list(np.asarray(zero_layout.mesh.devices).reshape(-1))
        # storage split over the data axes alone: the mesh that holds each ZeRO partition in
        # its tensor slice (`layout.inference_mesh`); else the training order, XLA moving it
        self.layout: TensorParallelLayout = tensor_parallel_layout(
            self.model_def, devices, config.inference_tp_size,
            tensor_major=zero_layout.axes.data_size == len(devices))
        self.mesh = self.layout.mesh
        self.vocab_size = zero_layout.vocab_size
        self.dtype = jnp.dtype(config.rollout_dtype)    # the inference copy's and KV cache's
        self._cache_shape = check_decodable(self.model_def, config.max_out_tokens,
                                            self.vocab_size, recurrent_state=True)
        self._kv_heads = self._cache_shape[3] * self.layout.kv_repeat    # [L, 1, S, G, K]
        # a recurrent model's state entries beside the KV cache (continuous: in slots)
        recurrent = recurrent_entries(self.model_def, config.max_out_tokens)
        # "continuous" or "static" (`config.batching`; "auto" picks continuous when the model
        # decodes a paged cache) and, when static was chosen for "auto", why
        refusal = (None if config.batching == "static" else
                   paged_refusal(self.model_def, self._cache_shape, config.kv_block_size,
                                 self.vocab_size, recurrent=recurrent))
        if refusal is not None and config.batching == "continuous":
            raise ValueError(f"HybridEngineConfig.batching='continuous' needs a paged KV cache: "
                             f"{refusal}; {PAGED}. Accepted for this model: batching='static' "
                             "(or 'auto')")
        self.batching = "static" if config.batching == "static" or refusal else "continuous"
        self.batching_reason = refusal
        self._reshard = None                 # compiled reshard program
        self._static_decoder = StaticDecoder(self.model_def, self.layout, config,
                                             self._cache_shape, self._kv_heads, recurrent)
        self._params: dict[str, jax.Array] | None = None
        self._source: list[weakref.ref] = []
        self._batchers: dict[str, ContinuousBatcher] = {}      # per key implementation
        self.stats: dict[str, Any] = {}      # the last continuous generation's (`continuous`)
        self.reshards = 0                    # how many times the parameters were resharded
        # Only the trainable leaves changed since the last switch: those alone are resharded
        # (`adapter_switch`); `_kept` is the frozen storage the pinned copy was built from.
        self._expert_reshard = expert_reshard(zero_layout, self.layout,    # None: byte floor
                                              self.dtype)
        self._frozen = frozen_paths(self.plan)
        self._kept: dict[str, Any] | None = None
        self._trainable_reshard = None
        self.trainable_reshards = 0          # how many of `reshards` moved trainable leaves only

    # ---- reshard ---------------------------------------------------------------------------
    def reshard_program(self, state: TrainState) -> Any:
        """The compiled reshard: training storage -> tensor-parallel layout; call it on
        `reshard_inputs(state)` (inspect it with `zeroxla.comm_report(program,
        mesh=engine.mesh)`)."""
        check_state(state, self.plan, self.model_def)
        if self._reshard is None:
            self._reshard = jax.jit(reshard_function(self.plan, self.layout, self.dtype),
                                    out_shardings=self.layout.param_shardings()
                                    ).lower(self.reshard_inputs(state)).compile()
        return self._reshard

    def reshard_inputs(self, state: TrainState) -> dict[str, Any]:
        """`state.params` on the inference mesh's device order, the same buffers (no copy):
        the reshard program's argument (`reshard.storage_view`)."""
        check_state(state, self.plan, self.model_def)
        return storage_view(on_device(state.params), self.layout)

    def _pinned_for(self, state: TrainState) -> bool:
        """Whether the pinned copy was built from exactly these parameter arrays (an optimizer
        step makes new ones, so it invalidates the copy)."""
        leaves = _leaves(state)
        return (self._params is not None and len(leaves) == len(self._source)
                and all(ref() is leaf for ref, leaf in zip(self._source, leaves)))

    def inference_params(self, state: TrainState) -> dict[str, jax.Array]:
        """The tensor-parallel parameters of `state` (resharded unless pinned and current).
        ValueError naming the field for a state of another step or a donated one
        (`checks.check_state`), before any of its arrays is read."""
        check_state(state, self.plan, self.model_def)
        if self._pinned_for(state):
            return self._params
        if self._kept is not None and bool(unchanged(self._kept, self._frozen_storage(state))):
            self._params.update(self.trainable_reshard_program()(self._trainable_inputs(state)))
            self.trainable_reshards += 1
        else:
            self._free_params()
            self._params = (self._expert_reshard(on_device(state.params)) if self._expert_reshard
                            else self.reshard_program(state)(self.reshard_inputs(state)))
            if self._frozen and self.config.pin_parameters:
                self._kept = keep(self._frozen_storage(state))
        self._source = [weakref.ref(leaf) for leaf in _leaves(state)]
        self.reshards += 1
        return self._params

    def _frozen_storage(self, state: TrainState) -> dict[str, Any]:
        return on_device({path: state.params[path] for path in self._frozen})

    def _trainable_inputs(self, state: TrainState) -> dict[str, Any]:
        inputs = on_device(state.params) if self._expert_reshard else self.reshard_inputs(state)
        return {leaf.path: inputs[leaf.path] for leaf in self.plan.trainable_leaves}

    def trainable_reshard_program(self) -> Any:
        """The trainable leaves' switch (frozen ones bitwise the pinned copy's, `adapter_switch`);
        its input: those leaves of `reshard_inputs(state)` (of `state.params` under EP)."""
        if self._trainable_reshard is None:
            self._trainable_reshard = (self._expert_reshard.trainable() if self._expert_reshard
                                       else trainable_reshard(self.plan, self.layout,
                                                              self.dtype))
        return self._trainable_reshard

    # ---- decode ----------------------------------------------------------------------------
    def generate(self, state: TrainState, prompts: Sequence[Any], max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None,
                 seed: int | jax.Array = 0, vocab_limit: int | None = None,
                 return_logprobs: bool = False, return_routing: bool = False
                 ) -> list[np.ndarray] | tuple[list[np.ndarray], ...]:
        """Continues each prompt (1-D int array) by up to `max_new_tokens` tokens (an integer,
        or a list of one per prompt: each row ends at its own count or at EOS).

        Returns one int32 array per prompt: the prompt and its new tokens, cut after the first
        `eos_id`. `temperature` 0 is greedy (below 2**-126 too; above 3.4e38 the draw is
        uniform over the kept tokens: `sampling`); `top_k` / `top_p` restrict the draw; each
        knob is any Python or NumPy scalar in range, or a list of one per prompt; `seed` (an
        int or a typed key, `jax.random.key(...)`) fixes every draw. A prompt's tokens depend
        only on the prompt, the seed and its knobs, not on the other prompts of the call or
        its place among them: each row draws with keys folded from the seed, a hash of its own
        token ids and the decode step (`zeroxla.inference.sampling`), so equal prompts in one
        call get equal continuations (on a GPU at matmul precision "highest": docs/benchmarks.md).
        `vocab_limit` (the tokenizer's vocabulary size, when the model's embedding is padded past
        it): no id >= it is ever drawn, greedy included; None: any id of the model. `state` must be
        a live state of the engine's step (not one given to `step(state, batch)`, which donates
        it), only read. Every argument is checked, naming it, before anything runs.

        `return_logprobs=True` returns `(outputs, logprobs)`: logprobs[i] float32 [new tokens
        of output i], the log-probability each token was drawn with (as filtered and scaled:
        `sampling.sampled_logprobs`; 0 when greedy), computed inside the decode program, as
        vLLM reports them: what RL's train/rollout log-prob gap is measured against.
        `return_routing=True` (an MoE model: `checks.check_routing`) adds a last list:
        routing[i] int32 [len(output i), L, k], the experts each MoE layer routed each token of
        output i to when it was fed (the prompt's in the prefill, a new token's at the next
        step; under continuous batching a preempted answer's recomputed tokens at their last
        feed; -1 on the last token, never fed): the record of routing replay
        (`zeroxla.rlhf.answer_forward`), aligned with the output's tokens."""
        return self._generate(state, prompts, [seed], max_new_tokens,
                              (return_logprobs, return_routing),
                              dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                   eos_id=eos_id, vocab_limit=vocab_limit), single=True)

    def generate_group(self, state: TrainState, prompts: Sequence[Any],
                       seeds: Sequence[int | jax.Array], max_new_tokens: int = 32,
                       temperature: float = 0.0, top_k: int | None = None,
                       top_p: float | None = None, eos_id: int | None = None,
                       vocab_limit: int | None = None, return_logprobs: bool = False,
                       return_routing: bool = False) -> Any:
        """`[self.generate(state, prompts, seed=s, ...) for s in seeds]` (and the log-probs
        and routing records likewise, as further lists), with each prompt prefilled once for its
        len(seeds) answers under continuous batching (a GRPO group: the answers read the
        prompt's KV pages, each copying only the page it first writes into while others
        still read it)."""
        if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or not seeds:
            raise ValueError(f"seeds={seeds!r} is invalid; accepted: a non-empty list of seeds "
                             "(integers or typed keys), one per answer of each prompt")
        return self._generate(state, prompts, list(seeds), max_new_tokens,
                              (return_logprobs, return_routing),
                              dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                   eos_id=eos_id, vocab_limit=vocab_limit), single=False)

    def _generate(self, state: TrainState, prompts: Sequence[Any], seeds: list[Any],
                  max_new_tokens: Any, asked: tuple[Any, Any], knobs: dict[str, Any],
                  single: bool) -> Any:
        """`generate`'s work; `asked` (return_logprobs, return_routing)."""
        check_persistent_cache(self.mesh.devices.flat)    # zeroxla.compat.cache
        scalars = {k: v for k, v in knobs.items() if not isinstance(v, (list, tuple))}
        rows, sampling, _ = check_request(prompts, max_new_tokens, self.config.max_out_tokens,
                                          self.vocab_size, seed=seeds[0], per_row=True,
                                          **{**KNOBS, **scalars})    # lists: row_samplings
        samplings = row_samplings(knobs, len(rows), self.vocab_size) or [sampling] * len(rows)
        news = row_max_new(max_new_tokens, len(rows), per_row=True)
        keys = [seed_key(seed) for seed in seeds]
        if len({str(jax.random.key_impl(key)) for key in keys}) > 1:
            raise ValueError("seeds mix PRNG implementations; accepted: seeds of one kind "
                             "(integers, or typed keys of one implementation)")
        for name, value in zip(("return_logprobs", "return_routing"), asked):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}={value!r} is invalid; accepted: True or False")
        with_logprobs, with_routing = map(bool, asked)
        routed = check_routing(self.model_def) if with_routing else (0, 0)
        check_state(state, self.plan, self.model_def)
        eos_id = knobs["eos_id"]
        if max(news) == 0:
            outputs = [[row.copy() for row in rows] for _ in keys]
            drawn = [[np.zeros((0,), np.float32) for _ in rows] for _ in keys]
            routing = [[np.full((row.size, *routed), -1, np.int32) for row in rows]
                       for _ in keys]
        elif self.batching == "continuous":
            outputs, drawn, routing = self._serve(state, rows, keys, news, samplings, eos_id,
                                                  with_routing, routed)
        else:                    # one padded batch per seed and distinct knobs
            outputs, drawn, routing = zip(*(by_sampling(
                samplings, lambda index, sampling: self._static(
                    state, [rows[i] for i in index], key, [news[i] for i in index], sampling,
                    eos_id, with_logprobs, with_routing)) for key in keys))
        if not self.config.pin_parameters:
            self._free_params()
        if single:
            outputs, drawn, routing = outputs[0], drawn[0], routing[0]
        results = ((list(outputs),) + ((list(drawn),) if with_logprobs else ())
                   + ((list(routing),) if with_routing else ()))
        return results if len(results) > 1 else results[0]

    def _serve(self, state: TrainState, rows: list[np.ndarray], keys: list[jax.Array],
               news: list[int], samplings: list[Sampling], eos_id: int | None,
               with_routing: bool, routed: tuple[int, int]) -> tuple[list, list, list]:
        """Continuous batching (`continuous.ContinuousBatcher`): one request per prompt with
        one answer per key; outputs, drawn log-probs and routing records (Nones unless
        `with_routing`; `routed` its (L, k)), each [key][prompt]."""
        params = self.inference_params(state)
        batcher = self.batcher(keys[0])
        if len(keys) > batcher.shape.slots:
            raise ValueError(f"{len(keys)} answers per prompt but max_ragged_sequence_count="
                             f"{batcher.shape.slots}: a group's answers decode side by side; "
                             "accepted: at most max_ragged_sequence_count seeds")
        model_state = jax.device_put(state.model_state, self.layout.replicated())
        total = len(rows) * len(keys)
        outputs, drawn, routing = batcher.run(params, model_state,
                                              make_requests(rows, keys, news, samplings,
                                                            self.vocab_size),
                                              eos_id, total, with_routing)
        if self.config.release_inference_cache:
            batcher.release()
        self.stats = dict(batcher.stats)
        return by_seed(rows, news, outputs, drawn, routing, routed, len(keys))

    def batcher(self, key: jax.Array) -> ContinuousBatcher:
        """The continuous-batching step of keys like `key` (built once per key kind)."""
        impl = str(jax.random.key_impl(key))
        if impl not in self._batchers:
            c, layers, _, _, kv, head_dim = (self.config,) + tuple(self._cache_shape)
            shape = BatchShape(groups=self.layout.data_size, tokens=c.max_ragged_batch_size,
                               slots=c.max_ragged_sequence_count, pages=c.pool_pages,
                               page_size=c.kv_block_size, max_pages=c.pages_per_sequence)
            pool_shape = (layers, shape.groups, self._kv_heads, shape.pages, shape.page_size,
                          head_dim)
            states = state_pools(self._static_decoder.recurrent,
                                 self._static_decoder.entry_shape, self.layout, shape)
            self._batchers[impl] = ContinuousBatcher(self.model_def, self.layout, shape,
                                                     pool_shape, self.vocab_size, key,
                                                     pool_dtype=self.dtype, states=states)
        return self._batchers[impl]

    def _static(self, state: TrainState, rows: list[np.ndarray], key: jax.Array,
                news: list[int], sampling: Sampling, eos_id: int | None, with_logprobs: bool,
                with_routing: bool) -> tuple[list, list, list]:
        """One padded batch through the decode loop (`batching="static"`, `static.py`)."""
        return self._static_decoder.run(self.inference_params(state), state.model_state, rows,
                                        key, news, sampling, eos_id, with_logprobs,
                                        with_routing)

    def token_program(self, state: TrainState, batch: int) -> Any:
        """One compiled decode step (T = 1) of `batch` rows in the tensor-parallel layout:
        what each generated token costs (`comm_report(program, mesh=engine.mesh)`)."""
        layout = self.layout
        params = self.inference_params(state)
        sharding = self._static_decoder.shardings()          # the KV cache (and any state)

        def run(params, model_state, cache, token, pos):
            return self.model_def.module(params, model_state).decode(token, pos, cache)

        column = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=layout.batch_sharding(2))
        return jax.jit(run, out_shardings=(layout.batch_sharding(3), sharding)).lower(
            params, jax.device_put(state.model_state, layout.replicated()),
            self._static_decoder.cache(batch, sharding), column, column).compile()

    # ---- release ---------------------------------------------------------------------------
    def kept_arrays(self) -> tuple[dict[str, jax.Array], list[dict[str, jax.Array]]]:
        """What the engine holds between calls (and `release` frees): the pinned inference
        parameters (`{}` when none) and the kept KV caches (the static batches' and the
        continuous batcher's page pools), e.g. to count their bytes."""
        pools = [b.held for b in self._batchers.values() if b.held is not None]
        return dict(self._params or {}), list(self._static_decoder.caches.values()) + pools

    def _free_params(self) -> None:
        jax.tree.map(lambda x: x.delete(), self._params or {})
        if self._kept is not None:
            jax.tree.map(lambda x: x.delete(), self._kept)
        self._params, self._source, self._kept = None, [], None

    def release(self) -> None:
        """Frees the inference copy of the parameters and every kept KV cache; compiled
        programs stay, so the next `generate` only reshards."""
        self._free_params()
        self._static_decoder.release()
        for batcher in self._batchers.values():
            batcher.release()
