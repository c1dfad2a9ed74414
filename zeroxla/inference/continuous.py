"""Continuous batching over a paged KV cache: one compiled step, run until every request is
done (the Hybrid Engine's default `batching="continuous"`).

    batcher = engine.batcher(key)            # HybridEngine builds it: BatchShape, pool shape
    outputs, logprobs = batcher.run(params, model_state, make_requests(...), eos_id, total)
    batcher.stats        # steps, tokens, prefill tokens, pages in use, preemptions, ...

Per step (data flow; shapes per data group d of D, N = `max_ragged_batch_size` token places,
S = `max_ragged_sequence_count` sampling slots, M pages per sequence, NP pages per group):
1. host: each group's `scheduler.GroupScheduler` admits queued requests, picks decode tokens
   and prompt chunks, and makes their pages writable (`pages.PagePool`: copy-on-write of a
   shared prompt page); the step's arrays are filled: tokens, positions int32 [D, N],
   token_pages int32 [D, N, M] (the places sorted by position: `sort_places`), page copies
   int32 [D, S], the token each slot samples from int32 [D, S], each slot's key data, decode
   step and sampling row;
2. device (one program, the KV pools donated in and out): the copies, then the model's
   `decode(tokens, positions, PagedKV)` (its layers write and read pages:
   `models.paged_attention`), each slot's logits at its token, and its draw
   (`row_sampling.row_next_token`) -> tokens, log-probs [D, S];
3. host: each sampling sequence takes its token; one at EOS or its own `max_new` finishes and
   frees its slot and pages for the queue.
The step's shapes never change, so one executable serves the whole run, whatever the prompts.

A row draws its n-th token with key fold_in(row key, n), the row key folded from the seed and
the prompt's hash (`sampling.row_keys`; the hash computed on the host, the folds in the step),
as the static decode loop does: a prompt's answer does not depend on the other prompts, the
slots or the schedule.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroxla.models.paged_attention import PagedKV
from zeroxla.inference.pages import PagePool
from zeroxla.inference.row_sampling import RowSampling, row_next_token
from zeroxla.inference.sampling import HASH_BASE
from zeroxla.inference.scheduler import GroupScheduler, Request


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The step's fixed sizes: D data groups, N token places and S slots per group, NP pages
    of P slots per group (page 0 the null page), M pages per sequence."""

    groups: int
    tokens: int
    slots: int
    pages: int
    page_size: int
    max_pages: int


@flax.struct.dataclass
class StepArrays:
    """The host arrays of one step (module docstring, step 1)."""

    tokens: np.ndarray          # int32 [D, N]
    positions: np.ndarray       # int32 [D, N]
    token_pages: np.ndarray     # int32 [D, N, M]
    copy_src: np.ndarray        # int32 [D, S]
    copy_dst: np.ndarray        # int32 [D, S]
    sample_at: np.ndarray       # int32 [D, S]
    key_data: np.ndarray        # uint32 [D, S, ...]: the seed's key
    prompt_hash: np.ndarray     # uint32 [D, S]: `sampling.prompt_hash` of the row's prompt
    step: np.ndarray            # int32 [D, S]

    @staticmethod
    def empty(shape: BatchShape, key_shape: tuple[int, ...]) -> "StepArrays":
        """Every place a filler (token 0 at position 0 on the null page), no copy, no draw."""
        return StepArrays(**{
            name: np.zeros((shape.groups,) + dims, np.uint32 if name in UINT32 else np.int32)
            for name, dims in _field_shapes(shape, key_shape).items()})


UINT32 = ("key_data", "prompt_hash")          # the StepArrays fields that are uint32


def _field_shapes(shape: BatchShape, key_shape: tuple[int, ...]) -> dict[str, tuple]:
    """Each StepArrays field's shape past the group dim [D]."""
    n, s = shape.tokens, shape.slots
    return {"tokens": (n,), "positions": (n,), "token_pages": (n, shape.max_pages),
            "copy_src": (s,), "copy_dst": (s,), "sample_at": (s,), "key_data": (s,) + key_shape,
            "prompt_hash": (s,), "step": (s,)}


def filler_rows(shape: BatchShape, vocab_size: int) -> RowSampling:
    """Host sampling rows [D, S] of greedy fillers, filled in place as slots sample."""
    rows = RowSampling.of([None] * (shape.groups * shape.slots), vocab_size)
    return jax.tree.map(lambda x: x.reshape(shape.groups, shape.slots), rows)


ROW_INTS, ROW_FLOATS = ("greedy", "uniform", "top_k", "vocab_limit"), ("a", "b", "top_p")
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(RowSampling))     # `Request.row`'s order


def pack(arrays: StepArrays, rows: RowSampling) -> tuple[np.ndarray, np.ndarray]:
    """The step's host inputs as two arrays, int32 [D, X] and float32 [D, 3S] (two transfers
    a step instead of sixteen); `unpack` inverts it inside the program."""
    d = arrays.tokens.shape[0]
    ints = [np.asarray(getattr(arrays, f.name)).reshape(d, -1).view(np.int32)
            for f in dataclasses.fields(StepArrays)]
    ints += [np.asarray(getattr(rows, name), np.int32).reshape(d, -1) for name in ROW_INTS]
    floats = [np.asarray(getattr(rows, name), np.float32).reshape(d, -1) for name in ROW_FLOATS]
    return np.concatenate(ints, axis=1), np.concatenate(floats, axis=1)


def unpack(ints: jax.Array, floats: jax.Array, shape: BatchShape,
           key_shape: tuple[int, ...]) -> tuple[StepArrays, RowSampling]:
    """`pack`'s two arrays back as the step's fields (uint32 ones bitcast back)."""
    d, at, fields = ints.shape[0], 0, {}
    for name, dims in _field_shapes(shape, key_shape).items():
        size = int(np.prod(dims))
        x = ints[:, at:at + size].reshape((d,) + dims)
        fields[name] = jax.lax.bitcast_convert_type(x, jnp.uint32) if name in UINT32 else x
        at += size
    s = shape.slots
    row = {name: ints[:, at + i * s:at + (i + 1) * s] for i, name in enumerate(ROW_INTS)}
    row.update({name: floats[:, i * s:(i + 1) * s] for i, name in enumerate(ROW_FLOATS)})
    row["greedy"], row["uniform"] = row["greedy"] != 0, row["uniform"] != 0
    return StepArrays(**fields), RowSampling(**row)


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
        shape, start = self.shape, time.perf_counter()
        groups = [GroupScheduler(shape.slots, shape.tokens, PagePool(shape.pages, shape.page_size))
                  for _ in range(shape.groups)]
        queue = deque(requests)
        outputs: list[Any] = [None] * total
        logprobs: list[Any] = [None] * total
        rows = filler_rows(shape, self.vocab_size)
        steps = fed = prefill = generated = pages_sum = live_sum = 0
        program_s = 0.0
        pools = self.pools()
        while queue or any(g.running for g in groups):
            arrays = StepArrays.empty(shape, self.key_shape)
            plans = []
            for group in sorted(groups, key=lambda g: -len(g.free_slots)):   # emptiest first
                group.admit(queue)
            for d, group in enumerate(groups):
                planned, copies = group.plan()
                if len(copies) > shape.slots:
                    raise RuntimeError(f"{len(copies)} page copies in one step; at most "
                                       f"{shape.slots} (one per slot) are possible")
                for i, (src, dst) in enumerate(copies):
                    arrays.copy_src[d, i], arrays.copy_dst[d, i] = src, dst
                for plan in planned:
                    seq, a, b = plan.seq, plan.start, plan.start + plan.count
                    last = plan.first + plan.count
                    arrays.tokens[d, a:b] = seq.tokens[plan.first:last]
                    arrays.positions[d, a:b] = np.arange(plan.first, last)
                    arrays.token_pages[d, a:b, :len(seq.table)] = seq.table
                    fed += plan.count
                    prefill += plan.count if plan.first < seq.prompt_size else 0
                    for sampler in plan.samples:
                        self._fill_slot(arrays, rows, d, sampler, b - 1)
                sort_places(arrays, d)
                plans.append((d, group, planned))
                pages_sum += group.pool.in_use
                live_sum += live_tokens(group)
            if not any(planned for _, _, planned in plans):
                raise RuntimeError("no sequence could be scheduled: the page pool is smaller "
                                   "than one sequence")
            placed = pack(arrays, rows)
            if jax.process_count() > 1:      # jit refuses numpy arguments that carry a
                placed = jax.device_put(     # non-replicated sharding with several processes
                    placed, (self._rows_sharding, self._rows_sharding))
            called = time.perf_counter()
            pools, drawn = self.program(params, model_state, pools, *placed)
            drawn = np.asarray(drawn)
            program_s += time.perf_counter() - called
            token, logprob = drawn[0], drawn[1].view(np.float32)
            steps += 1
            for d, group, planned in plans:
                for plan in planned:
                    for seq in plan.samples:
                        generated += 1
                        seq.tokens.append(int(token[d, seq.slot]))
                        seq.logprobs.append(float(logprob[d, seq.slot]))
                        if (seq.tokens[-1] == eos_id if eos_id is not None else False) \
                                or seq.generated >= seq.request.max_new:
                            out = seq.request.outputs[seq.answer]
                            outputs[out] = np.asarray(seq.tokens, np.int32)
                            logprobs[out] = np.asarray(seq.logprobs, np.float32)
                            group.finish(seq)
        self._pools = pools
        self.stats = {"steps": steps, "tokens_fed": fed, "prefill_tokens": prefill,
                      "generated_tokens": generated, "seconds": time.perf_counter() - start,
                      "program_seconds": program_s,
                      "mean_pages_in_use": pages_sum / max(1, steps * shape.groups),
                      "kv_slots_per_live_token": pages_sum * shape.page_size / max(1, live_sum),
                      "peak_pages_in_use": max(g.pool.peak for g in groups),
                      "preemptions": sum(g.preemptions for g in groups)}
        return outputs, logprobs

    def _fill_slot(self, arrays: StepArrays, rows: RowSampling, d: int, seq: Any,
                   place: int) -> None:
        request = seq.request
        arrays.sample_at[d, seq.slot] = place
        arrays.key_data[d, seq.slot] = request.keys[seq.answer]
        arrays.prompt_hash[d, seq.slot] = request.prompt_hash
        arrays.step[d, seq.slot] = seq.generated
        for name, value in zip(ROW_FIELDS, request.row):
            getattr(rows, name)[d, seq.slot] = value


def sort_places(arrays: StepArrays, d: int) -> None:
    """Group d's token places ordered by position, longest first (the sampling slots follow
    their tokens), so `paged_attention`'s chunks of neighbouring places read about what their
    own tokens need."""
    order = np.argsort(-arrays.positions[d], kind="stable")
    for name in ("tokens", "positions", "token_pages"):
        getattr(arrays, name)[d] = getattr(arrays, name)[d][order]
    arrays.sample_at[d] = np.argsort(order)[arrays.sample_at[d]]


def live_tokens(group: GroupScheduler) -> int:
    """Tokens in a group's cache, each once however many sequences read it (a shared prompt
    page counts its filled slots once)."""
    fill: dict[int, int] = {}
    size = group.pool.page_size
    for seq in group.running:
        for i, page in enumerate(seq.table):
            fill[page] = max(fill.get(page, 0), min(size, seq.cached - i * size))
    return sum(fill.values())


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


__all__ = ["BatchShape", "ContinuousBatcher", "StepArrays", "by_seed", "filler_rows",
           "host_prompt_hash",
           "live_tokens", "make_requests", "sort_places", "step_function"]
