"""Continuous batching over a paged KV cache: one compiled step, run until every request is
done (the Hybrid Engine's default `batching="continuous"`).

    batcher = engine.batcher(key)            # HybridEngine builds it: BatchShape, pool shape
    outputs, logprobs = batcher.run(params, model_state, make_requests(...), eos_id, total)
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
   (`row_sampling.row_next_token`) -> tokens, log-probs [D, S];
3. host, `StepScheduler.update(plan, tokens, logprobs)`: each sampling sequence takes its
   token; one at EOS or its own `max_new` finishes and frees its slot and pages for the queue.
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
from zeroxla.inference.row_sampling import RowSampling, row_next_token
from zeroxla.inference.sampling import HASH_BASE
from zeroxla.inference.scheduler import Request
from zeroxla.inference.step_plan import (BatchShape, StepArrays, filler_rows, pack,
                                         unpack)
from zeroxla.inference.step_scheduler import StepScheduler


def step_function(model_def: Any, key_impl: Any, shape: BatchShape,
                  key_shape: tuple[int, ...]) -> Any:
    """The step (module docstring, step 2) as a function of (params, model_state, pools, the
    packed host inputs (`pack`)) -> (pools, [token, bitcast log-prob] int32 [2, D, S]); pools
    {"k", "v"} [L, D, G, NP, P, K]."""

    def step(params, model_state, pools, ints, floats):
        arrays, rows = unpack(ints, floats, shape, key_shape)
        model = model_def.module(params, model_state)
        model.eval()
        copy = jax.vmap(lambda pool, src, dst: pool.at[:, :, dst].set(pool[:, :, src]),
                        in_axes=(1, 0, 0), out_axes=1)                # [L, G, NP, P, K]
        k = copy(pools["k"], arrays.copy_src, arrays.copy_dst)
        v = copy(pools["v"], arrays.copy_src, arrays.copy_dst)
        logits, cache = model.decode(arrays.tokens, arrays.positions,
                                     PagedKV(k, v, arrays.token_pages))        # [D, N, V]
        last = jnp.take_along_axis(logits, arrays.sample_at[..., None], axis=1)  # [D, S, V]
        d, s, vocab = last.shape
        keys = jax.random.wrap_key_data(arrays.key_data.reshape((d * s,) + key_shape),
                                        impl=key_impl)             # the seeds' keys
        keys = jax.vmap(jax.random.fold_in)(keys, arrays.prompt_hash.reshape(-1))  # row keys
        keys = jax.vmap(jax.random.fold_in)(keys, arrays.step.reshape(-1))
        flat = jax.tree.map(lambda x: x.reshape(d * s), rows)
        token, logprob = row_next_token(last.reshape(d * s, vocab), keys, flat)
        drawn = jnp.stack([token, jax.lax.bitcast_convert_type(logprob, jnp.int32)])
        return {"k": cache.k, "v": cache.v}, drawn.reshape(2, d, s)    # one fetch a step

    return step


class ContinuousBatcher:
    """The compiled step and the host loop (module docstring) on a `TensorParallelLayout`."""

    def __init__(self, model_def: Any, layout: Any, shape: BatchShape, pool_shape: tuple,
                 vocab_size: int, key: jax.Array):
        self.model_def, self.layout, self.shape = model_def, layout, shape
        self.vocab_size = vocab_size
        self.key_impl = jax.random.key_impl(key)
        self.key_shape = tuple(jax.random.key_data(key).shape)
        spec = layout.cache_spec(pool_shape[2])                      # [L, B, S, G, K]
        self.pool_sharding = NamedSharding(layout.mesh,
                                           P(spec[0], spec[1], spec[3], None, None, spec[4]))
        self.pool_shape = pool_shape                                 # [L, D, G, NP, P, K]
        self._rows_sharding = layout.batch_sharding(2)
        pools = {"k": self.pool_sharding, "v": self.pool_sharding}
        self.program = jax.jit(step_function(model_def, self.key_impl, shape, self.key_shape),
                             donate_argnums=(2,),
                             in_shardings=(layout.param_shardings(), layout.replicated(), pools,
                                           self._rows_sharding, self._rows_sharding),
                             # the sampled tokens replicated: every process reads them all
                             # and schedules the same next step
                             out_shardings=(pools, layout.replicated()))
        self._pools: dict[str, jax.Array] | None = None
        self.stats: dict[str, Any] = {}

    def pools(self) -> dict[str, jax.Array]:
        """The KV page pools (allocated on first use, kept between runs)."""
        if self._pools is None:
            self._pools = jax.jit(lambda: {k: jnp.zeros(self.pool_shape, jnp.float32)
                                           for k in ("k", "v")},
                                  out_shardings={"k": self.pool_sharding,
                                                 "v": self.pool_sharding})()
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
            total: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Serves `requests` until each answer is done; returns `total` outputs (prompt then
        new tokens, cut after EOS) and their drawn log-probs, in `Request.outputs` order."""
        start, program_s = time.perf_counter(), 0.0
        scheduler = StepScheduler(self.shape, requests, eos_id, self.key_shape,
                                  self.vocab_size)
        outputs: list[Any] = [None] * total
        logprobs: list[Any] = [None] * total
        pools = self.pools()
        while not scheduler.done:
            plan = scheduler.schedule()
            inputs = plan.inputs
            if jax.process_count() > 1:      # jit refuses numpy arguments that carry a
                inputs = jax.device_put(     # non-replicated sharding with several processes
                    inputs, (self._rows_sharding, self._rows_sharding))
            called = time.perf_counter()
            pools, drawn = self.program(params, model_state, pools, *inputs)
            drawn = np.asarray(drawn)                              # [2, D, S]
            program_s += time.perf_counter() - called
            for answer in scheduler.update(plan, drawn[0], drawn[1].view(np.float32)):
                outputs[answer.output], logprobs[answer.output] = answer.tokens, answer.logprobs
        self._pools = pools
        self.stats = {**scheduler.stats(), "seconds": time.perf_counter() - start,
                      "program_seconds": program_s}
        return outputs, logprobs


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
            seeds: int) -> tuple[list[list], list[list]]:
    """`ContinuousBatcher.run`'s flat results as [seed][prompt], a prompt that asked for no
    token being itself (and no log-prob)."""
    n = len(rows)
    for p, new in enumerate(news):
        for g in range(seeds) if new == 0 else ():
            outputs[g * n + p] = rows[p].copy()
            drawn[g * n + p] = np.zeros((0,), np.float32)
    return ([outputs[g * n:(g + 1) * n] for g in range(seeds)],
            [drawn[g * n:(g + 1) * n] for g in range(seeds)])


__all__ = ["BatchShape", "ContinuousBatcher", "by_seed", "host_prompt_hash", "make_requests",
           "step_function"]
