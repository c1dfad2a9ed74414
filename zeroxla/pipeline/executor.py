"""The pipeline executor: any schedule table run as ONE SPMD program inside the ZeRO step.

`make_step(..., pipeline=PipelineConfig(...))` replaces the step's gradient pass with
`PipelineExecutor.local_gradients`, which runs inside the same `shard_map` as the ZeRO step.
Every device runs the same program; its stage is `lax.axis_index("stage")`. The schedule
(1F1B or GPipe) is data: `schedule_table` gives int32 grids [T, S] of (op, micro-batch,
buffer), and the executor runs the T steps as consecutive segments (`table.send_segments`),
each `repeats` times a pattern of `period` steps (1F1B's steady state alternates two, GPipe's
phases repeat one; warm-up and cool-down steps are short segments):

    for each segment:                              lax.scan, trip count = repeats
        for each of its `period` steps (unrolled):
            op = table.op[t, stage]                lax.switch: idle / forward / backward
            for each stage pair sending this step (static, `table.step_sends`):
                one lax.ppermute over "stage": activation s -> s + 1, or gradient s -> s - 1

so each compiled collective-permute execution is one DeepSpeed SendActivation / SendGrad
instruction (M (S - 1) of each per data replica), not a permute of every pair on every step.
A new schedule is a new table, not a new executor (`checks.check_table` states what a table must
satisfy: a stage's input arrives from its neighbour's compute of the step before). A step's
forward and backward run under `FORWARD_SCOPE` / `BACKWARD_SCOPE` (`jax.named_scope`), so the
HLO names which collectives belong to a schedule op.

Compile time grows with the unrolled steps (about 4(S - 1) + 2 for 1F1B, independent of M);
each unrolled step builds only the branches some stage takes in it (no backward in a
forward-only warm-up step, no embedding where the first stage does not run a forward).

Forward on stage s: x = the model's computation up to its stack on the first stage (its own
`__call__` and loss, cut at `blocks`: `zeroxla.pipeline.stages`), else the activation received;
the stage's blocks run; on the last stage the rest of `__call__` and the loss (the default or the
user's `loss_fn`) too. What the forward keeps in stash
buffer `buffer` for its backward is `ZeroConfig.remat` (`zeroxla.engine.remat`), as in the plain
step:
  "none" (the default; DeepSpeed without activation checkpointing): the blocks run under
      `jax.vjp` and their residuals are kept, less those that are parameters (or, under
      ZeRO-3 per-micro-batch gathers, the `GatheredStack`'s shards): those are taken again in
      backward, never stored per buffer. The last stage's loss cotangent is known in forward,
      so its head's backward runs right there and only d_y [mb, T, D] is kept. Backward
      applies the kept vjp: no recompute (the first stage re-runs its embedding lookup, a
      gather, for the embedding's vjp).
  "full": only the stage input x [mb, T, D] is kept; backward recomputes the stage's forward
      under `jax.vjp` (plus the head and loss on the last stage, the embedding on the first):
      about one more forward's FLOPs, one activation per buffer instead of every layer's
      intermediates (attention scores [mb, H, T, T] included).
  a checkpoint policy ("dots_saveable", ...): as "none", keeping what the policy saves.
The stash has `max(num_pipe_buffers)` buffers: 1F1B's min(S, M) (at least 2), GPipe's M.

Each stage stores only its own layers (`zeroxla.pipeline.storage`: the stacked leaves split over
the stage axis in `max_layers` slots per stage, padding slots masked; partitioned over the data
axes inside the stage per the ZeRO stage), so its slots arrive in the `shard_map` as its local
`[max_layers, ...]` and their gradients leave the same way, with no traffic over "stage". The
embedding and head stay replicated over the stages; their gradients are summed over the stages
(`psum` over "stage"): GPT-2's tied `wte` gets the embedding's gradient (first stage) plus the
head's (last stage), as DeepSpeed's ReduceTiedGrads. ZeRO then reduces over the data axes as in
the plain step.

Under ZeRO-3 the embedding and head parameters are gathered once per step. The stage's blocks
are gathered per `PipelineConfig.zero3_gather`: "micro_batch" runs them as a `GatheredStack`
(per-layer gather in every forward and again in every backward recompute, gradients
reduce-scattered per layer and micro-batch); "step" gathers the stage's layers once before the
scan and reduce-scatters their accumulated gradients once after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from zeroxla.collectives import zero as collectives
from zeroxla.collectives.wire import all_gather_dim
from zeroxla.engine import remat
from zeroxla.engine.gather import GatheredStack
from zeroxla.engine.loss import normalizer
from zeroxla.models.layers import call_block
from zeroxla.pipeline.checks import check_step, check_table
from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.split import BLOCKS_PREFIX, StageSplit, layer_list, split_stages
from zeroxla.pipeline.stages import (StageCut, StagedLoss, loss_after_stack, stack_input,
                                     stop_gradients)
from zeroxla.pipeline.storage import stage_local
from zeroxla.pipeline.table import (BACKWARD, FORWARD, IDLE, ScheduleTable, Segment, StepSends,
                                    schedule_table, send_segments, step_sends)

# `jax.named_scope`s around a stage's forward and backward work, so an HLO reading can tell the
# collectives of each schedule op (ZeRO-3 gathers, reduce-scatters) from those of the loop.
FORWARD_SCOPE = "pipeline_forward"
BACKWARD_SCOPE = "pipeline_backward"


@dataclasses.dataclass(frozen=True)
class _Block:
    """How to call one block from a flat list of its parameters (stacked-leaf order)."""

    graphdef: Any
    treedef: Any
    paths: tuple[str, ...]          # the plan paths of its leaves, in that order

    def __call__(self, full: list[Any], x: Any, consts: tuple, keep: Any) -> tuple[Any, None]:
        block = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, full))
        y, _ = call_block(block, x, consts, None)
        return jnp.where(keep, y, x), None          # a masked (padding) slot passes x through


class PipelineExecutor:
    """The pipelined gradient pass of a `ZeroStep` (see the module docstring)."""

    def __init__(self, step: Any, config: PipelineConfig):
        check_step(step, config)
        self.step, self.config = step, config
        self.stages = step.axes.num_stages
        model = step.model_def.abstract_module()
        self.loss = StagedLoss(step.loss_fn, step.model_def)
        self.cut: StageCut = self.loss.model_cut()
        self.split: StageSplit = split_stages(
            layer_list(model, step.model_def.shape_dict(), self.cut.embed_paths,
                       self.cut.head_paths), self.stages, config.partition_method)
        self.table: ScheduleTable = schedule_table(config.schedule_class, config.micro_batches,
                                                   self.stages)
        check_table(self.table)
        self.segments: tuple[Segment, ...] = send_segments(self.table)
        graphdef, state = nnx.split(model.blocks.layers)
        paths = tuple(BLOCKS_PREFIX + "layers/" + "/".join(map(str, p))
                      for p, _ in nnx.to_flat_state(state))
        self.block = _Block(graphdef, jax.tree.structure(state), paths)
        self.num_layers = model.blocks.num_layers
        self.num_buffers = max(self.table.num_pipe_buffers)
        self.remat = step.config.remat          # what a forward keeps for its backward

    # ------------------------------------------------------------------------------------------
    def describe(self) -> str:
        """Which stage holds which layers, and the schedule's shape."""
        t = self.table
        return (self.split.describe() + f"\nschedule: {t.schedule}, {t.micro_batches} "
                f"micro-batches, {t.num_steps} steps, {self.num_buffers} stash buffers, bubble "
                f"{t.bubble_fraction:.3f}")

    def check_batch(self, batch: Any) -> None:
        """ValueError unless the global batch splits into data replicas x micro_batches (other
        batch errors are left to `zeroxla.engine.batch_checks`); the loss is cut at the stack
        on the batch's micro-batch shapes (`StagedLoss.check`)."""
        if not isinstance(batch, dict) or not batch or not np.shape(next(iter(batch.values()))):
            return
        batch_size = int(np.shape(next(iter(batch.values())))[0])
        n, m = self.step.data_size, self.config.micro_batches
        if batch_size % (n * m):
            raise ValueError(
                f"PipelineConfig.micro_batches={m} does not divide the per-replica batch "
                f"(global batch {batch_size} over {n} data-parallel replicas); accepted: "
                f"a global batch that is a multiple of {n * m}, or micro_batches dividing "
                f"{batch_size // n if batch_size % n == 0 else batch_size / n}")
        self.loss.check(jax.tree.map(
            lambda v: jax.ShapeDtypeStruct((batch_size // (n * m), *np.shape(v)[1:]),
                                           jnp.result_type(v)), dict(batch)))

    def _work(self, segment: Segment) -> list[dict[int, set[int]]]:
        """Per unrolled step of `segment`: op -> the stages that run it there in some repeat
        (the branches that step's compiled code holds)."""
        works = []
        for p in range(segment.period):
            work: dict[int, set[int]] = {}
            for t in range(segment.start + p, segment.stop, segment.period):
                for s, op in enumerate(self.table.op[t]):
                    work.setdefault(op, set()).add(s)
            works.append(work)
        return works

    def branch_executions(self) -> dict[str, tuple[int, int]]:
        """{scope: (compiled runs, real runs)} of the forward and backward branches, for the
        comm report (`zeroxla.analysis.comm_report`). A compiled step holding a branch runs its
        code `repeats` times as far as the loops say, whichever stages take it; a device really
        runs M forwards and M backwards per step. The collectives under `FORWARD_SCOPE` /
        `BACKWARD_SCOPE` then count M / (compiled runs) of their loop multiplier; that is exact
        in the per-device total because every compiled copy of a branch holds the same
        collectives and no branch inside them does (the blocks run outside the first/last-stage
        conds)."""
        compiled = {FORWARD: 0, BACKWARD: 0}
        for segment in self.segments:
            for work in self._work(segment):
                for op in compiled:
                    compiled[op] += segment.repeats if op in work else 0
        m = self.config.micro_batches
        return {FORWARD_SCOPE: (compiled[FORWARD], m), BACKWARD_SCOPE: (compiled[BACKWARD], m)}

    def _gathers_per_micro_batch(self, leaf: Any) -> bool:
        return (leaf.params_partitioned and leaf.stacked
                and self.config.zero3_gather == "micro_batch")

    # ------------------------------------------------------------------------------------------
    # Inside shard_map: one device's arrays.
    def local_gradients(self, params: dict[str, Any], batch: dict[str, Any], scale: jax.Array,
                        model_state: dict[str, Any], key_data: Any
                        ) -> tuple[jax.Array, dict[str, jax.Array], dict[str, Any]]:
        """`ZeroStep._local_gradients`' contract: (global mean loss, reduced gradients of the
        trainable leaves times `scale`, model state)."""
        del key_data                                  # no RNG streams (checks.check_step)
        step, axes, plan = self.step, self.step.axes, self.step.plan
        dtype = step.config.dtype
        S, M = self.stages, self.config.micro_batches
        stage = lax.axis_index(axes.stage) if S > 1 else jnp.int32(0)
        is_first, is_last = stage == 0, stage == S - 1
        index = jnp.asarray(np.asarray(self.split.layer_index(), np.int32))[stage]  # [Lmax]
        mask = jnp.asarray(np.asarray(self.split.layer_mask(), bool))[stage]        # [Lmax]

        # 1. This stage's values of every leaf (stacked leaves: its Lmax layer slots, stored
        #    on this stage when split over the stages, `zeroxla.pipeline.storage`).
        values = {}
        for leaf in plan.leaves:
            v = params[leaf.path]
            if leaf.stacked and not leaf.stage_split:
                v = jnp.take(v, index, axis=0)                     # [Lmax, ...]
            if self._gathers_per_micro_batch(leaf):
                values[leaf.path] = v                              # shards; GatheredStack
            elif leaf.params_partitioned:                          # once per step
                with jax.named_scope(collectives.FWD_GATHER):
                    full = all_gather_dim(v.astype(dtype), axes.data, leaf.shard_dim)
                values[leaf.path] = leaf.data_unpad(full)
            else:
                values[leaf.path] = v.astype(dtype)
        trainable = {leaf.path: values[leaf.path] for leaf in plan.trainable_leaves}
        frozen = {p: v for p, v in values.items() if p not in trainable}

        stack = None
        if any(self._gathers_per_micro_batch(plan[p]) for p in self.block.paths):
            lmax = self.split.max_layers
            leaves = tuple(stage_local(plan[p], lmax) for p in self.block.paths)
            stack = GatheredStack(self.block, leaves, step.comm, step.config.prefetch,
                                  remat=self.remat)

        def model_of(p):
            return step.model_def.module({**frozen, **p}, {}, None)

        def embed(p, micro):                                   # -> [mb, T, D]
            """The model's computation up to its stack: the first stage's forward."""
            return stack_input(self.loss.terms, model_of(p), micro)[0].astype(dtype)

        def stack_args(micro):                                 # e.g. (positions [mb, T],)
            """The stack's other arguments; parameter-free (`check_stages`), so constants."""
            return stop_gradients(stack_input(self.loss.terms, model_of(trainable), micro)[1])

        def blocks_of(full, x, consts):                        # [mb, T, D] -> [mb, T, D]
            if stack is not None:                              # full: the blocks' shards
                return stack(full, x, consts, mask)[0]

            def body(h, per_layer):
                layer, keep = per_layer
                return self.block(layer, h, consts, keep)[0], None
            return lax.scan(body, x, (full, mask))[0]

        def blocks(p, x, consts):
            return blocks_of([{**frozen, **p}[path] for path in self.block.paths], x, consts)

        # remat "none" (or a checkpoint policy): forward keeps the blocks' vjp residuals less
        # the parameters (`linearize_keeping`: a residual that *is* a parameter or shard is
        # taken from `block_full` again in backward, never stashed per buffer). A GatheredStack
        # applies the policy per layer itself, so the vjp around it keeps no policy of its own.
        block_leaves = tuple(plan[path] for path in self.block.paths)
        block_full = [values[path] for path in self.block.paths]
        policy = remat.NONE if stack is not None else self.remat

        def linearized_blocks(x, consts):                      # (y, kept, layout)
            return remat.linearize_keeping(lambda full, x: blocks_of(full, x, consts),
                                           block_leaves, block_full, x, policy)

        def head_terms(p, y, micro):                            # (loss sum, token count)
            """The model's computation after its stack, and the loss: the last stage's."""
            return loss_after_stack(self.loss.terms, model_of(p), micro, y)

        # 2. Micro-batches: [B_local, ...] -> [M, mb, ...].
        micro_batches = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]),
                                     batch)
        first_micro = jax.tree.map(lambda a: a[0], micro_batches)
        # static: loss sums are differentiated / c0 (a loss returning a mean counts 1)
        c0 = normalizer(first_micro) if self.loss.is_sum() else 1.0
        seed = scale / c0
        act = jax.eval_shape(embed, trainable, first_micro)
        zeros_act = jnp.zeros(act.shape, act.dtype)
        f32 = jnp.float32
        keeps_residuals = self.remat != remat.FULL
        layouts: list[Any] = []       # the blocks' vjp layout: static, the same in every trace
        kept_shapes: list[Any] = []   # each kept residual's shape, per buffer
        if keeps_residuals:
            def probe(x, consts):
                _, kept, layout = linearized_blocks(x, consts)
                layouts.append(layout)
                return kept
            kept_shapes = jax.eval_shape(probe, act, stack_args(first_micro))

        def compute(c, row, work):
            """This stage's work in one step. `row` holds the step's [S] op / micro-batch /
            buffer; `work` (static) maps each op to the stages that may run it in this step:
            only those branches are built (no backward in a forward-only step, no embedding
            where the first stage runs no forward, ...), which keeps the unrolled steps cheap
            to compile. Returns (carry, forward output or zeros, input gradient or zeros)."""
            op, m, buf = (jnp.maximum(row[k][stage], 0) for k in ("op", "micro_batch", "buffer"))
            micro = jax.tree.map(lambda a: a[m], micro_batches)
            consts = stack_args(micro)

            def branch(pred, stages, where, true_fn, false_fn):
                """`lax.cond(pred, ...)`, or the one side any of `stages` takes."""
                sides = {where(s) for s in stages}
                if sides == {True}:
                    return true_fn()
                if sides == {False}:
                    return false_fn()
                return lax.cond(pred, true_fn, false_fn)

            def first(s):
                return s == 0

            def last(s):
                return s == S - 1

            def idle(c):
                return c, zeros_act, zeros_act

            def forward(c):
                fwd = work[FORWARD]
                with jax.named_scope(FORWARD_SCOPE):
                    x = branch(is_first, fwd, first, lambda: embed(trainable, micro),
                               lambda: c["act"])
                    if not keeps_residuals:               # remat "full": keep the input only
                        y = blocks(trainable, x, consts)
                        total, count = branch(is_last, fwd, last,
                                              lambda: head_terms(trainable, y, micro),
                                              lambda: (f32(0), f32(0)))
                        return ({**c, "stash": c["stash"].at[buf].set(x),
                                 "total": c["total"] + total, "count": c["count"] + count},
                                y.astype(act.dtype), zeros_act)
                    y, kept, layout = linearized_blocks(x, consts)
                    if layout.slots != layouts[0].slots:
                        raise AssertionError("the stage's residuals differ between traces")

                    def with_head():
                        # The loss's cotangent is known now, so the head's backward runs here
                        # and only its input gradient d_y [mb, T, D] waits for the backward.
                        def loss(p, y):
                            total, count = head_terms(p, y, micro)
                            return total * seed, (total, count)
                        _, pullback, (total, count) = jax.vjp(loss, trainable, y,
                                                              has_aux=True)
                        d_p, d_y = pullback(f32(1))
                        return (total, count, accumulate(c["grads"], d_p),
                                d_y.astype(act.dtype))

                    total, count, grads, d_y = branch(
                        is_last, fwd, last, with_head,
                        lambda: (f32(0), f32(0), c["grads"], zeros_act))
                    return ({**c, "stash": c["stash"].at[buf].set(d_y), "grads": grads,
                             "kept": [k.at[buf].set(v) for k, v in zip(c["kept"], kept)],
                             "total": c["total"] + total, "count": c["count"] + count},
                            y.astype(act.dtype), zeros_act)

            def backward(c):
                bwd = work[BACKWARD]
                with jax.named_scope(BACKWARD_SCOPE):
                    if keeps_residuals:                   # the blocks' kept vjp, no recompute
                        d_y = branch(is_last, bwd, last, lambda: c["stash"][buf],
                                     lambda: c["grad"])
                        kept = [k[buf] for k in c["kept"]]
                        d_full, d_x = layouts[0].cotangents(kept, block_full, d_y)
                        d_p = dict(zip(self.block.paths, d_full))   # the blocks' leaves only
                    else:                                 # remat "full": recompute the stage
                        # The blocks' recompute and vjp sit outside the last-stage branch, so
                        # their collectives are in the program once (`branch_executions`).
                        y, pullback = jax.vjp(lambda p, x: blocks(p, x, consts), trainable,
                                              c["stash"][buf])

                        def with_head():
                            def loss(p, y):
                                return head_terms(p, y, micro)[0] * seed
                            d_head, d_y = jax.vjp(loss, trainable, y)[1](f32(1))
                            return d_head, d_y.astype(act.dtype)

                        d_head, d_y = branch(
                            is_last, bwd, last, with_head,
                            lambda: (jax.tree.map(jnp.zeros_like, trainable), c["grad"]))
                        d_p, d_x = pullback(d_y.astype(y.dtype))
                        d_p = jax.tree.map(lambda a, b: a + b.astype(a.dtype), d_p, d_head)
                    d_embed = branch(
                        is_first, bwd, first,
                        lambda: jax.vjp(lambda p: embed(p, micro), trainable)[1](d_x)[0],
                        lambda: jax.tree.map(jnp.zeros_like, trainable))
                    grads = accumulate(accumulate(c["grads"], d_p), d_embed)
                    return {**c, "grads": grads}, zeros_act, d_x.astype(act.dtype)

            branches = {IDLE: idle, FORWARD: forward, BACKWARD: backward}
            ops = sorted(work)
            if len(ops) == 1:
                return branches[ops[0]](c)
            index = jnp.asarray([ops.index(o) if o in ops else 0 for o in sorted(branches)],
                                jnp.int32)[op]
            return lax.switch(index, [branches[o] for o in ops], c)

        def accumulate(grads, d_p):                 # float32 sums; d_p: some or all paths
            return {**grads, **{path: grads[path] + d.astype(f32) for path, d in d_p.items()
                                if d is not None}}

        def send(out, senders, hop):
            """`out` of each stage in `senders` to stage + hop, one ppermute per pair (one per
            DeepSpeed Send instruction); the other stages receive zeros, hence the sum."""
            received = [lax.ppermute(out, axes.stage, [(s, s + hop)]) for s in senders]
            return sum(received[1:], received[0]) if received else zeros_act

        def tick(c, row, work, sends: StepSends):
            c, act_out, grad_out = compute(c, row, work)
            # What this step computed is the neighbour's input in the next step.
            return {**c, "act": send(act_out, sends.activations, +1),
                    "grad": send(grad_out, sends.grads, -1)}

        # Per buffer: the stage input (remat "full"), or the last stage's head gradient d_y
        # and the blocks' kept residuals (remat "none" / a policy).
        carry = {"stash": jnp.zeros((self.num_buffers, *act.shape), act.dtype),  # [NB, mb, T, D]
                 "kept": [jnp.zeros((self.num_buffers, *k.shape), k.dtype) for k in kept_shapes],
                 "act": zeros_act, "grad": zeros_act,
                 "grads": jax.tree.map(lambda v: jnp.zeros(v.shape, f32), trainable),
                 "total": f32(0), "count": f32(0)}
        rows = {k: v for k, v in self.table.as_arrays().items()
                if k in ("op", "micro_batch", "buffer")}                       # [T, S] each
        sends = step_sends(self.table)                                         # [T]
        for segment in self.segments:
            # One scan per segment: `repeats` trips of `period` unrolled steps, each with its
            # static sends, so the compiled permutes run exactly as often as the table sends.
            xs = {k: jnp.asarray(v[segment.start:segment.stop].reshape(
                segment.repeats, segment.period, S)) for k, v in rows.items()}  # [R, P, S]
            phases = [(work, sends[segment.start + p])
                      for p, work in enumerate(self._work(segment))]

            def body(c, xs, phases=tuple(phases)):
                for p, (work, sent) in enumerate(phases):
                    c = tick(c, {k: v[p] for k, v in xs.items()}, work, sent)
                return c, None
            carry, _ = lax.scan(body, carry, xs)

        # 3. Back to the plan's layout, reduced over data. A stage-split leaf's gradient is this
        #    stage's slots, already where it is stored; the others (the embedding, the head,
        #    GPT-2's tied wte) are summed over the stages.
        grads = {}
        for path, g in carry["grads"].items():
            leaf = plan[path]
            local = stage_local(leaf, self.split.max_layers) if leaf.stage_split else leaf
            if leaf.params_partitioned and not self._gathers_per_micro_batch(leaf):
                g = collectives.scatter_full_gradient(g, local, axes)    # [Lmax?, shard]
            if not leaf.stage_split:
                if leaf.stacked:
                    g = jnp.zeros((self.num_layers, *g.shape[1:]), f32).at[index].add(g)
                g = lax.psum(g, axes.stage) if S > 1 else g
            if leaf.params_partitioned:
                grads[path] = g                                  # reduced over data above
            elif step.config.stage == 2 and leaf.optimizer_partitioned:
                grads[path] = collectives.scatter_full_gradient(g, local, axes)
            else:
                grads[path] = collectives.all_reduce(g, axes)
        data_and_stage = (axes.stage, *axes.data) if S > 1 else axes.data
        total = lax.psum(carry["total"], data_and_stage)
        count = lax.psum(carry["count"], data_and_stage)
        count = jnp.where(count > 0, count, 1.0)
        return total / count, jax.tree.map(lambda g: g * (c0 / count), grads), model_state
