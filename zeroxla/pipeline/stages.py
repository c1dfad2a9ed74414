"""The pipeline's first and last stage, cut from the model's own loss at its layer stack.

A pipelined model is trained on exactly what the plain step differentiates: the loss
`loss_fn(model, batch)` (by default next-token cross-entropy of `model(batch["inputs"])`). The
pipeline splits that computation at the model's `blocks` (one `LayerStack`), whose layers it
spreads over the stages, and assumes nothing of what comes before or after:

    before the stack   whatever `__call__` does first: embedding lookups (`nnx.Embed` or our
                       own), scaling (Gemma's sqrt(D)), dropout-free preprocessing  -> stage 0
    the stack          `self.blocks(x, *args)`                                  -> every stage
    after the stack    whatever follows: a final norm (nanoGPT's ln_f), the head, logit
                       soft-capping, and the loss with the batch's masks/weights -> last stage

Both ends run the user's code itself on a throwaway copy of the model whose `blocks` is a
`StageBoundary` (module surgery on that copy, as PEFT swaps layers; the user's module is never
touched):

  * `stack_input(loss, model, batch)`: the boundary stops the loss where it reaches the stack
    and returns the stack's input x [B, T, D] and its other arguments (positions, masks).
  * `loss_after_stack(loss, model, batch, y)`: the boundary returns `y` (the activation the last
    stage received) as the stack's output; the rest of `__call__` and of the loss run on it.

So the composition is the model's computation by construction, never a guess such as
`head(blocks(embed(x)))`. `check_stages` traces both ends once, abstractly (no compute), when
the step is built, and refuses by name what the cut cannot honour: a loss that never reaches the
stack or reaches it twice, reads its attributes, passes it a cache or keyword arguments, or
passes it arguments that depend on parameters (the pipeline sends only x between stages, so a
gradient through such an argument would be lost).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jex_core

from zeroxla.engine.loss import loss_terms, next_token_loss, next_token_loss_terms
from zeroxla.engine.router_aux import aux_weight, has_router
from zeroxla.models.layers import LayerStack

STACK_ATTRIBUTE = "blocks"

LossTerms = Callable[[Any, Any], tuple[jax.Array, jax.Array]]   # (model, batch) -> (sum, count)


class _ReachedStack(Exception):
    """Raised by an entry boundary: the loss has computed the stack's input."""

    def __init__(self, x: Any, args: tuple, kwargs: dict):
        super().__init__("the model reached its layer stack")
        self.x, self.args, self.kwargs = x, args, kwargs


class StageBoundary:
    """Stands in for the model's `LayerStack` in a copy of the model. Without `output` it stops
    the computation at the stack (`_ReachedStack`); with `output` it returns it as the stack's
    `(x, cache)` result. `calls` counts how often the model called it."""

    def __init__(self, stack: LayerStack, output: Any = None):
        self.num_layers = stack.num_layers
        self.output = output
        self.calls = 0

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.calls += 1
        if self.output is None:
            raise _ReachedStack(x, args, kwargs)
        return self.output, kwargs.get("cache")


def _with_boundary(model: Any, output: Any = None) -> StageBoundary:
    boundary = StageBoundary(getattr(model, STACK_ATTRIBUTE), output)
    setattr(model, STACK_ATTRIBUTE, boundary)        # `model` is a fresh copy (ModelDef.module)
    return boundary


def _reach_stack(loss: LossTerms, model: Any, batch: Any) -> _ReachedStack:
    """Runs `loss(model, batch)` up to `model.blocks`: what the stack is called with. `model`
    is consumed (its stack replaced)."""
    _with_boundary(model)
    try:
        loss(model, batch)
    except _ReachedStack as reached:
        return reached
    raise ValueError(f"pipeline: the loss never calls model.{STACK_ATTRIBUTE}; the pipeline "
                     f"splits the model at its {STACK_ATTRIBUTE} (a LayerStack), so its "
                     "__call__ must run them")


def stack_input(loss: LossTerms, model: Any, batch: Any) -> tuple[Any, tuple]:
    """(x, args): what `loss(model, batch)` passes to `model.blocks` (x [B, T, D] and the other
    positional arguments, e.g. positions [B, T]). `model` is consumed (its stack replaced)."""
    reached = _reach_stack(loss, model, batch)
    return reached.x, reached.args


def loss_after_stack(loss: LossTerms, model: Any, batch: Any,
                     y: Any) -> tuple[jax.Array, jax.Array]:
    """`loss(model, batch)` with the stack's output replaced by `y` [B, T, D]: the part of the
    model's `__call__` after its stack, and the loss. `model` is consumed."""
    boundary = _with_boundary(model, y)
    terms = loss(model, batch)
    if boundary.calls != 1:
        raise ValueError(f"pipeline: the loss calls model.{STACK_ATTRIBUTE} {boundary.calls} "
                         "times per batch; a pipeline runs the stack once per micro-batch")
    return terms


@dataclasses.dataclass(frozen=True)
class StageCut:
    """What `check_stages` learnt about the cut (static, from abstract traces)."""

    embed_paths: tuple[str, ...]     # parameters outside the stack that the stack's input reads
    head_paths: tuple[str, ...]      # the other parameters outside the stack


def _dependent_outputs(jaxpr: Any, sources: set) -> list[bool]:
    """For each output of `jaxpr`, whether it is computed from any of the `sources` invars
    (conservatively: every output of an equation with a dependent input is dependent)."""
    tainted = set(sources)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jex_core.Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [not isinstance(v, jex_core.Literal) and v in tainted for v in jaxpr.outvars]


def check_stages(loss: LossTerms, model_of: Callable[[dict], Any], values: dict[str, Any],
                 batch: Any) -> StageCut:
    """Traces both ends of the cut abstractly on `values` / `batch` (ShapeDtypeStructs) and
    returns which parameters outside the stack feed its input; ValueError naming what the
    pipeline cannot split (see the module docstring)."""
    model = model_of(values)
    stack = getattr(model, STACK_ATTRIBUTE, None)
    if not isinstance(stack, LayerStack):
        raise ValueError(
            f"pipeline: {type(model).__name__} cannot be pipelined: the pipeline splits a "
            f"model's `{STACK_ATTRIBUTE}` attribute, which must be a models.LayerStack of its "
            f"repeated blocks (found {type(stack).__name__}); build them with "
            f"LayerStack(make_block, num_layers, rngs) and call self.{STACK_ATTRIBUTE}(x, ...) "
            "in __call__")
    others = ["/".join(map(str, path)) for path, node in nnx.iter_graph(model)
              if isinstance(node, LayerStack) and node is not stack]
    if others:
        raise ValueError(f"pipeline: {type(model).__name__} has a LayerStack besides "
                         f"self.{STACK_ATTRIBUTE}: {others}; the pipeline stores every stacked "
                         f"layer split over its stages as {STACK_ATTRIBUTE}' own, so it splits "
                         "a model with one stack only; accepted: pipeline=None for this model")
    seen: dict[str, Any] = {}

    def entry(p, b):
        try:
            reached = _reach_stack(loss, model_of(p), b)
        except AttributeError as error:
            raise ValueError(f"pipeline: the model reads an attribute of "
                             f"self.{STACK_ATTRIBUTE} ({error}); the pipeline replaces the "
                             "stack on each stage, so __call__ may only call it") from error
        seen["kwargs"] = reached.kwargs
        return reached.x, reached.args

    closed, (x, _) = jax.make_jaxpr(entry, return_shape=True)(values, batch)
    extra = sorted(k for k, v in seen["kwargs"].items() if not (k == "cache" and v is None))
    if extra:
        raise ValueError(f"pipeline: the model calls self.{STACK_ATTRIBUTE} with keyword "
                         f"arguments {extra}; the pipeline passes the stack's positional "
                         "arguments only (accepted keyword: cache=None)")
    paths = sorted(values)                            # a dict's leaves, in flattening order
    invars = closed.jaxpr.invars[:len(paths)]
    num_x = len(jax.tree.leaves(x))
    if any(_dependent_outputs(closed.jaxpr, set(invars))[num_x:]):
        raise ValueError(f"pipeline: an argument the model passes to self.{STACK_ATTRIBUTE} "
                         "besides x depends on its parameters; the pipeline sends only x "
                         "between stages, so it could not differentiate that argument. Pass "
                         "parameter-free arguments (positions, masks) or move the computation "
                         "into the blocks")
    prefix = STACK_ATTRIBUTE + "/"
    embed = tuple(p for p, v in zip(paths, invars) if not p.startswith(prefix)
                  and any(_dependent_outputs(closed.jaxpr, {v})[:num_x]))
    jax.eval_shape(lambda p, b, y: loss_after_stack(loss, model_of(p), b, y), values, batch, x)
    head = tuple(p for p in paths if not p.startswith(prefix) and p not in embed)
    return StageCut(embed, head)


class StagedLoss:
    """The plain step's loss as the pipeline splits it: `terms(model, batch)` is `(sum, count)`
    of the default next-token loss or of the user's `loss_fn`; `model_cut` and `check` run
    `check_stages` on the model's own call and on each batch signature's micro-batch."""

    PROBE = {"inputs": jax.ShapeDtypeStruct((1, 2), jnp.int32),      # tokens [1, 2]
             "targets": jax.ShapeDtypeStruct((1, 2), jnp.int32)}

    def __init__(self, loss_fn: Callable, model_def: Any):
        self.loss_fn, self.model_def = loss_fn, model_def
        self._checked: set[Any] = set()             # micro-batch signatures cut so far
        self._returns_pair: bool | None = None      # a custom loss_fn's, from `check`

    def terms(self, model: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        if self.loss_fn is next_token_loss:
            return next_token_loss_terms(model, batch)
        return loss_terms(self.loss_fn(model, batch), "loss_fn")

    def is_sum(self) -> bool:
        """Whether the loss returns `(sum, count)` (the default does) rather than a mean."""
        if self.loss_fn is next_token_loss:
            return True
        if self._returns_pair is None:
            raise AssertionError("StagedLoss.check runs before the pipelined pass is traced")
        return self._returns_pair

    def _model(self, values: dict[str, Any]) -> Any:
        return self.model_def.module(values, {}, None)

    def model_cut(self) -> StageCut:
        """The cut of the model's own `model(tokens)` on a probe batch: a model the pipeline
        cannot split is refused by `make_step`, before anything is compiled."""
        values = self.model_def.abstract_values()[0]
        model = self._model(values)
        if has_router(model) and aux_weight(model) > 0:
            c = model.config
            raise ValueError(
                f"pipeline parallelism with {type(c).__name__}'s auxiliary load-balancing loss "
                f"(router_aux_loss_coef={c.router_aux_loss_coef}, output_router_logits=True) is "
                "not built: the stages would drop it; accepted: output_router_logits=False, or "
                "no pipeline (stages=1)")
        return check_stages(next_token_loss_terms, self._model, values, self.PROBE)

    def check(self, micro: dict[str, jax.ShapeDtypeStruct]) -> None:
        """Cuts the loss on a micro-batch of these shapes (once per signature): a custom
        `loss_fn` is refused here, on the first batch, before any compute."""
        signature = tuple(sorted((k, v.shape, str(v.dtype)) for k, v in micro.items()))
        if signature in self._checked:
            return
        values = self.model_def.abstract_values()[0]
        check_stages(self.terms, self._model, values, micro)
        if self.loss_fn is not next_token_loss:
            value = jax.eval_shape(lambda p, b: self.loss_fn(self._model(p), b), values, micro)
            self._returns_pair = isinstance(value, (tuple, list))
        self._checked.add(signature)


def stop_gradients(tree: Any) -> Any:
    """`tree` as constants of the differentiation (the stack's parameter-free arguments)."""
    return jax.tree.map(lambda a: jax.lax.stop_gradient(a) if jnp.issubdtype(
        jnp.result_type(a), jnp.inexact) else a, tree)
