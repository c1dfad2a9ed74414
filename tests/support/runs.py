"""Small measurements of the code under test that many tests take: a step run over batches, and
the bytes each device holds of a tree of arrays."""

import jax


def run_steps(step, state, batches):
    """`state` after `step` over `batches`, and each step's reported loss (floats)."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def bytes_per_device(tree):
    """Bytes of `tree`'s shards on each device, in `jax.devices()` order (0 where a device
    holds none of it)."""
    held = dict.fromkeys(jax.devices(), 0)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return list(held.values())


def device_bytes(tree):
    """{device: bytes of its shards} over every array of `tree`."""
    per_device = {}
    for array in jax.tree.leaves(tree):
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device
