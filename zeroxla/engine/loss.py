"""Losses as `(sum, count)`, so that a mean is exact over the global batch.

A loss the step differentiates may return a scalar (the mean over the batch piece it is given:
every device and micro-batch then weighs the same) or a pair `(sum, count)`: the step divides
the sum over all devices and micro-batches by the count over all of them, so a masked or padded
loss averages exactly over the global batch, whatever each device's share of masked tokens (a
mean of per-device means would not).

The default loss is next-token cross-entropy; `batch["loss_mask"]` (optional, [B, T], bool or
float weights) masks tokens out of it, and `batch["positions"]` / `batch["segment_ids"]`
(optional, int [B, T]: a packed batch's per-sequence positions and sequence ids) go to the
model. A model with the chunked log-prob protocol (`model.token_logprobs(tokens, labels, *,
positions, segment_ids, vocab_limit)`, every family in `models`) computes the loss without its
whole [B, T, V] logits (`models.chunked_logits`); any other model is called for its logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Batch = Mapping[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], Any]
BATCH_KEYS = ("inputs", "targets")
MASK_KEY = "loss_mask"
POSITIONS_KEY, SEGMENT_IDS_KEY = "positions", "segment_ids"
SEQUENCE_KEY = "sequence"          # a `SequenceParallel` (sequence parallelism), not a batch key
EXPERTS_KEY = "experts"            # an `ExpertParallel` (expert parallelism), not a batch key
# What the chunked protocol bypasses: a subclass overriding one of these below the class that
# defines `token_logprobs` is called for its logits instead (its own forward is the truth).
_FORWARD_METHODS = ("__call__", "hidden", "head", "logits", "token_logprobs")


def token_logprobs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(`logits`) [B, T, V] at `labels` int[B, T] -> [B, T], computed in float32 at
    least (float64 logits of a float64 verification run stay float64)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                              axis=-1)
    return jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def has_chunked_logprobs(model: Any) -> bool:
    """Whether `model` computes its log-probs chunked (`model.token_logprobs`, the models'
    protocol) with nothing in its forward overridden past the class that defines it. Read
    from the class: a ZeRO-3 stand-in (`engine.wrap`) answers any attribute."""
    cls = type(model)
    owner = next((c for c in cls.__mro__ if "token_logprobs" in vars(c)), None)
    if owner is None or not callable(vars(owner)["token_logprobs"]):
        return False
    below = cls.__mro__[:cls.__mro__.index(owner)]
    return not any(name in vars(c) for c in below for name in _FORWARD_METHODS)


def _takes(fn: Any, name: str) -> bool:
    """Whether `fn` accepts the keyword argument `name` (by name, or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True                           # not introspectable: the call itself decides
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def declares(fn: Any, name: str) -> bool:
    """Whether `fn` declares a parameter `name` itself (not through **kwargs, which could drop
    it): what the step passes only to a loss_fn that asks (`rngs`, `sequence`)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def takes_packed_batches(model: Any) -> bool:
    """Whether `model` can run a packed batch: its chunked `token_logprobs` (the models'
    protocol takes `positions` and `segment_ids`) or a `__call__` accepting both."""
    return has_chunked_logprobs(model) or all(
        _takes(model.__call__, name) for name in (POSITIONS_KEY, SEGMENT_IDS_KEY))


def check_packable(model: Any, flag: str, role: str) -> None:
    """ValueError naming `flag` (e.g. "GRPOConfig.packing") unless `model` (the job's `role`:
    "actor", "policy") can run a packed batch (`takes_packed_batches`)."""
    if not takes_packed_batches(model):
        raise ValueError(f"{flag}=True but {type(model).__name__} takes no positions= and "
                         "segment_ids= (a packed row holds several sequences); accepted: "
                         f"{flag.rsplit('.', 1)[-1]}=False, or a {role} whose __call__ (or "
                         "token_logprobs) takes them, as every family in models does")


def _stack_options(model: Any, forward: Any, what: str, positions: jax.Array | None,
                   segment_ids: jax.Array | None, sequence: Any = None,
                   experts: Any = None) -> dict[str, Any]:
    """The given `positions` / `segment_ids` / `sequence` / `experts` as keyword arguments of
    `forward` (named `what`); ValueError naming the key when `forward` takes no such argument:
    a packed batch is never run as one sequence, nor a sequence's slice as a whole one, nor a
    slice of an MoE layer's experts as all of them. One it takes (by name or through
    **kwargs) must also be used: the step proves that on the traced loss for the sequence
    (`engine.consumption`); an MoE layer holding a slice of its experts refuses a call
    without `experts` itself (`models.moe.check_expert_split`)."""
    options = {k: v for k, v in ((POSITIONS_KEY, positions), (SEGMENT_IDS_KEY, segment_ids),
                                 (SEQUENCE_KEY, sequence), (EXPERTS_KEY, experts))
               if v is not None}
    for name in options:
        if name == EXPERTS_KEY and not _takes(forward, name):
            raise ValueError(
                f"expert parallelism splits the MoE layers' experts over {experts.size} "
                f"devices but {type(model).__name__}.{what} takes no experts= argument, so "
                "its MoE layers would compute with a slice of their experts as if it were all "
                f"of them; accepted: a model whose {what} takes experts= (an ExpertParallel, "
                "as the MoE families in models do), or make_mesh(..., expert=1)")
        if name == SEQUENCE_KEY and not _takes(forward, name):
            raise ValueError(
                f"sequence parallelism splits each sequence over {sequence.size} devices but "
                f"{type(model).__name__}.{what} takes no sequence= argument, so its attention "
                "would see only a slice of each sequence; accepted: a model whose "
                f"{what} takes sequence= (a `SequenceParallel`, as every family in models "
                "does), or a mesh without a sequence axis")
        if not _takes(forward, name):
            raise ValueError(f"batch[{name!r}] is given but {type(model).__name__}.{what} takes "
                             f"no {name} argument; accepted: a batch without {name!r}, or a "
                             f"model whose {what} accepts {name}=")
    return options


def model_token_logprobs(model: Any, tokens: jax.Array, labels: jax.Array, *,
                         positions: jax.Array | None = None,
                         segment_ids: jax.Array | None = None,
                         vocab_limit: int | None = None, sequence: Any = None,
                         experts: Any = None) -> jax.Array:
    """log p(labels | tokens) [B, T] under `model` for tokens, labels int [B, T], with the
    softmax over the ids below `vocab_limit` when given (a vocabulary padded past its
    tokenizer's). Chunked through `model.token_logprobs` when the model has the protocol
    (`has_chunked_logprobs`: its [B, T, V] logits never exist whole), else `token_logprobs`
    of `model(tokens)`. `positions` / `segment_ids` (int [B, T]) go to the model; one it cannot
    take is refused by name (`_stack_options`). `sequence` (a `SequenceParallel`): tokens and
    labels are this device's slice of each sequence; the model computes attention over the
    whole sequences (one that takes no `sequence=` is refused). `experts` (an
    `ExpertParallel`): the model's MoE layers hold a slice of their experts, split over that
    axis (one that takes no `experts=` is refused)."""
    if has_chunked_logprobs(model):
        extra = _stack_options(model, model.token_logprobs, "token_logprobs", None, None,
                               sequence, experts)
        return model.token_logprobs(tokens, labels, positions=positions,
                                    segment_ids=segment_ids, vocab_limit=vocab_limit, **extra)
    options = _stack_options(model, model.__call__, "__call__", positions, segment_ids,
                             sequence, experts)
    logits = model(tokens, **options)                                             # [B, T, V]
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    return token_logprobs(logits, labels)


def masked_nll_terms(nll: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """`(sum, count)` of the per-token losses `nll` [B, T], weighted by `batch["loss_mask"]`
    when present."""
    if MASK_KEY in batch:
        weights = batch[MASK_KEY].astype(jnp.float32)
        return jnp.sum(nll * weights), jnp.sum(weights)
    return jnp.sum(nll), jnp.float32(nll.size)


def token_cross_entropy(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """`(sum, count)` of the cross-entropy of `logits` [B, T, V] against `batch["targets"]`
    [B, T], weighted by `batch["loss_mask"]` when present."""
    return masked_nll_terms(-token_logprobs(logits, batch["targets"]), batch)


def next_token_loss_terms(model: nnx.Module, batch: Batch, sequence: Any = None,
                          experts: Any = None) -> tuple[jax.Array, jax.Array]:
    """`(sum, count)` of next-token cross-entropy of `model` on `batch["inputs"]` against
    `batch["targets"]` (`model_token_logprobs`: chunked where the model can, with the batch's
    positions and segment ids, `sequence` under sequence parallelism and `experts` under
    expert parallelism): the step's default loss."""
    logp = model_token_logprobs(model, batch["inputs"], batch["targets"],
                                positions=batch.get(POSITIONS_KEY),
                                segment_ids=batch.get(SEGMENT_IDS_KEY),
                                sequence=sequence, experts=experts)              # [B, T]
    return masked_nll_terms(-logp, batch)


def next_token_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    """Mean cross-entropy of `model(batch['inputs'])` against `batch['targets']` over the
    (unmasked) tokens of `batch`."""
    total, count = next_token_loss_terms(model, batch)
    return total / jnp.maximum(count, 1e-9)


def loss_terms(value: Any, where: str) -> tuple[jax.Array, jax.Array]:
    """A loss function's result as `(sum, count)`: a scalar mean counts as one."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{where} returned a {type(value).__name__} of {len(value)} "
                             "values; a loss returns a scalar mean or a (sum, count) pair")
        total, count = value
    else:
        total, count = value, jnp.float32(1)
    for name, x in (("loss", total), ("count", count)):
        if np.shape(x) != ():
            raise ValueError(f"{where} returned a {name} of shape {np.shape(x)}; a loss returns "
                             "a scalar mean or a (sum, count) pair of scalars")
    return jnp.asarray(total, jnp.float32), jnp.asarray(count, jnp.float32)


def normalizer(batch: Batch) -> float:
    """A static magnitude for the loss sum of one batch piece (its tokens, or its examples):
    the step differentiates sum / normalizer, so that gradients (and fp16 loss scaling) see
    mean-sized values; the exact global mean is restored after the reduction."""
    first = np.shape(next(iter(batch.values())))
    return float(np.prod(first[:2])) if len(first) >= 2 else float(first[0] or 1)
