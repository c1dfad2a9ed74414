"""Proof that the model used what the step gave it: a packed batch's `positions` and
`segment_ids`, and the `SequenceParallel` of sequence parallelism; refused by name otherwise.

A model accepts keyword arguments in ways no signature check can judge: `__call__(self, tokens,
**kwargs)` accepts `segment_ids=` and `sequence=` and may drop them, `sequence=None` may be
declared and ignored. Either trains with no error and is silently wrong: a packed row runs as
one sequence (each token attends across its row's sequences), a sequence's slice as a whole
sequence (attention sees T / P tokens). So, under sequence parallelism or on a batch with
packing keys, the step traces its gradient pass (or its evaluation) once into a jaxpr, at trace
time, before anything compiles, and reads the proof there, after dead-code elimination
(`zeroxla.compat.jaxpr.live_jaxpr`):

- each packing key of the batch is an input the outputs (loss, gradients) depend on;
- the live program runs a collective over the sequence axis inside the library's
  sequence-parallel attention (`models.sequence_parallel.ATTENTION_SCOPE`, the named scope of
  `ulysses_attention`, `allgather_attention`, `ring_attention` and `usp_attention`). The step's
  own collectives over the data x sequence devices (gathers, the loss's and the gradients'
  sums) are outside that scope, so they prove nothing.

The jaxpr that was checked is then the one that runs (re-emitted, `jaxpr_as_fun`): the pass is
traced once either way, and a step without sequence parallelism or packing keys skips all this.

What it does not prove: that every attention layer used them (one use passes), nor, for a
custom `loss_fn` that reads `segment_ids` itself (per-sequence sums), that the model did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

from zeroxla.compat.jaxpr import live_jaxpr, name_stack
from zeroxla.engine.loss import POSITIONS_KEY, SEGMENT_IDS_KEY, next_token_loss
from zeroxla.models.sequence_parallel import ATTENTION_SCOPE, SequenceParallel

# batch key -> (what the model must pass it to, what runs wrong when it does not)
PACKING_KEYS = {
    SEGMENT_IDS_KEY: ("attention (zeroxla.models.attention.attention(..., "
                      "segment_ids=segment_ids))",
                      "every packed row would train as one sequence, each token attending "
                      "across its row's sequences"),
    POSITIONS_KEY: ("position embedding or rotary embedding",
                    "every token would take its place in the row as its position, not its "
                    "place in its own sequence"),
}


def proven_call(fn: Callable[..., Any], args: tuple, layout: Any, *, batch_at: int,
                loss_fn: Callable | None = None) -> Any:
    """`fn(*args)` (inside a trace), where `args[batch_at]` is the batch and `fn` runs
    `loss_fn` (default `layout.loss_fn`) on the model of `layout`: under sequence parallelism
    or with packing keys in the batch, traced to a jaxpr, checked (module docstring) and
    re-emitted; else called as it is. ValueError naming the model, the key or `sequence=`, and
    what to do."""
    batch, sequence = args[batch_at], layout.sequence
    keys = [key for key in PACKING_KEYS if key in batch]
    if sequence is None and not keys:
        return fn(*args)
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    live, used = live_jaxpr(closed.jaxpr)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    owner = _owner(layout, layout.loss_fn if loss_fn is None else loss_fn)
    for key in keys:
        index = paths.index((jax.tree_util.SequenceKey(batch_at), jax.tree_util.DictKey(key)))
        if not used[index]:
            where, wrong = PACKING_KEYS[key]
            raise ValueError(
                f"batch[{key!r}] is given (a packed batch: several sequences in a row) but the "
                f"loss of {owner} does not depend on it: the model accepted {key}= (by name or "
                f"through **kwargs) and dropped it, so {wrong}; accepted: a model whose "
                f"__call__ takes {key}= by name and passes it to its {where}, as every family "
                f"in models does, or a batch without {key!r}")
    if sequence is not None and not _runs_sequence_attention(live, sequence):
        raise ValueError(
            f"sequence parallelism ({sequence.strategy}) splits each sequence over "
            f"{sequence.size} devices, but the loss of {owner} runs no sequence-parallel "
            f"attention: the model was given sequence= (a SequenceParallel) and no attention "
            f"used it (no exchange over the {sequence.axis!r} axis inside "
            f"{ATTENTION_SCOPE!r}), so it would attend within this device's slice of each "
            "sequence; accepted: a model whose __call__ takes sequence= by name and passes it "
            "to its attention (zeroxla.models.attention.attention(q, k, v, ..., "
            "sequence=sequence), or ulysses_attention / allgather_attention / ring_attention / "
            "usp_attention), as every family in models does, or a mesh without a sequence axis")
    out = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shapes), out)


def _runs_sequence_attention(jaxpr: Any, sequence: SequenceParallel,
                             inside: bool = False) -> bool:
    """Whether `jaxpr` (live equations only) or a jaxpr inside it has a collective over
    `sequence.axis` under `ATTENTION_SCOPE` (`inside`: the equation holding `jaxpr` is)."""
    for eqn in jaxpr.eqns:
        scoped = inside or ATTENTION_SCOPE in name_stack(eqn)
        if scoped and sequence.axis in _axis_names(eqn.params):
            return True
        if any(_runs_sequence_attention(inner, sequence, scoped)
               for inner in jex_core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _axis_names(params: dict[str, Any]) -> tuple[Any, ...]:
    """The mesh axes a collective equation names (`axis_name`: all_to_all, all_gather,
    ppermute; `axes`: psum), () for any other equation."""
    names = params.get("axis_name", params.get("axes", ()))
    return names if isinstance(names, tuple) else (names,)


def _owner(layout: Any, loss_fn: Callable) -> str:
    """The model's class name, and the function calling it (a loss_fn, `TokenForward`'s fn)
    when it is not the default loss."""
    nodes = getattr(layout.model_def.graphdef, "nodes", None) or [None]
    name = getattr(getattr(nodes[0], "type", None), "__name__", "the model")
    if loss_fn is next_token_loss:
        return name
    return f"{name} (called by {getattr(loss_fn, '__name__', type(loss_fn).__name__)})"


__all__ = ["PACKING_KEYS", "proven_call"]
