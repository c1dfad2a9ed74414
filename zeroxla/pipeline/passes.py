"""One stage's forward and backward passes: what a device computes in one schedule step.

    StagePasses    one schedule step on this stage: idle, forward, backward or (zero-bubble
                   schedules) weight-gradient pass, picked by `lax.switch` from the table's op;
                   only the branches some stage takes in that step are built
                   (`zeroxla.pipeline.stage_model` holds the model's pieces it runs; each
                   branch returns a `zeroxla.pipeline.step_update.StepUpdate`, written into
                   the carry after the switch)

Everything here runs inside the ZeRO step's `shard_map`, on one device's arrays; the executor
(`zeroxla.pipeline.executor`, whose docstring says what a forward keeps for its backward under
each remat setting) builds one `StageModel` and one `StagePasses` per trace and scans the
table's steps over `StagePasses.compute`.

Zero-bubble schedules (ZB-H1, `zeroxla.pipeline.zero_bubble`) split the backward in two
(`StagePasses.splits_backward`):
  B (BACKWARD) computes only the cotangent d_x of the stage input, which is sent to stage - 1 at
      once, and stashes the stage output's cotangent d_y in the buffer: under remat "none" in
      "stash" (where the last stage's forward already put its head's d_y), under "full" in
      "cot". The first stage's embedding gradient (a scatter-add of d_x) is accumulated here,
      and under remat "full" the last stage's head gradient too (the head's vjp that yields d_y
      yields it): the blocks' parameter gradients are W's.
  W (WEIGHT) computes the blocks' parameter gradients.
      Under remat "none" / a checkpoint policy the blocks' kept vjp is split at the jaxpr level
      (`zeroxla.engine.weight_split`): B runs only the equations d_x needs and writes, into
      the buffer's "wstash" entries, the values of theirs that the weight gradients read (per
      parameter-consuming op its output cotangent, per layer; the norms' and biases' sums B
      takes itself); W runs only the weight-gradient equations (dW = x^T dy from the kept x
      and the stashed dy), about a weight pass's FLOPs. Under ZeRO-3 per-micro-batch gathers
      B gathers each layer (d_x reads it) and W reduce-scatters each layer's gradient, with no
      third gather. Where the split cannot place an equation it warns and W re-applies the
      whole kept vjp to d_y (B's chain recomputed: about a backward's FLOPs, still exact).
      Under remat "full" W recomputes the stage's forward from the stashed x and applies its
      vjp to the stashed d_y, by design (nothing is kept to split), gathering each layer again
      under per-micro-batch gathers. Under "step" gathers the accumulated gradients are
      reduce-scattered once after the schedule, as for 1F1B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zeroxla.engine.weight_split import WeightSplit
from zeroxla.pipeline.stage_model import StageModel
from zeroxla.pipeline.step_update import StepUpdate, add_gradients, gradient_sum, write_buffer
from zeroxla.pipeline.table import BACKWARD, FORWARD, IDLE, WEIGHT
from zeroxla.pipeline.weight_pass import WeightSplitChoice

# `jax.named_scope`s around a stage's forward and backward work, so an HLO reading can tell the
# collectives of each schedule op (ZeRO-3 gathers, reduce-scatters) from those of the loop.
FORWARD_SCOPE = "pipeline_forward"
BACKWARD_SCOPE = "pipeline_backward"
WEIGHT_SCOPE = "pipeline_weight"

f32 = jnp.float32


def _branch(pred: Any, sides: set[bool], true_fn: Callable, false_fn: Callable) -> Any:
    """`lax.cond(pred, ...)`, or the one side every stage that may run here takes (`sides`)."""
    if sides == {True}:
        return true_fn()
    if sides == {False}:
        return false_fn()
    return lax.cond(pred, true_fn, false_fn)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What one schedule step hands this stage's op: `work` (static) maps each op to the stages
    that may run it in this step; the rest is this stage's micro-batch and stash buffer."""

    work: dict[int, set[int]]
    micro: Any                      # the micro-batch [mb, ...]
    consts: tuple                   # the stack's other arguments for it
    buf: jax.Array                  # the stash buffer


@dataclasses.dataclass
class StagePasses:
    """This stage's work in a schedule step, on the carry `c`: {"stash", "kept", "act",
    "grad", "grads", "total", "count"} (`PipelineExecutor._run_schedule`)."""

    model: StageModel
    stages: int                     # S
    is_first: jax.Array             # this device is stage 0
    is_last: jax.Array              # this device is stage S - 1
    stage: jax.Array
    micro_batches: Any              # [M, mb, ...]
    seed: jax.Array                 # the loss's cotangent: scale / c0
    act: Any                        # a stage's input / output: ShapeDtypeStruct [mb, T, D]
    zeros_act: jax.Array            # [mb, T, D]
    keeps_residuals: bool           # remat is not "full": forward keeps the blocks' vjp
    splits_backward: bool = False   # the table has WEIGHT steps: BACKWARD is then B only
    layouts: list[Any] = dataclasses.field(default_factory=list)  # static, same every trace
    weight_choice: WeightSplitChoice = dataclasses.field(default_factory=WeightSplitChoice)

    def buffer_shapes(self, consts: tuple) -> tuple[list[Any], list[Any]]:
        """(kept, wstash) per buffer, as shapes: each residual the blocks' forward keeps and,
        zero-bubble, what B stashes for W (the blocks' per-op cotangents W reads; [] where the
        split falls back). One probe of the forward records the vjp's static layout for the
        forward and backward and decides the split for this trace's B and W branches
        (`zeroxla.pipeline.weight_pass`)."""
        wstash: list[Any] = []

        def probe(x, consts):
            _, kept, layout = self.model.linearized_blocks(x, consts)
            self.layouts.append(layout)
            if self.splits_backward:
                split = self._weight_split(kept, x)         # x: a d_y of the same shape
                wstash.extend([] if split is None else split.stash_shapes)
            return kept
        return jax.eval_shape(probe, self.act, consts), wstash

    def _weight_split(self, kept: list[Any], d_y: jax.Array) -> WeightSplit | None:
        """The blocks' kept pullback split into B (d_x, and a stash) and W (the weight
        gradients from the stash), or None where it falls back (warned)."""
        return self.weight_choice.split(self.layouts[0].cotangents, kept,
                                        self.model.block_full, d_y)

    def _if_first(self, stages: set[int], true_fn: Callable, false_fn: Callable) -> Any:
        return _branch(self.is_first, {s == 0 for s in stages}, true_fn, false_fn)

    def _if_last(self, stages: set[int], true_fn: Callable, false_fn: Callable) -> Any:
        return _branch(self.is_last, {s == self.stages - 1 for s in stages}, true_fn, false_fn)

    def compute(self, c: dict[str, Any], row: dict[str, Any], work: dict[int, set[int]]
                ) -> tuple[dict[str, Any], jax.Array, jax.Array]:
        """This stage's work in one step. `row` holds the step's [S] op / micro-batch /
        buffer; `work` (static) maps each op to the stages that may run it in this step:
        only those branches are built (no idle branch where no stage idles, no embedding
        where the first stage runs no forward, ...). The carry goes into the branches
        read-only; each returns a `StepUpdate`, written in after the switch. Returns (carry,
        forward output or zeros, input gradient or zeros)."""
        op, m, buf = (jnp.maximum(row[k][self.stage], 0)
                      for k in ("op", "micro_batch", "buffer"))
        micro = jax.tree.map(lambda a: a[m], self.micro_batches)
        at = StepInputs(work, micro, self.model.stack_args(micro), buf)
        branches = {IDLE: self._idle, FORWARD: self._forward,
                    BACKWARD: self._input_backward if self.splits_backward else self._backward,
                    WEIGHT: self._weight}
        ops = sorted(work)
        if len(ops) == 1:
            return self.apply(c, branches[ops[0]](c, at), buf)
        slots = set().union(*(self._writes(o) for o in ops))
        # Which way the stash leaves the switch is XLA's buffer sharing, measured
        # (tests/zeroxla/pipeline/test_compiled.py, benchmarks/pipeline.py): beside idling, a
        # write inside the branch shares the idle branch's buffers (the one-op phases,
        # `table.phases`); where two ops share a step (1F1B's F and B), XLA copies whatever a
        # branch returns whole, so those return one buffer's value.
        whole = len([o for o in ops if o != IDLE]) == 1

        def branch(o: int) -> Callable[[dict[str, Any]], tuple[StepUpdate, dict[str, Any]]]:
            def run(c: dict[str, Any]) -> tuple[StepUpdate, dict[str, Any]]:
                update = branches[o](c, at)
                # The gradient sums are added to in the branch and leave it whole (a path the
                # op adds nothing to passes through): summed after the switch, every op would
                # return a gradient-sized addend, zeros where it adds none.
                return (self._complete(update, slots, c, buf, whole),
                        add_gradients(c["grads"], update.grads))
            return run
        index = jnp.asarray([ops.index(o) if o in ops else 0 for o in sorted(branches)],
                            jnp.int32)[op]
        update, grads = lax.switch(index, [branch(o) for o in ops], c)
        if whole:
            c, update = {**c, **update.slots}, dataclasses.replace(update, slots={})
        else:
            # Each entry written in place where this step's op fills it: a cond beside the
            # identity (one buffer written, the stash's buffer shared), not a write of every
            # step (which would read and write back a buffer where the op fills none).
            for name, value in update.slots.items():
                fills = jnp.asarray([name in self._writes(o) for o in sorted(branches)])[op]
                c[name] = lax.cond(fills, lambda s, v: write_buffer(s, v, buf),
                                   lambda s, v: s, c[name], value)
            update = dataclasses.replace(update, slots={})
        return self.apply({**c, "grads": grads}, update, buf)

    def _writes(self, op: int) -> set[str]:
        """The carry's stash entries `op` writes one buffer of (static)."""
        if op == FORWARD:
            return {"stash", "kept"} if self.keeps_residuals else {"stash"}
        if op == BACKWARD and self.splits_backward:
            return {"stash", "wstash"} if self.keeps_residuals else {"cot"}
        return set()

    def _complete(self, update: StepUpdate, slots: set[str], c: dict[str, Any],
                  buf: jax.Array, whole: bool) -> StepUpdate:
        """`update` in the one structure every branch of a step's switch returns, less its
        gradients (the branch adds them itself), with zeros for an unsent result and, for
        each of `slots`, the stash entry written at `buf` (whole) or the buffer's new value
        (not whole; zeros where this op writes none: `compute` writes only where it does)."""
        if not set(update.slots) <= slots:
            raise AssertionError(f"an op wrote {sorted(update.slots)}, declared {sorted(slots)}")

        def filled(name: str) -> Any:
            if whole:
                return (write_buffer(c[name], update.slots[name], buf) if name in update.slots
                        else c[name])
            return (update.slots[name] if name in update.slots
                    else jax.tree.map(lambda b: jnp.zeros(b.shape[1:], b.dtype), c[name]))
        return StepUpdate(
            slots={name: filled(name) for name in sorted(slots)},
            total=f32(update.total), count=f32(update.count),
            act=self.zeros_act if update.act is None else update.act,
            grad=self.zeros_act if update.grad is None else update.grad)

    def apply(self, c: dict[str, Any], update: StepUpdate, buf: jax.Array
              ) -> tuple[dict[str, Any], jax.Array, jax.Array]:
        """(carry with `update` written in at buffer `buf`, forward output, input gradient)."""
        c = {**c, **{name: write_buffer(c[name], value, buf)
                     for name, value in update.slots.items()}}
        c["grads"] = add_gradients(c["grads"], update.grads)
        c["total"], c["count"] = c["total"] + update.total, c["count"] + update.count
        return (c, self.zeros_act if update.act is None else update.act,
                self.zeros_act if update.grad is None else update.grad)

    def _idle(self, c: dict[str, Any], at: StepInputs) -> StepUpdate:
        return StepUpdate()

    def _forward(self, c: dict[str, Any], at: StepInputs) -> StepUpdate:
        model = self.model
        with jax.named_scope(FORWARD_SCOPE):
            x = self._if_first(at.work[FORWARD], lambda: model.embed(model.trainable, at.micro),
                               lambda: c["act"])
            if not self.keeps_residuals:
                return self._forward_keeping_input(c, at, x)
            return self._forward_keeping_residuals(c, at, x)

    def _forward_keeping_input(self, c: dict[str, Any], at: StepInputs, x: jax.Array
                               ) -> StepUpdate:
        """remat "full": stash the stage input x only; backward recomputes the stage."""
        model = self.model
        y = model.blocks(model.trainable, x, at.consts)
        total, count = self._if_last(at.work[FORWARD],
                                     lambda: model.head_terms(model.trainable, y, at.micro),
                                     lambda: (f32(0), f32(0)))
        return StepUpdate(slots={"stash": x}, total=total, count=count,
                          act=y.astype(self.act.dtype))

    def _forward_keeping_residuals(self, c: dict[str, Any], at: StepInputs, x: jax.Array
                                   ) -> StepUpdate:
        """remat "none" / a policy: keep the blocks' vjp residuals, and on the last stage run
        the head's backward now, stashing its input gradient d_y."""
        model = self.model
        y, kept, layout = model.linearized_blocks(x, at.consts)
        if layout.slots != self.layouts[0].slots:
            raise AssertionError("the stage's residuals differ between traces")

        def with_head():
            # The loss's cotangent is known now, so the head's backward runs here
            # and only its input gradient d_y [mb, T, D] waits for the backward.
            def loss(p, y):
                total, count = model.head_terms(p, y, at.micro)
                return total * self.seed, (total, count)
            _, pullback, (total, count) = jax.vjp(loss, model.trainable, y, has_aux=True)
            d_p, d_y = pullback(f32(1))
            return total, count, gradient_sum(d_p), d_y.astype(self.act.dtype)

        total, count, d_head, d_y = self._if_last(
            at.work[FORWARD], with_head,
            lambda: (f32(0), f32(0), self._zero_grads(), self.zeros_act))
        return StepUpdate(slots={"stash": d_y, "kept": kept}, grads=d_head, total=total,
                          count=count, act=y.astype(self.act.dtype))

    def _zero_grads(self) -> dict[str, jax.Array]:
        """Float32 zeros for every trainable path: a branch's 'adds nothing'."""
        return {path: jnp.zeros(v.shape, f32) for path, v in self.model.trainable.items()}

    def _embedding_grads(self, work: set[int], d_x: jax.Array, at: StepInputs
                         ) -> dict[str, Any]:
        """On the first stage, the gradient of its computation up to the stack from d_x."""
        model = self.model
        return self._if_first(
            work, lambda: gradient_sum(jax.vjp(lambda p: model.embed(p, at.micro),
                                               model.trainable)[1](d_x)[0]),
            self._zero_grads)

    def _backward(self, c: dict[str, Any], at: StepInputs) -> StepUpdate:
        with jax.named_scope(BACKWARD_SCOPE):
            if self.keeps_residuals:
                d_p, d_x = self._backward_from_residuals(c, at)
            else:
                d_p, d_x = self._backward_recomputing(c, at)
            d_embed = self._embedding_grads(at.work[BACKWARD], d_x, at)
            return StepUpdate(grads=gradient_sum(d_p, d_embed), grad=d_x.astype(self.act.dtype))

    def _backward_from_residuals(self, c: dict[str, Any], at: StepInputs
                                 ) -> tuple[dict[str, Any], jax.Array]:
        """(d_p of the blocks' leaves only, d_x): the blocks' kept vjp, no recompute."""
        d_y = self._if_last(at.work[BACKWARD], lambda: c["stash"][at.buf], lambda: c["grad"])
        kept = [k[at.buf] for k in c["kept"]]
        d_full, d_x = self.layouts[0].cotangents(kept, self.model.block_full, d_y)
        return dict(zip(self.model.block.paths, d_full)), d_x

    def _backward_recomputing(self, c: dict[str, Any], at: StepInputs
                              ) -> tuple[dict[str, Any], jax.Array]:
        """(d_p, d_x) under remat "full": recompute the stage (and the head on the last)."""
        model = self.model
        # The blocks' recompute and vjp sit outside the last-stage branch, so
        # their collectives are in the program once (`branch_executions`).
        y, pullback = jax.vjp(lambda p, x: model.blocks(p, x, at.consts), model.trainable,
                              c["stash"][at.buf])

        def with_head():
            def loss(p, y):
                return model.head_terms(p, y, at.micro)[0] * self.seed
            d_head, d_y = jax.vjp(loss, model.trainable, y)[1](f32(1))
            return gradient_sum(d_head), d_y.astype(self.act.dtype)

        d_head, d_y = self._if_last(at.work[BACKWARD], with_head,
                                    lambda: (self._zero_grads(), c["grad"]))
        d_p, d_x = pullback(d_y.astype(y.dtype))
        return gradient_sum(d_p, d_head), d_x

    # --- Zero-bubble: the backward as B (input gradient) then W (weight gradient) -------------

    def _input_backward(self, c: dict[str, Any], at: StepInputs) -> StepUpdate:
        """B: d_x only (sent to stage - 1); d_y and what W reads stashed; module docstring."""
        model = self.model
        with jax.named_scope(BACKWARD_SCOPE):
            if self.keeps_residuals:
                d_y = self._if_last(at.work[BACKWARD], lambda: c["stash"][at.buf],
                                    lambda: c["grad"])
                kept = [k[at.buf] for k in c["kept"]]
                split = self._weight_split(kept, d_y)
                if split is None:
                    d_x = self.layouts[0].cotangents(kept, model.block_full, d_y)[1]
                    wstash = []
                else:                                  # this buffer's stash, W's to read
                    d_x, wstash = split.input_cotangents(kept, model.block_full, d_y)
                slots, d_head = {"stash": d_y, "wstash": wstash}, {}
            else:
                y, pullback = jax.vjp(lambda x: model.blocks(model.trainable, x, at.consts),
                                      c["stash"][at.buf])
                d_head, d_y = self._if_last(
                    at.work[BACKWARD], lambda: self._head_backward(y, at),
                    lambda: (self._zero_grads(), c["grad"]))
                (d_x,) = pullback(d_y.astype(y.dtype))
                slots = {"cot": d_y}
            d_embed = self._embedding_grads(at.work[BACKWARD], d_x, at)
            return StepUpdate(slots=slots, grads=gradient_sum(d_head, d_embed),
                              grad=d_x.astype(self.act.dtype))

    def _head_backward(self, y: jax.Array, at: StepInputs) -> tuple[dict[str, Any], jax.Array]:
        """The last stage's head and loss vjp on the blocks' output y: (d_params, d_y)."""
        def loss(p, y):
            return self.model.head_terms(p, y, at.micro)[0] * self.seed
        d_head, d_y = jax.vjp(loss, self.model.trainable, y)[1](f32(1))
        return gradient_sum(d_head), d_y.astype(self.act.dtype)

    def _weight(self, c: dict[str, Any], at: StepInputs) -> StepUpdate:
        """W: the blocks' parameter gradients from B's stash (or d_y)."""
        model = self.model
        with jax.named_scope(WEIGHT_SCOPE):
            if self.keeps_residuals:
                kept, d_y = [k[at.buf] for k in c["kept"]], c["stash"][at.buf]
                split = self._weight_split(kept, d_y)
                if split is None:
                    d_full = self.layouts[0].cotangents(kept, model.block_full, d_y)[0]
                else:
                    d_full = split.weight_cotangents(kept, model.block_full, d_y,
                                                     stash=c["wstash"], at=(at.buf,))
                d_p = dict(zip(model.block.paths, d_full))
            else:
                paths = [path for path in model.block.paths if path in model.trainable]
                _, pullback = jax.vjp(
                    lambda pb: model.blocks({**model.trainable, **pb}, c["stash"][at.buf],
                                            at.consts),
                    {path: model.trainable[path] for path in paths})
                (d_p,) = pullback(c["cot"][at.buf].astype(self.act.dtype))
            return StepUpdate(grads=gradient_sum(d_p))
