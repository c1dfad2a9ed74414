"""The pipeline executor: any schedule table run as ONE SPMD program inside the ZeRO step.

`make_step(..., pipeline=PipelineConfig(...))` replaces the step's gradient pass with
`PipelineExecutor.local_gradients`, which runs inside the same `shard_map` as the ZeRO step.
Every device runs the same program; its stage is `lax.axis_index("stage")`. The schedule
(1F1B or GPipe) is data: `schedule_table` gives int32 grids [T, S] of (op, micro-batch,
buffer), and the executor is

    lax.scan over the T ticks:
        op = table.op[t, stage]        lax.switch: idle / forward / backward on this stage
        activations -> stage + 1, gradients -> stage - 1      (two lax.ppermute over "stage")

so a new schedule is a new table, not a new executor (`_check_table` states what a table must
satisfy: a stage's input arrives from its neighbour's compute of the step before).

Forward on stage s: x = embed(tokens) on the first stage, else the activation received; x is
stored in stash buffer `buffer` (the stage's *input* only); the stage's blocks run; on the last
stage the head and the loss too. Backward: the stage's forward is recomputed from the stashed
input under `jax.vjp` (plus the head and loss on the last stage, plus the embedding's vjp on
the first). Storing inputs instead of residuals keeps one activation [mb, T, D] per buffer, not
every layer's intermediates (attention scores [mb, H, T, T] included): DeepSpeed's pipeline
users turn on activation checkpointing for the same reason. The stash has
`max(num_pipe_buffers)` buffers: 1F1B's min(S, M) (at least 2), GPipe's M.

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
from zeroxla.engine.gather import GatheredStack
from zeroxla.engine.loss import next_token_loss, normalizer, token_cross_entropy
from zeroxla.models.layers import call_block, default_positions
from zeroxla.pipeline.config import PipelineConfig
from zeroxla.pipeline.split import BLOCKS_PREFIX, StageSplit, layer_list, split_stages
from zeroxla.pipeline.storage import stage_local
from zeroxla.pipeline.table import BACKWARD, FORWARD, IDLE, ScheduleTable, schedule_table


def _check_table(table: ScheduleTable) -> None:
    """The executor moves results one hop per tick: what a stage computes at tick t reaches its
    neighbour at tick t + 1. ValueError for a table whose forwards (backwards) do not follow the
    previous (next) stage's forward (backward) of the same micro-batch by exactly one tick."""
    S = table.stages
    for t, row in enumerate(table.op):
        for s, op in enumerate(row):
            neighbour = s - 1 if op == FORWARD else s + 1
            if op == IDLE or not 0 <= neighbour < S:
                continue
            ok = (t > 0 and table.op[t - 1][neighbour] == op
                  and table.micro_batch[t - 1][neighbour] == table.micro_batch[t][s])
            if not ok:
                raise ValueError(f"{table.schedule} step {t} stage {s}: its input was not "
                                 f"computed by stage {neighbour} at step {t - 1}; the pipeline "
                                 "executor needs one-hop-per-step tables (1F1B, GPipe)")


def _check_step(step: Any, config: PipelineConfig) -> None:
    """What the pipelined gradient pass does not support, refused by name."""
    if not isinstance(config, PipelineConfig):
        raise TypeError(f"make_step: pipeline must be a PipelineConfig, got "
                        f"{type(config).__name__}")
    zero = step.config
    if step.loss_fn is not next_token_loss:
        raise ValueError("make_step: loss_fn is not supported with pipeline= (the last stage "
                         "computes the default next-token loss); accepted: loss_fn=None")
    if step.model_def.state_paths or step.uses_rng:
        raise ValueError("make_step: pipeline= needs a model without model state or RNG streams "
                         f"(found {list(step.model_def.state_paths[:3])} "
                         f"{[p for p, _, _ in step.model_def.rng_leaves[:3]]}); accepted: "
                         "parameters only (no BatchNorm statistics, no Dropout)")
    frozen = [leaf.path for leaf in step.plan.leaves if not leaf.trainable]
    if frozen:      # the executor differentiates every parameter; frozen leaves are untested
        raise ValueError(f"make_step: trainable={step.trainable!r} freezes {frozen[:3]}, which "
                         "is not supported with pipeline= yet; accepted: trainable=None")
    if zero.uses_zeropp:
        raise ValueError("make_step: ZeRO++ (hpz_partition_size, quantized_weights, "
                         "quantized_gradients, quantized_nontrainable_weights) is not supported "
                         "with pipeline=; accepted: the plain ZeRO stages 0-3")
    k = zero.gradient_accumulation_steps
    if k not in (1, config.micro_batches):
        raise ValueError(f"ZeroConfig.gradient_accumulation_steps={k} with "
                         f"PipelineConfig.micro_batches={config.micro_batches}: under "
                         "pipelining the micro-batches are the accumulation steps; accepted: 1 "
                         f"or {config.micro_batches}")


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
        _check_step(step, config)
        self.step, self.config = step, config
        self.stages = step.axes.num_stages
        model = step.model_def.abstract_module()
        self.split: StageSplit = split_stages(layer_list(model, step.model_def.shape_dict()),
                                              self.stages, config.partition_method)
        self.table: ScheduleTable = schedule_table(config.schedule_class, config.micro_batches,
                                                   self.stages)
        _check_table(self.table)
        graphdef, state = nnx.split(model.blocks.layers)
        paths = tuple(BLOCKS_PREFIX + "layers/" + "/".join(map(str, p))
                      for p, _ in nnx.to_flat_state(state))
        self.block = _Block(graphdef, jax.tree.structure(state), paths)
        self.num_layers = model.blocks.num_layers
        self.num_buffers = max(self.table.num_pipe_buffers)

    # ------------------------------------------------------------------------------------------
    def describe(self) -> str:
        """Which stage holds which layers, and the schedule's shape."""
        t = self.table
        return (self.split.describe() + f"\nschedule: {t.schedule}, {t.micro_batches} "
                f"micro-batches, {t.num_steps} steps, {self.num_buffers} stash buffers, bubble "
                f"{t.bubble_fraction:.3f}")

    def check_batch(self, batch: Any) -> None:
        """ValueError unless the global batch splits into data replicas x micro_batches (other
        batch errors are left to `zeroxla.engine.batch_checks`)."""
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
        del key_data                                  # no RNG streams (_check_step)
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
            stack = GatheredStack(self.block, leaves, step.comm, step.config.prefetch)

        def model_of(p):
            return step.model_def.module({**frozen, **p}, {}, None)

        def embed(p, micro):                                   # -> [mb, T, D]
            tokens = micro["inputs"]
            return model_of(p).embed(tokens, default_positions(tokens)).astype(dtype)

        def blocks(p, x, positions):                           # [mb, T, D] -> [mb, T, D]
            full = [{**frozen, **p}[path] for path in self.block.paths]
            if stack is not None:
                return stack(full, x, (positions,), mask)[0]

            def body(h, per_layer):
                layer, keep = per_layer
                return self.block(layer, h, (positions,), keep)[0], None
            return lax.scan(body, x, (full, mask))[0]

        def head_terms(p, y, micro):                            # (loss sum, token count)
            return token_cross_entropy(model_of(p).head(y), micro)

        # 2. Micro-batches: [B_local, ...] -> [M, mb, ...].
        micro_batches = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]),
                                     batch)
        first_micro = jax.tree.map(lambda a: a[0], micro_batches)
        c0 = normalizer(first_micro)          # static: loss sums are differentiated / c0
        seed = scale / c0
        act = jax.eval_shape(embed, trainable, first_micro)
        zeros_act = jnp.zeros(act.shape, act.dtype)
        f32 = jnp.float32

        def tick(carry, row):
            op, m, buf = (jnp.maximum(row[k][stage], 0) for k in ("op", "micro_batch", "buffer"))
            micro = jax.tree.map(lambda a: a[m], micro_batches)
            positions = default_positions(micro["inputs"])

            def idle(c):
                return c, zeros_act, zeros_act

            def forward(c):
                x = lax.cond(is_first, lambda: embed(trainable, micro), lambda: c["act"])
                y = blocks(trainable, x, positions)
                total, count = lax.cond(is_last, lambda: head_terms(trainable, y, micro),
                                        lambda: (f32(0), f32(0)))
                c = {**c, "stash": c["stash"].at[buf].set(x), "total": c["total"] + total,
                     "count": c["count"] + count}
                return c, y.astype(act.dtype), zeros_act

            def backward(c):
                x = c["stash"][buf]                            # the stage input, recomputed

                def last():
                    def loss(p, x):
                        return head_terms(p, blocks(p, x, positions), micro)[0] * seed
                    return jax.vjp(loss, trainable, x)[1](f32(1))

                def middle():
                    return jax.vjp(lambda p, x: blocks(p, x, positions), trainable, x)[1](
                        c["grad"])

                d_p, d_x = lax.cond(is_last, last, middle)
                d_embed = lax.cond(
                    is_first, lambda: jax.vjp(lambda p: embed(p, micro), trainable)[1](d_x)[0],
                    lambda: jax.tree.map(jnp.zeros_like, trainable))
                grads = jax.tree.map(lambda g, a, b: g + a.astype(f32) + b.astype(f32),
                                     c["grads"], d_p, d_embed)
                return {**c, "grads": grads}, zeros_act, d_x.astype(act.dtype)

            carry, act_out, grad_out = lax.switch(op, [idle, forward, backward], carry)
            if S > 1:       # what this tick computed reaches the neighbour for the next tick
                carry = {**carry,
                         "act": lax.ppermute(act_out, axes.stage,
                                             [(s, s + 1) for s in range(S - 1)]),
                         "grad": lax.ppermute(grad_out, axes.stage,
                                              [(s + 1, s) for s in range(S - 1)])}
            return carry, None

        carry = {"stash": jnp.zeros((self.num_buffers, *act.shape), act.dtype),  # [NB, mb, T, D]
                 "act": zeros_act, "grad": zeros_act,
                 "grads": jax.tree.map(lambda v: jnp.zeros(v.shape, f32), trainable),
                 "total": f32(0), "count": f32(0)}
        rows = {k: jnp.asarray(v) for k, v in self.table.as_arrays().items()
                if k in ("op", "micro_batch", "buffer")}                       # [T, S] each
        assert IDLE == 0 and FORWARD == 1 and BACKWARD == 2     # lax.switch branch order
        carry, _ = lax.scan(tick, carry, rows)

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
