"""Continuous batching over a paged KV cache: one compiled step, run until every request is
done (the Hybrid Engine's default `batching="continuous"`).

    batcher = engine.batcher(key)            # HybridEngine builds it: BatchShape, pool shape
    outputs, logprobs, routing = batcher.run(params, model_state, make_requests(...), eos_id,
                                             total, with_routing=False)
    batcher.stats        # steps, tokens, prefill tokens, pages in use, preemptions, ...

Per step (data flow; shapes per data group d of D, N = `max_ragged_batch_size` token places,
S = `max_ragged_sequence_count` sampling slots, M pages per sequence, NP pages per group):
1. host, `step_scheduler.StepScheduler.schedule()`: each group's `scheduler.GroupScheduler`
   admits queued requests, picks decode tokens and prompt chunks, and makes their pages
   writable (`pages.PagePool`: copy-on-write of a shared prompt page); the returned
   `step_plan.StepPlan` holds them and the step's arrays: tokens, positions int32 [D, N],
   token_pages int32 [D, N, M] (the places sorted by position: `step_plan.sort_places`), page
   copies int32 [D, S], the token each slot samples from int32 [D, S], each slot's key data,
   decode step and sampling row, packed into two arrays (`step_plan.pack`);
2. device (one program, the KV pools donated in and out): the copies, then the model's
   `decode(tokens, positions, PagedKV)` (its layers write and read pages:
   `models.paged_attention`), each slot's logits at its token, and its draw
   (`row_sampling.row_next_token`) -> tokens, log-probs [D, S]. A recurrent model's state
   (Gated DeltaNet's) rides in the `PagedKV` as pools of S + 1 slots, a sequence's state in
   its sampling slot (`models.recurrent_slots`, `state_pools`): the places feed them in
   position order, a place at position 0 resets its slot (a new sequence, or a preempted one
   recomputed from its start), and a group's prompt state is copied into its answers' slots
   once, after the step that forks it;
3. host, `StepScheduler.update(plan, tokens, logprobs)`: each sampling sequence takes its
   token; one at EOS or its own `max_new` finishes and frees its slot and pages for the queue.
With `with_routing` (an MoE model, `generate(..., return_routing=True)`) the step runs the
model's `decode_choices` instead and also returns the experts each layer chose for each place,
int32 [D, N, L, k]; `update` writes them into each sequence's record at the fed positions (a
recomputed sequence's again), the record of routing replay.
`ContinuousBatcher.run` only moves arrays between the two: schedule, run the program, update.
The step's shapes never change, so one executable serves the whole run, whatever the prompts.

A row draws its n-th token with key fold_in(row key, n), the row key folded from the seed and
the prompt's hash (`sampling.row_keys`; the hash computed on the host, the folds in the step),
as the static decode loop does: a prompt's answer does not depend on the other prompts, the
slots or the schedule.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.models.paged_attention import PagedKV
from zeroxla.models.recurrent_slots import RecurrentSlots
from zeroxla.inference.checks import KV_ENTRIES
from zeroxla.inference.row_sampling import RowSampling, row_next_token
from zeroxla.inference.sampling import HASH_BASE
from zeroxla.inference.scheduler import Request
from zeroxla.inference.step_plan import (BatchShape, StepArrays, filler_rows, pack,
                                         unpack)
from zeroxla.inference.step_scheduler import StepScheduler


def step_function(model_def: Any, key_impl: Any, shape: BatchShape,
                  key_shape: tuple[int, ...], with_routing: bool = False) -> Any:
    """The step (module docstring, step 2) as a function of (params, model_state, pools, the
    packed host inputs (`pack`)) -> (pools, [token, bitcast log-prob] int32 [2, D, S]); pools
    {"k", "v"} [L, D, G, NP, P, K] and a recurrent model's state slots, each [L, D, S + 1, ...]
    (`models.recurrent_slots`; a group's forked answers take their prompt's slot after the
    step). `with_routing` (an MoE model's `decode_choices`): a third output, the experts each
    layer routed each place's token to, int32 [D, N, L, k]."""

    def step(params, model_state, pools, ints, floats):
        arrays, rows = unpack(ints, floats, shape, key_shape)
        model = model_def.module(params, model_state)
        model.eval()
        copy = jax.vmap(lambda pool, src, dst: pool.at[:, :, dst].set(pool[:, :, src]),
                        in_axes=(1, 0, 0), out_axes=1)                # [L, G, NP, P, K]
        k = copy(pools["k"], arrays.copy_src, arrays.copy_dst)
        v = copy(pools["v"], arrays.copy_src, arrays.copy_dst)
        states = {name: pool for name, pool in pools.items() if name not in KV_ENTRIES}
        paged = PagedKV(k, v, arrays.token_pages, recurrent=RecurrentSlots(
            states, arrays.place_slots, arrays.place_order) if states else None)
        if with_routing:
            logits, experts, cache = model.decode_choices(arrays.tokens, arrays.positions,
                                                          paged)           # experts [L, D, N, k]
        else:
            logits, cache = model.decode(arrays.tokens, arrays.positions, paged)  # [D, N, V]
        last = jnp.take_along_axis(logits, arrays.sample_at[..., None], axis=1)  # [D, S, V]
        d, s, vocab = last.shape
        keys = jax.random.wrap_key_data(arrays.key_data.reshape((d * s,) + key_shape),
                                        impl=key_impl)             # the seeds' keys
        keys = jax.vmap(jax.random.fold_in)(keys, arrays.prompt_hash.reshape(-1))  # row keys
        keys = jax.vmap(jax.random.fold_in)(keys, arrays.step.reshape(-1))
        flat = jax.tree.map(lambda x: x.reshape(d * s), rows)
        token, logprob = row_next_token(last.reshape(d * s, vocab), keys, flat)
        drawn = jnp.stack([token, jax.lax.bitcast_convert_type(logprob, jnp.int32)])
        pools = {"k": cache.k, "v": cache.v}
        if states:                  # [L, D, S + 1, ...]: prompt slot -> its answers' slots
            fork = jax.vmap(lambda pool, src, dst: pool.at[:, dst].set(pool[:, src]),
                            in_axes=(1, 0, 0), out_axes=1)
            pools.update({name: fork(pool, arrays.fork_src, arrays.fork_dst)
                          for name, pool in cache.recurrent.pools.items()})
        if with_routing:
            return pools, drawn.reshape(2, d, s), jnp.moveaxis(experts, 0, 2)
        return pools, drawn.reshape(2, d, s)                            # one fetch a step

    return step


class ContinuousBatcher:
    """The compiled step and the host loop (module docstring) on a `TensorParallelLayout`;
    `pool_dtype` the KV page pools' (the engine's `rollout_dtype`); `states` a recurrent
    model's slot pools, {entry: (shape [L, D, S + 1, ...], dtype, sharding)} (`state_pools`)."""

    def __init__(self, model_def: Any, layout: Any, shape: BatchShape, pool_shape: tuple,
                 vocab_size: int, key: jax.Array, pool_dtype: Any = jnp.float32,
                 states: dict[str, tuple] | None = None):
        self.model_def, self.layout, self.shape = model_def, layout, shape
        self.pool_dtype = pool_dtype
        self.vocab_size = vocab_size
        self.key_impl = jax.random.key_impl(key)
        self.key_shape = tuple(jax.random.key_data(key).shape)
        spec = layout.cache_spec(pool_shape[2])                      # [L, B, S, G, K]
        self.pool_sharding = NamedSharding(layout.mesh,
                                           P(spec[0], spec[1], spec[3], None, None, spec[4]))
        self.pool_shape = pool_shape                                 # [L, D, G, NP, P, K]
        self.states = dict(states or {})
        self.pool_shardings = {"k": self.pool_sharding, "v": self.pool_sharding,
                               **{name: sharding for name, (_, _, sharding)
                                  in self.states.items()}}
        self._rows_sharding = layout.batch_sharding(2)
        self.program = self._jit(with_routing=False)
        self.routing_program = self._jit(with_routing=True)  # compiled on its first call
        self._pools: dict[str, jax.Array] | None = None
        self.stats: dict[str, Any] = {}

    def _jit(self, with_routing: bool) -> Any:
        """The jitted step (`step_function`), its pools donated in and out."""
        layout = self.layout
        pools = self.pool_shardings
        return jax.jit(
            step_function(self.model_def, self.key_impl, self.shape, self.key_shape,
                          with_routing),
            donate_argnums=(2,),
            in_shardings=(layout.param_shardings(), layout.replicated(), pools,
                          self._rows_sharding, self._rows_sharding),
            # the sampled tokens (and the routing) replicated: every process reads them all
            # and schedules the same next step
            out_shardings=(pools,) + (layout.replicated(),) * (2 if with_routing else 1))

    def pools(self) -> dict[str, jax.Array]:
        """The KV page pools and any state slots (allocated on first use, kept between
        runs)."""
        if self._pools is None:
            made = {**{k: (self.pool_shape, self.pool_dtype) for k in KV_ENTRIES},
                    **{name: (shape, dtype) for name, (shape, dtype, _) in self.states.items()}}
            self._pools = jax.jit(lambda: {name: jnp.zeros(shape, dtype)
                                           for name, (shape, dtype) in made.items()},
                                  out_shardings=self.pool_shardings)()
        return self._pools

    @property
    def held(self) -> dict[str, jax.Array] | None:
        """The page pools while allocated (None after `release`)."""
        return self._pools

    def release(self) -> None:
        if self._pools is not None:
            jax.tree.map(lambda x: x.delete(), self._pools)
        self._pools = None

    def example_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """The packed host inputs of an empty step (every place a filler): with the
        parameters, model state and `pools()`, the arguments of `program`, e.g. to lower it."""
        return pack(StepArrays.empty(self.shape, self.key_shape),
                    filler_rows(self.shape, self.vocab_size))

    def compiled(self, params: Any, model_state: Any) -> Any:
        """The step's executable (for `cost_analysis`, `memory_analysis`, its HLO)."""
        return self.program.lower(params, model_state, self.pools(),
                                  *self.example_inputs()).compile()

    def run(self, params: Any, model_state: Any, requests: Sequence[Request], eos_id: int | None,
            total: int, with_routing: bool = False
            ) -> tuple[list[np.ndarray], list[np.ndarray], list[Any]]:
        """Serves `requests` until each answer is done; returns `total` outputs (prompt then
        new tokens, cut after EOS), their drawn log-probs and, `with_routing` (an MoE model's
        `decode_choices`), their routing records int32 [len(output), L, k] (the experts of
        each token when it was last fed, -1 on the last token; else Nones), in
        `Request.outputs` order."""
        start, program_s = time.perf_counter(), 0.0
        scheduler = StepScheduler(self.shape, requests, eos_id, self.key_shape,
                                  self.vocab_size)
        outputs: list[Any] = [None] * total
        logprobs: list[Any] = [None] * total
        routing: list[Any] = [None] * total
        program = self.routing_program if with_routing else self.program
        pools = self.pools()
        while not scheduler.done:
            plan = scheduler.schedule()
            inputs = plan.inputs
            if jax.process_count() > 1:      # jit refuses numpy arguments that carry a
                inputs = jax.device_put(     # non-replicated sharding with several processes
                    inputs, (self._rows_sharding, self._rows_sharding))
            called = time.perf_counter()
            pools, drawn, *experts = program(params, model_state, pools, *inputs)
            drawn = np.asarray(drawn)                              # [2, D, S]
            experts = np.asarray(experts[0]) if with_routing else None   # [D, N, L, k]
            program_s += time.perf_counter() - called
            for answer in scheduler.update(plan, drawn[0], drawn[1].view(np.float32),
                                           experts):
                outputs[answer.output], logprobs[answer.output] = answer.tokens, answer.logprobs
                routing[answer.output] = answer.routing
        self._pools = pools
        self.stats = {**scheduler.stats(), "seconds": time.perf_counter() - start,
                      "program_seconds": program_s}
        return outputs, logprobs, routing


def state_pools(recurrent: dict[str, tuple], entry_shape: Any, layout: Any,
                shape: BatchShape) -> dict[str, tuple]:
    """A recurrent model's slot pools (`models.recurrent_slots`): each state entry
    (`checks.recurrent_entries`: [L, 1, ...] and its dims' names) as (shape [L, D, S + 1, ...]:
    a slot per sampling slot and the null slot, its dtype, its sharding: the data groups over
    the data axes, the other dims as the static cache lays them out). `entry_shape(name, 1)`:
    the entry's one-row shape in the inference layout (`static.StaticDecoder.entry_shape`)."""
    pools = {}
    for name, (value, names) in recurrent.items():
        one = tuple(entry_shape(name, 1))                            # [L, 1, ...]
        spec = layout.entry_spec(names, one)
        pools[name] = ((one[0], shape.groups, shape.slots + 1) + one[2:], value.dtype,
                       NamedSharding(layout.mesh, P(spec[0], spec[1], None, *spec[2:])))
    return pools


def make_requests(rows: list[np.ndarray], keys: list[jax.Array], news: list[int],
                  samplings: list[Any], vocab_size: int) -> list[Request]:
    """One request per prompt asking for new tokens (`news[p]` > 0), with one answer per
    seed key: answer g of prompt p is output g * len(rows) + p, drawn with the row key of
    (key g, prompt p) (`sampling.row_keys`, as the static decode loop folds it) and the
    prompt's own knobs `samplings[p]`."""
    key_data = [np.asarray(jax.random.key_data(key)) for key in keys]
    entries = {s: tuple(np.asarray(x)[0].item() for x in dataclasses.astuple(
        RowSampling.of([s], vocab_size))) for s in dict.fromkeys(samplings)}
    n = len(rows)
    return [Request(prompt=row, outputs=[g * n + p for g in range(len(keys))],
                    keys=key_data, max_new=new, row=entries[sampling],
                    prompt_hash=host_prompt_hash(row))
            for p, (row, new, sampling) in enumerate(zip(rows, news, samplings)) if new > 0]


def host_prompt_hash(row: np.ndarray) -> np.uint32:
    """`sampling.prompt_hash` of one prompt, in numpy's wrapping uint32 arithmetic (no device
    program per prompt length)."""
    powers = np.cumprod(np.concatenate([np.ones(1, np.uint32),
                                        np.full(row.size - 1, HASH_BASE, np.uint32)]),
                        dtype=np.uint32)
    return np.sum((row.astype(np.uint32) + np.uint32(1)) * powers, dtype=np.uint32)


def by_seed(rows: list[np.ndarray], news: list[int], outputs: list, drawn: list,
            routing: list, routed: tuple[int, int], seeds: int
            ) -> tuple[list[list], list[list], list[list]]:
    """`ContinuousBatcher.run`'s flat results as [seed][prompt], a prompt that asked for no
    token being itself (no log-prob; a routing record of -1 [P, *routed], never fed)."""
    n = len(rows)
    for p, new in enumerate(news):
        for g in range(seeds) if new == 0 else ():
            outputs[g * n + p] = rows[p].copy()
            drawn[g * n + p] = np.zeros((0,), np.float32)
            routing[g * n + p] = np.full((rows[p].size, *routed), -1, np.int32)
    return tuple([flat[g * n:(g + 1) * n] for g in range(seeds)]
                 for flat in (outputs, drawn, routing))


__all__ = ["BatchShape", "ContinuousBatcher", "by_seed", "host_prompt_hash", "make_requests",
           "state_pools", "step_function"]
