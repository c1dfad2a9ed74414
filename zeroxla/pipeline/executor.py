"""The pipeline executor: any schedule table run as ONE SPMD program inside the ZeRO step.

`make_step(..., pipeline=PipelineConfig(...))` replaces the step's gradient pass with
`PipelineExecutor.local_gradients`, which runs inside the same `shard_map` as the ZeRO step.
Every device runs the same program; its stage is `lax.axis_index("stage")`. The schedule
(1F1B, GPipe or ZB-H1) is data: `schedule_table` gives int32 grids [T, S] of (op, micro-batch,
buffer), and the executor runs the T steps as one `lax.scan` per phase (`table.phases`: the
one-op warm-up, the mixed middle, the one-op cool-down):

    for each phase:                                lax.scan over its rows of the table
        op = table.op[t, stage]                    lax.switch: idle / forward / backward
                                                   (/ weight-gradient pass, ZB-H1), the
                                                   ops the phase holds
        sends = table.step_sends[t]                lax.switch over the phase's distinct
                                                   sends, the same branch on every device
            for each stage pair sending this step (static in the branch):
                one lax.ppermute over "stage": activation s -> s + 1, or gradient s -> s - 1

so each executed collective-permute is one DeepSpeed SendActivation / SendGrad instruction
(M (S - 1) of each per data replica), not a permute of every pair on every step.
A new schedule is a new table, not a new executor (`checks.check_table` states what a table must
satisfy: a stage's input arrives from its neighbour's compute of the step before). A step's
forward, backward and weight-gradient pass run under `FORWARD_SCOPE` / `BACKWARD_SCOPE` /
`WEIGHT_SCOPE`, and the sends of the k-th distinct pattern under `send_scope(k)`
(`jax.named_scope`), so the HLO names which collectives belong to a schedule op, and
`branch_executions` says how often each branch runs.

Each op is compiled once per phase holding it, whatever S and M (the phases' switches hold
only the ops some stage runs there); the sends' switches have one small branch per distinct
pattern (fewer than 4S whatever M: 11 for 1F1B on 4 stages), so the program does not grow
with M. gpt-tiny on 4 stages, AdamW, on the 2-core development machine: 1F1B at M = 8 is
1.7 MB of HLO text, 0.9 s to lower and 4.2 s to compile; ZB-H1 at M = 16 1.5 MB, 0.9 s and
3.8 s.

Forward on stage s (`zeroxla.pipeline.passes`): x = the model's computation up to its stack on
the first stage (its own `__call__` and loss, cut at `blocks`: `zeroxla.pipeline.stages`), else
the activation received; the stage's blocks run; on the last stage the rest of `__call__` and
the loss (the default or the user's `loss_fn`) too. What the forward keeps in stash buffer
`buffer` for its backward is `ZeroConfig.remat` (`zeroxla.engine.remat`), as in the plain step:
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
The stash has `max(num_pipe_buffers)` buffers: 1F1B's min(S, M) (at least 2), GPipe's M,
ZB-H1's min(S, M) (a buffer lives from F to W). ZB-H1 splits the backward into B (input
gradient) and W (weight gradient); under remat "none" / a policy each buffer also holds the
cotangents B stashes for a weight-only W ("wstash", `StagePasses.buffer_shapes`); what
each computes and keeps: `zeroxla.pipeline.passes`.

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

from collections.abc import Callable
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
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.loss import normalizer
from zeroxla.pipeline.checks import check_step, check_table
from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.passes import BACKWARD_SCOPE, FORWARD_SCOPE, WEIGHT_SCOPE, StagePasses
from zeroxla.pipeline.stage_model import Block, StageModel
from zeroxla.pipeline.split import BLOCKS_PREFIX, StageSplit, layer_list, split_stages
from zeroxla.pipeline.stages import StageCut, StagedLoss
from zeroxla.pipeline.storage import pipelined_plan, stage_local
from zeroxla.pipeline.table import (BACKWARD, FORWARD, WEIGHT, Phase, ScheduleTable,
                                    StepSends, phases, schedule_table, step_sends)


class PipelineExecutor:
    """The pipelined gradient pass of a `ZeroStep` (see the module docstring).

    Built from the whole model's `ZeroLayout`; `self.layout` is the same layout storing each
    stage's layers only (`zeroxla.pipeline.storage.pipelined_plan`), which the step runs."""

    def __init__(self, layout: ZeroLayout, config: PipelineConfig):
        check_step(layout, config)
        self.config = config
        self.stages = layout.axes.num_stages
        model = layout.model_def.abstract_module()
        self.loss = StagedLoss(layout.loss_fn, layout.model_def)
        self.cut: StageCut = self.loss.model_cut()
        self.split: StageSplit = split_stages(
            layer_list(model, layout.model_def.shape_dict(), self.cut.embed_paths,
                       self.cut.head_paths), self.stages, config.partition_method)
        self.layout: ZeroLayout = layout.with_plan(
            pipelined_plan(layout.plan, self.split, layout.axes))
        self.table: ScheduleTable = schedule_table(config.schedule_class, config.micro_batches,
                                                   self.stages)
        check_table(self.table)
        # The distinct per-step sends, in order of first use (`_exchange`'s branches).
        self.send_patterns: tuple[StepSends, ...] = tuple(
            dict.fromkeys(step_sends(self.table)))
        self.phases: tuple[Phase, ...] = phases(self.table)     # one loop each
        graphdef, state = nnx.split(model.blocks.layers)
        paths = tuple(BLOCKS_PREFIX + "layers/" + "/".join(map(str, p))
                      for p, _ in nnx.to_flat_state(state))
        self.block = Block(graphdef, jax.tree.structure(state), paths)
        self.num_layers = model.blocks.num_layers
        self.num_buffers = max(self.table.num_pipe_buffers)
        self.remat = layout.config.remat        # what a forward keeps for its backward
        self.splits_backward = any(WEIGHT in row for row in self.table.op)      # ZB-H1

    # ------------------------------------------------------------------------------------------
    def describe(self) -> str:
        """Which stage holds which layers, and the schedule's shape."""
        t = self.table
        passes = ("forward, input-gradient backward B and weight-gradient pass W per "
                  "micro-batch, " if self.splits_backward else "")
        weight = ("" if not self.splits_backward else
                  "\nW: recomputes the stage's forward and vjp (remat \"full\")"
                  if self.remat == remat.FULL else
                  "\nW: weight-only (the blocks' vjp split per op, B stashing the cotangents "
                  "W reads; where the split cannot place an equation it warns and re-applies "
                  "the whole vjp)")
        return (self.split.describe() + f"\nschedule: {t.schedule}, {t.micro_batches} "
                f"micro-batches, {passes}{t.num_steps} steps, {self.num_buffers} stash buffers, "
                f"bubble {t.bubble_fraction:.3f}" + weight)

    def check_batch(self, batch: Any) -> None:
        """ValueError unless the global batch splits into data replicas x micro_batches (other
        batch errors are left to `zeroxla.engine.batch_checks`); the loss is cut at the stack
        on the batch's micro-batch shapes (`StagedLoss.check`)."""
        if not isinstance(batch, dict) or not batch or not np.shape(next(iter(batch.values()))):
            return
        batch_size = int(np.shape(next(iter(batch.values())))[0])
        n, m = self.layout.data_size, self.config.micro_batches
        if batch_size % (n * m):
            raise ValueError(
                f"PipelineConfig.micro_batches={m} does not divide the per-replica batch "
                f"(global batch {batch_size} over {n} data-parallel replicas); accepted: "
                f"a global batch that is a multiple of {n * m}, or micro_batches dividing "
                f"{batch_size // n if batch_size % n == 0 else batch_size / n}")
        self.loss.check(jax.tree.map(
            lambda v: jax.ShapeDtypeStruct((batch_size // (n * m), *np.shape(v)[1:]),
                                           jnp.result_type(v)), dict(batch)))

    def _work(self, phase: Phase) -> dict[int, set[int]]:
        """op -> the stages that run it in some step of `phase` (the branches its switch
        holds)."""
        work: dict[int, set[int]] = {}
        for row in self.table.op[phase.start:phase.stop]:
            for s, op in enumerate(row):
                work.setdefault(op, set()).add(s)
        return work

    def branch_executions(self) -> dict[str, tuple[int, int]]:
        """{scope: (compiled runs, real runs)} of the branches in the phases' loops, for the
        comm report (`zeroxla.analysis.comm_report`). A branch compiled into a phase's loop
        runs its code once per step of that phase as far as the loop says, whichever stages
        take it; a device really runs M forwards, backwards (and ZB-H1 weight passes) per
        step, and each pattern of sends (`send_scope(k)`) as often as the table has it. The
        collectives under a scope then count (real runs) / (compiled runs) of their loop
        multiplier: exact in the per-device total, because every compiled copy of a branch
        holds the same collectives."""
        scopes = {FORWARD: FORWARD_SCOPE, BACKWARD: BACKWARD_SCOPE}
        if self.splits_backward:
            scopes[WEIGHT] = WEIGHT_SCOPE
        sends = step_sends(self.table)
        M = self.config.micro_batches
        runs = {}
        for op, scope in scopes.items():
            runs[scope] = (sum(p.stop - p.start for p in self.phases if op in p.ops), M)
        for k, pattern in enumerate(self.send_patterns):
            compiled = sum(p.stop - p.start for p in self.phases
                           if pattern in sends[p.start:p.stop])
            runs[send_scope(k)] = (compiled, sends.count(pattern))
        return runs

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
        axes = self.layout.axes
        S, M = self.stages, self.config.micro_batches
        stage = lax.axis_index(axes.stage) if S > 1 else jnp.int32(0)
        is_first, is_last = stage == 0, stage == S - 1
        index = jnp.asarray(np.asarray(self.split.layer_index(), np.int32))[stage]  # [Lmax]
        mask = jnp.asarray(np.asarray(self.split.layer_mask(), bool))[stage]        # [Lmax]
        # 1. This stage's values of every leaf, and the model's pieces over them.
        model = self._stage_model(self._stage_values(params, index), mask)

        # 2. Micro-batches: [B_local, ...] -> [M, mb, ...], run through the schedule.
        micro_batches = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]),
                                     batch)
        first_micro = jax.tree.map(lambda a: a[0], micro_batches)
        # static: loss sums are differentiated / c0 (a loss returning a mean counts 1)
        c0 = normalizer(first_micro) if self.loss.is_sum() else 1.0
        seed = scale / c0
        act = jax.eval_shape(model.embed, model.trainable, first_micro)     # [mb, T, D]
        passes = StagePasses(model, S, is_first, is_last, stage, micro_batches, seed, act,
                             jnp.zeros(act.shape, act.dtype), self.remat != remat.FULL,
                             self.splits_backward)
        consts = model.stack_args(first_micro)
        kept_shapes, stash_shapes = (passes.buffer_shapes(consts) if passes.keeps_residuals
                                     else ([], []))
        carry = self._run_schedule(passes, kept_shapes, stash_shapes)

        # 3. Back to the plan's layout, reduced over data; the loss over data and stages.
        grads = self._reduce_gradients(carry["grads"], index)
        data_and_stage = (axes.stage, *axes.data) if S > 1 else axes.data
        total = lax.psum(carry["total"], data_and_stage)
        count = lax.psum(carry["count"], data_and_stage)
        count = jnp.where(count > 0, count, 1.0)
        return total / count, jax.tree.map(lambda g: g * (c0 / count), grads), model_state

    def _stage_values(self, params: dict[str, Any], index: jax.Array) -> dict[str, Any]:
        """This stage's value of every leaf, in the compute dtype. Stacked leaves: its Lmax
        layer slots (`index` [Lmax]), stored on this stage when split over the stages
        (`zeroxla.pipeline.storage`). ZeRO-3 leaves are gathered here once per step, unless
        the blocks gather per micro-batch (then they stay shards for the `GatheredStack`)."""
        layout, axes = self.layout, self.layout.axes
        dtype = layout.config.dtype
        values = {}
        for leaf in layout.plan.leaves:
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
        return values

    def _stage_model(self, values: dict[str, Any], mask: jax.Array) -> StageModel:
        """The model's pieces on this stage over `values` (`_stage_values`); `mask` [Lmax]."""
        layout, plan = self.layout, self.layout.plan
        trainable = {leaf.path: values[leaf.path] for leaf in plan.trainable_leaves}
        frozen = {p: v for p, v in values.items() if p not in trainable}
        stack = None
        if any(self._gathers_per_micro_batch(plan[p]) for p in self.block.paths):
            lmax = self.split.max_layers
            leaves = tuple(stage_local(plan[p], lmax) for p in self.block.paths)
            stack = GatheredStack(self.block, leaves, layout.comm, layout.config.prefetch,
                                  remat=self.remat,
                                  max_live_parameters=layout.config.max_live_parameters)
        # remat "none" (or a checkpoint policy): forward keeps the blocks' vjp residuals less
        # the parameters (`StageModel.linearized_blocks`). A GatheredStack applies the policy
        # per layer itself, so the vjp around it keeps no policy of its own.
        return StageModel(
            loss=self.loss, model_def=layout.model_def, block=self.block, trainable=trainable,
            frozen=frozen, mask=mask, stack=stack,
            block_leaves=tuple(plan[path] for path in self.block.paths),
            block_full=[values[path] for path in self.block.paths],
            policy=remat.NONE if stack is not None else self.remat, dtype=layout.config.dtype)

    def _run_schedule(self, passes: StagePasses, kept_shapes: list[Any],
                      stash_shapes: list[Any]) -> dict[str, Any]:
        """The table's T steps on this stage, one `lax.scan` per phase. Returns the last carry:
        the float32 gradient sums "grads" and the loss sum "total" over "count" tokens.
        `stash_shapes`: what ZB-H1's B stashes for W per buffer (remat "none" / a policy)."""
        act, zeros_act, axis = passes.act, passes.zeros_act, self.layout.axes.stage
        trainable = passes.model.trainable

        # Per buffer: the stage input (remat "full"), or the last stage's head gradient d_y
        # and the blocks' kept residuals (remat "none" / a policy).
        carry = {"stash": jnp.zeros((self.num_buffers, *act.shape), act.dtype),  # [NB, mb, T, D]
                 "kept": [jnp.zeros((self.num_buffers, *k.shape), k.dtype) for k in kept_shapes],
                 "act": zeros_act, "grad": zeros_act,
                 "grads": jax.tree.map(lambda v: jnp.zeros(v.shape, jnp.float32), trainable),
                 "total": jnp.float32(0), "count": jnp.float32(0)}
        if self.splits_backward and passes.keeps_residuals:   # B's per-op cotangents for W
            carry["wstash"] = [jnp.zeros((self.num_buffers, *s.shape), s.dtype)
                               for s in stash_shapes]
        if self.splits_backward and not passes.keeps_residuals:   # B's d_y for W, remat "full"
            carry["cot"] = jnp.zeros((self.num_buffers, *act.shape), act.dtype)  # [NB, mb, T, D]
        rows = {k: v for k, v in self.table.as_arrays().items()
                if k in ("op", "micro_batch", "buffer")}                       # [T, S] each
        sends = step_sends(self.table)                                         # [T]
        for phase in self.phases:
            # One lax.scan per phase; its steps' sends switch over the patterns it holds,
            # keyed by their index in the table's (`send_scope`).
            steps = sends[phase.start:phase.stop]
            used = {self.send_patterns.index(p): p for p in dict.fromkeys(steps)}
            branch_of = {p: i for i, p in enumerate(used.values())}       # switch index
            xs = {"row": {k: jnp.asarray(v[phase.start:phase.stop]) for k, v in rows.items()},
                  "pattern": jnp.asarray([branch_of[p] for p in steps], jnp.int32)}  # [P, S], [P]

            def tick(c, x, work=self._work(phase), used=used):
                c, act_out, grad_out = passes.compute(c, x["row"], work)
                # What this step computed is the neighbour's input in the next step.
                act_in, grad_in = _exchange(act_out, grad_out, x["pattern"], used, axis,
                                            zeros_act)
                return {**c, "act": act_in, "grad": grad_in}, None
            carry, _ = lax.scan(tick, carry, xs)
        return carry

    def _reduce_gradients(self, grads: dict[str, Any], index: jax.Array) -> dict[str, Any]:
        """The accumulated float32 gradients in the plan's layout, reduced over data. A
        stage-split leaf's gradient is this stage's slots (`index` [Lmax]), already where it is
        stored; the others (the embedding, the head, GPT-2's tied wte) are summed over the
        stages."""
        layout, axes, S = self.layout, self.layout.axes, self.stages
        reduced = {}
        for path, g in grads.items():
            leaf = layout.plan[path]
            local = stage_local(leaf, self.split.max_layers) if leaf.stage_split else leaf
            if leaf.params_partitioned and not self._gathers_per_micro_batch(leaf):
                g = collectives.scatter_full_gradient(g, local, axes)    # [Lmax?, shard]
            if not leaf.stage_split:
                if leaf.stacked:
                    g = jnp.zeros((self.num_layers, *g.shape[1:]), jnp.float32).at[index].add(g)
                g = lax.psum(g, axes.stage) if S > 1 else g
            if leaf.params_partitioned:
                reduced[path] = g                                # reduced over data above
            elif layout.config.stage == 2 and leaf.optimizer_partitioned:
                reduced[path] = collectives.scatter_full_gradient(g, local, axes)
            else:
                reduced[path] = collectives.all_reduce(g, axes)
        return reduced


def _send(out: jax.Array, senders: tuple[int, ...], hop: int, axis: str, zeros: jax.Array
          ) -> jax.Array:
    """`out` of each stage in `senders` to stage + hop, one ppermute per pair (one per
    DeepSpeed Send instruction); the other stages receive zeros, hence the sum."""
    received = [lax.ppermute(out, axis, [(s, s + hop)]) for s in senders]
    return sum(received[1:], received[0]) if received else zeros


SEND_SCOPE = "pipeline_send"


def _exchange(act_out: jax.Array, grad_out: jax.Array, pattern: jax.Array,
              patterns: dict[int, StepSends], axis: str, zeros: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """This step's sends: activations to stage + 1 and input gradients to stage - 1 as the
    `pattern`-th of `patterns` (k -> the table's k-th distinct sends) says. Every stage takes
    the same branch (the pattern is the step's); branch k holds its permutes under
    `send_scope(k)`."""
    def branch(k: int) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        def run(a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
            with jax.named_scope(send_scope(k)):
                return (_send(a, patterns[k].activations, +1, axis, zeros),
                        _send(g, patterns[k].grads, -1, axis, zeros))
        return run
    branches = [branch(k) for k in patterns]
    if len(branches) == 1:
        return branches[0](act_out, grad_out)
    return lax.switch(pattern, branches, act_out, grad_out)


def send_scope(k: int) -> str:
    """The `jax.named_scope` of the sends of the table's k-th distinct pattern."""
    return f"{SEND_SCOPE}_{k}"
