"""Random numbers in the step: one seed, a different stream per step, device and micro-batch.

Data parallelism splits the global batch over devices; a dropout mask drawn from the same key
on every device would repeat the same pattern on every shard of the batch (the silent bug of
seeding each replica alike). So the step derives each piece's key from the run's seed:

    key(t, d, m) = fold_in(fold_in(fold_in(seed_key, t), d), m)

for step t (`TrainState.step`), data-parallel index d (node * local + local, the batch shard
the device holds) and micro-batch m of gradient accumulation. The run is reproducible from
the seed and resumes exactly from a checkpoint (t is part of the state). Masks depend on how
the batch is split: the same seed on a different number of data devices (or micro-batches)
draws different masks, as any per-shard dropout must (a mask is drawn per local batch).

The model sees the key two ways, as Flax users pass randomness:
* RNG streams the model holds (`nnx.Dropout(rate, rngs=rngs)`): each stream's key is
  fold_in(key(t, d, m), crc32(its path)) and its counter starts at 0, every step;
* a `loss_fn(model, batch, rngs)` that declares an `rngs` parameter gets `nnx.Rngs` seeded
  with fold_in(key(t, d, m), CALL_STREAM), to pass on at call time (`dropout(x, rngs=rngs)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import lax

from zeroxla.engine.loss import declares

CALL_STREAM = 0x7A3C  # folded into the piece key for the `rngs` a loss function receives


def seed_key_data(seed: int | jax.Array) -> jax.Array:
    """uint32[2] key data of an int seed or a typed key (what `TrainState.rng` stores)."""
    if isinstance(seed, int):
        return jax.random.key_data(jax.random.key(seed))
    if hasattr(seed, "dtype") and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(seed)
    raise TypeError(f"seed must be an int or a jax.random.key, got {type(seed).__name__}")


def step_key(key_data: jax.Array, step: jax.Array) -> jax.Array:
    """The key of step `step` (typed), from the stored key data."""
    return jax.random.fold_in(jax.random.wrap_key_data(key_data), step)


def device_key(key: jax.Array, data_axes: Sequence[str]) -> jax.Array:
    """Inside the shard_map: this data device's key (fold_in of its data-parallel index)."""
    return jax.random.fold_in(key, lax.axis_index(tuple(data_axes)))


def micro_batch_key(key: jax.Array, index: int | jax.Array) -> jax.Array:
    return jax.random.fold_in(key, index)


def takes_rngs(loss_fn: Callable) -> bool:
    """Whether `loss_fn` declares an `rngs` parameter (the step then passes one)."""
    return declares(loss_fn, "rngs")
