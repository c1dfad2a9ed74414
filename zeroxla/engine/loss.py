"""Losses as `(sum, count)`, so that a mean is exact over the global batch.

A loss the step differentiates may return a scalar (the mean over the batch piece it is given:
every device and micro-batch then weighs the same) or a pair `(sum, count)`: the step divides
the sum over all devices and micro-batches by the count over all of them, so a masked or padded
loss averages exactly over the global batch, whatever each device's share of masked tokens (a
mean of per-device means would not).

The default loss is next-token cross-entropy; `batch["loss_mask"]` (optional, [B, T], bool or
float weights) masks tokens out of it.
"""

from __future__ import annotations

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


def token_logprobs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(`logits`) [B, T, V] at `labels` int[B, T] -> [B, T], computed in float32 at
    least (float64 logits of a float64 verification run stay float64)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                              axis=-1)
    return jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def token_cross_entropy(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """`(sum, count)` of the cross-entropy of `logits` [B, T, V] against `batch["targets"]`
    [B, T], weighted by `batch["loss_mask"]` when present."""
    nll = -token_logprobs(logits, batch["targets"])                                   # [B, T]
    if MASK_KEY in batch:
        weights = batch[MASK_KEY].astype(jnp.float32)
        return jnp.sum(nll * weights), jnp.sum(weights)
    return jnp.sum(nll), jnp.float32(nll.size)


def next_token_loss_terms(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """`(sum, count)` of next-token cross-entropy of `model(batch["inputs"])`: the step's
    default loss."""
    return token_cross_entropy(model(batch["inputs"]), batch)


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
