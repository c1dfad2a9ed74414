"""ZeRO++'s arithmetic on one device in plain jnp: the reference for qwZ and qgZ training.

ZeRO++ (Wang et al. 2023) changes what a ZeRO-3 step computes, not only what it sends: qwZ
(§3.1) runs the forward on int8-rounded weights, qgZ (§3.3) sums int4-rounded gradients. So the
reference for a ZeRO++ run is not plain training but "ZeRO-3 with the same rounding", written
out here without any zeroxla code: the model is the user's nnx module, the loss and the
rounding are written out, and the optimizer is plain optax (like `reference.py`).

What the reference takes from the engine is the sharding plan's layout, which is data
(`ShardingPlan.describe()` prints it, and the plan has its own golden test): for each
partitioned parameter, its shard dim and padded size, because which elements share a
quantization group depends on how the parameter is cut into per-device shards.

The rounding, DeepSpeed's group quantizer (`numpy_quant` says the formula): per group of
`group_size` consecutive elements of a device's flat shard, scale = 2^bits / (2 * absmax),
code = clamp(round_half_to_even(x * scale), -2^(bits-1), 2^(bits-1) - 1), value = code / scale;
a shard's last group is padded by repeating its last element.

- qwZ: each device's shard of a partitioned weight (zero-padded along its shard dim) is rounded
  to int8 before the forward. Gradients are taken with respect to the rounded weights and
  applied to the float32 ones: what the engine computes when hpZ keeps the rounded gathered
  weights for backward (with qwZ alone, its backward re-gathers the unrounded weights instead).
- qgZ: device d = k * local + j computes the gradient of its batch slice's mean loss. For
  each partitioned weight (per layer of a stack) whose padded size is at least
  devices * min(group_size, 256) (qgZ's threshold; smaller ones are summed exactly), the
  gradient is padded, cut into the devices' partitions, and summed in two hops: partition p's
  contributions from the `local` devices of node k are rounded to int4 and summed, that sum is
  rounded to int4 again, and the nodes' rounded sums are summed (ZeRO++ §3.3's two-hop
  all-to-all). A partition smaller than a group is one group (the power of two >= it).
  Everything else is summed exactly; the sum is divided by the device count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from reference import cross_entropy

QGZ_MIN_CHUNK = 256    # qgZ sends a partition smaller than this and than a group unrounded


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """How one partitioned parameter is cut into per-device shards (from the plan)."""

    stacked: bool          # dim 0 is a layer dim: each layer is cut on its own
    shard_dim: int         # the dim of the parameter's logical shape that is cut
    padded_size: int       # shape[shard_dim] zero-padded to a multiple of the device count


def partitioned_layout(plan) -> dict[str, Partitioned]:
    """{path: Partitioned} for every partitioned parameter of a zeroxla sharding plan."""
    return {leaf.path: Partitioned(leaf.stacked, leaf.shard_dim, leaf.padded_size)
            for leaf in plan.leaves if leaf.params_partitioned}


def round_groups(rows: jax.Array, bits: int, group_size: int) -> jax.Array:
    """Symmetric group rounding of each row of rows [..., n] (float32), back to float32."""
    n = rows.shape[-1]
    groups = -(-n // group_size)
    padded = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, groups * group_size - n)],
                     mode="edge")
    g = padded.reshape(*rows.shape[:-1], groups, group_size)
    absmax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 1e-30, 2.0 ** bits / (2 * jnp.where(absmax > 1e-30, absmax, 1)),
                      1.0)
    codes = jnp.clip(jnp.round(g * scale), -2 ** (bits - 1), 2 ** (bits - 1) - 1)
    return (codes / scale).reshape(*rows.shape[:-1], groups * group_size)[..., :n]


def to_shards(x: jax.Array, layout: Partitioned, devices: int, lead: int = 0) -> jax.Array:
    """A parameter (or [*lead, parameter]) -> its per-device shards, flat:
    [*lead, L, devices, chunk] (L = 1 for an unstacked parameter). Shard d is the d-th slice
    of the zero-padded shard dim, read in row-major order."""
    units = x if layout.stacked else jnp.expand_dims(x, lead)       # [*lead, L, *unit]
    axis = lead + 1 + layout.shard_dim - (1 if layout.stacked else 0)
    widths = [(0, 0)] * units.ndim
    widths[axis] = (0, layout.padded_size - units.shape[axis])
    padded = jnp.pad(units, widths)                                 # zeros, like the engine
    split = padded.reshape(*padded.shape[:axis], devices, -1, *padded.shape[axis + 1:])
    pieces = jnp.moveaxis(split, axis, lead + 1)                    # [*lead, L, N, *piece]
    return pieces.reshape(*pieces.shape[:lead + 2], -1)


def from_shards(shards: jax.Array, layout: Partitioned, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `to_shards` (no lead dims): [L, devices, chunk] -> the parameter `shape`."""
    layers, devices, _ = shards.shape
    unit = shape[1:] if layout.stacked else shape
    dim = layout.shard_dim - (1 if layout.stacked else 0)
    piece = list(unit)
    piece[dim] = layout.padded_size // devices
    pieces = jnp.moveaxis(shards.reshape(layers, devices, *piece), 1, dim + 1)
    padded = pieces.reshape(layers, *unit[:dim], layout.padded_size, *unit[dim + 1:])
    full = jax.lax.slice_in_dim(padded, 0, unit[dim], axis=dim + 1)          # [L, *unit]
    return full if layout.stacked else full[0]


def qgz_group(chunk: int, group_size: int) -> int:
    return min(group_size, 1 << max(chunk - 1, 1).bit_length())


def two_hop_sum(per_device: jax.Array, layout: Partitioned, nodes: int, local: int,
                group_size: int) -> jax.Array:
    """per_device [N, *shape] gradients -> their qgZ sum [*shape] (see the module docstring)."""
    devices = nodes * local
    shards = to_shards(per_device, layout, devices, lead=1)       # [d, L, p, chunk]
    chunk = shards.shape[-1]
    if chunk < min(group_size, QGZ_MIN_CHUNK):                    # too small: summed exactly
        return jnp.sum(per_device, axis=0)
    group = qgz_group(chunk, group_size)
    by_node = shards.reshape(nodes, local, *shards.shape[1:])     # [k, j, L, p, chunk]
    partial = jnp.sum(round_groups(by_node, 4, group), axis=1)    # hop 1: [k, L, p, chunk]
    total = jnp.sum(round_groups(partial, 4, group), axis=0)      # hop 2: [L, p, chunk]
    return from_shards(total, layout, per_device.shape[1:])


def round_weights(params: dict[str, jax.Array], layout: dict[str, Partitioned], devices: int,
                  bits: int, group_size: int) -> dict[str, jax.Array]:
    """qwZ: every partitioned weight rounded per device shard."""
    out = dict(params)
    for path, lay in layout.items():
        shards = to_shards(params[path], lay, devices)            # [L, N, chunk]
        out[path] = from_shards(round_groups(shards, bits, group_size), lay,
                                params[path].shape)
    return out


def train_zeropp_reference(model, optimizer, batches, layout: dict[str, Partitioned], *,
                           nodes: int, local: int, weight_bits: int | None = None,
                           weight_group_size: int = 2048,
                           gradient_group_size: int | None = None):
    """Trains `model` on one device with ZeRO++'s rounding: qwZ when `weight_bits`, qgZ when
    `gradient_group_size`. Returns (losses, final params as {path: np.ndarray})."""
    devices = nodes * local
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest_leaves, rest_def = jax.tree.flatten(rest)
    keyed, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = ["/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
             for path, _ in keyed]

    def as_state(values: dict[str, jax.Array]):
        return jax.tree.unflatten(treedef, [values[n] for n in names])

    def device_loss(values, batch):
        model_ = nnx.merge(graphdef, as_state(values), jax.tree.unflatten(rest_def, rest_leaves))
        return cross_entropy(model_, batch)

    device = jax.devices()[0]
    weights = jax.device_put(dict(zip(names, (leaf for _, leaf in keyed))), device)
    opt_state = jax.device_put(optimizer.init(weights), device)   # one compile, not two

    @jax.jit
    def step(weights, opt_state, batch):
        used = weights if weight_bits is None else round_weights(
            weights, layout, devices, weight_bits, weight_group_size)
        slices = jax.tree.map(lambda a: a.reshape(devices, -1, *a.shape[1:]), batch)
        losses, grads = jax.vmap(jax.value_and_grad(device_loss), in_axes=(None, 0))(used,
                                                                                    slices)
        summed = {}
        for path, g in grads.items():          # g: [devices, *shape]
            if gradient_group_size is not None and path in layout:
                summed[path] = two_hop_sum(g, layout[path], nodes, local, gradient_group_size)
            else:
                summed[path] = jnp.sum(g, axis=0)
        mean = jax.tree.map(lambda g: g / devices, summed)
        updates, opt_state = optimizer.update(mean, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, jnp.mean(losses)

    losses = []
    for batch in batches:
        weights, opt_state, loss = step(weights, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, {n: np.asarray(v) for n, v in weights.items()}
