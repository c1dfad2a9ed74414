"""The sharding plan: for every parameter, where it is stored and how it is computed with.

The difference between a parameter's *storage* layout and its *compute* layout is ZeRO: every
gather, scatter and optimizer slice in the step follows from this table.

Partitioned layout (DeepSpeed's flat partitions): one layer's worth of a parameter (the whole
parameter, or one slice of a stacked `[L, ...]` parameter) is flattened, zero-padded to a
multiple of the data-parallel size N, and split into N equal chunks; device d holds chunk d.
Stacked parameters keep their leading layer dim: storage `[L, N * chunk]`, per device
`[L, chunk]`, so the layer scan can gather one layer at a time. Padding is zero, receives zero
gradient, and is cut off whenever a parameter is reassembled, so it never leaks into results.

Frozen (non-trainable) leaves have no gradient, optimizer state or update; at stage 3 they are
still partitioned and gathered for compute. With ZeRO++'s `quantized_nontrainable_weights` a
frozen partitioned leaf is stored as block-quantized codes of its partition (a
`QuantizedArray`, quantized once at init and never again): per device, `[L?, G, group_size *
bits / 8]` int8 codes and `[L?, G]` float32 scales, G = ceil(chunk / group_size).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeroxla.pallas_kernels import QuantizedArray, dequantize, quantize
from zeroxla.engine.mesh import DATA_AXES

LAYERS_AXIS = "layers"


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Layout of one parameter leaf. `path` is its '/'-joined nnx path (e.g. 'blocks/layers/wq')."""

    path: str
    shape: tuple[int, ...]
    stacked: bool          # dim 0 is the layer dim of a LayerStack
    persistent: bool       # under the persistence threshold: parameter replicated at stage 3
    params_partitioned: bool   # parameter storage partitioned (stage 3, not persistent)
    optimizer_partitioned: bool  # optimizer state (and update) partitioned (stage >= 1, trainable)
    data_size: int
    trainable: bool = True     # False: frozen, no gradient / optimizer state / update
    # quantized_nontrainable_weights: a frozen partitioned leaf stored as codes of this many bits
    # in groups of `storage_group_size` elements; 0 keeps it float32.
    storage_bits: int = 0
    storage_group_size: int = 0

    @property
    def layers(self) -> int:
        return self.shape[0] if self.stacked else 1

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of what one layer (or one call) uses: the parameter without its layer dim."""
        return self.shape[1:] if self.stacked else self.shape

    @property
    def unit_numel(self) -> int:
        return math.prod(self.unit_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk(self) -> int:
        """Elements of one layer's partition on each device."""
        return -(-self.unit_numel // self.data_size)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.data_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.unit_numel

    @property
    def partitioned_shape(self) -> tuple[int, ...]:
        """Global shape in the partitioned layout: [L, N*chunk] or [N*chunk]."""
        return (self.layers, self.padded_numel) if self.stacked else (self.padded_numel,)

    @property
    def partitioned_spec(self) -> P:
        return P(None, DATA_AXES) if self.stacked else P(DATA_AXES)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Float layout of the stored parameter (of its dequantized values when quantized)."""
        return self.partitioned_shape if self.params_partitioned else self.shape

    @property
    def param_spec(self) -> P | QuantizedArray:
        """Sharding of the stored parameter: one spec, or a `QuantizedArray` of specs."""
        if self.params_quantized:
            codes = P(None, DATA_AXES, None) if self.stacked else P(DATA_AXES, None)
            return self._quantized_storage(codes, self.partitioned_spec)
        return self.partitioned_spec if self.params_partitioned else P()

    def param_struct(self) -> jax.ShapeDtypeStruct | QuantizedArray:
        """Abstract stored parameter (global shape and dtype), the shape of `state.params`."""
        if not self.params_quantized:
            return jax.ShapeDtypeStruct(self.param_shape, jnp.float32)
        lead = (self.layers,) if self.stacked else ()
        groups = self.storage_groups * self.data_size
        packed = self.storage_group_size * self.storage_bits // 8
        return self._quantized_storage(jax.ShapeDtypeStruct((*lead, groups, packed), jnp.int8),
                                       jax.ShapeDtypeStruct((*lead, groups), jnp.float32))

    @property
    def param_bytes_per_device(self) -> int:
        """Bytes of the stored parameter on one device (codes + scales when quantized)."""
        if self.params_quantized:
            code_bytes = self.storage_group_size * self.storage_bits // 8
            return self.layers * self.storage_groups * (code_bytes + 4)
        return 4 * (self.layers * self.chunk if self.params_partitioned else self.numel)

    @property
    def optimizer_shape(self) -> tuple[int, ...]:
        return self.partitioned_shape if self.optimizer_partitioned else self.shape

    @property
    def optimizer_spec(self) -> P:
        return self.partitioned_spec if self.optimizer_partitioned else P()

    # Global-array conversions (used under jit; XLA partitions them).
    def to_partitioned(self, x: jax.Array) -> jax.Array:
        """Logical `shape` -> partitioned layout `[L, N*chunk]` / `[N*chunk]` (zero padded)."""
        flat = x.reshape(self.layers, self.unit_numel) if self.stacked else x.reshape(-1)
        pad = [(0, 0)] * (flat.ndim - 1) + [(0, self.padding)]
        return jnp.pad(flat, pad)

    def from_partitioned(self, x: jax.Array) -> jax.Array:
        """Partitioned layout -> logical `shape` (padding cut off)."""
        return x[..., : self.unit_numel].reshape(self.shape)

    def unit_from_flat(self, flat: jax.Array) -> jax.Array:
        """A gathered padded flat unit [N*chunk] -> the unit's logical shape."""
        return flat[: self.unit_numel].reshape(self.unit_shape)

    def unit_to_flat(self, unit: jax.Array) -> jax.Array:
        """A unit of logical shape -> padded flat [N*chunk], ready to reduce-scatter."""
        return jnp.pad(unit.reshape(-1), (0, self.padding))

    # Quantized storage (quantized_nontrainable_weights).
    @property
    def params_quantized(self) -> bool:
        """Stored as block-quantized codes (a frozen partitioned leaf under ZeRO++)."""
        return self.storage_bits > 0

    @property
    def storage_groups(self) -> int:
        """Quantization groups in one layer's partition on one device."""
        return -(-self.chunk // self.storage_group_size)

    def _quantized_storage(self, data: Any, scales: Any) -> QuantizedArray:
        # `shape` is what one device's codes stand for: its partition [L?, chunk].
        shape = (self.layers, self.chunk) if self.stacked else (self.chunk,)
        return QuantizedArray(data=data, scales=scales, offsets=None, shape=shape,
                              bits=self.storage_bits, group_size=self.storage_group_size)

    def quantize_partitioned(self, x: jax.Array) -> QuantizedArray:
        """Partitioned layout [L?, N*chunk] -> stored codes: each device's chunk is quantized on
        its own, so a device holds exactly the codes and scales of its partition."""
        rows = x.reshape(self.layers * self.data_size, self.chunk)          # [L*N, chunk]
        # Runs once, at init: the jnp path, which vmaps over rows on every backend.
        q = jax.vmap(lambda c: quantize(c, bits=self.storage_bits,
                                        group_size=self.storage_group_size, impl="jnp"))(rows)
        lead = (self.layers,) if self.stacked else ()
        groups = self.data_size * self.storage_groups
        return self._quantized_storage(
            q.data.reshape(*lead, groups, q.data.shape[-1]),                # [L?, N*G, packed]
            q.scales.reshape(*lead, groups))                                # [L?, N*G]

    def dequantize_partitioned(self, q: QuantizedArray) -> jax.Array:
        """Stored codes (global) -> float32 partitioned layout [L?, N*chunk]."""
        rows = self.layers * self.data_size
        per_device = QuantizedArray(
            data=q.data.reshape(rows, self.storage_groups, -1),
            scales=q.scales.reshape(rows, self.storage_groups), offsets=None,
            shape=(rows, self.chunk), bits=q.bits, group_size=q.group_size)
        return dequantize(per_device).reshape(self.partitioned_shape)

    def unit_codes(self, q: QuantizedArray) -> QuantizedArray:
        """One device's codes of one unit (one layer, sliced by the scan, or the whole leaf),
        as a one-row `QuantizedArray` of `chunk` elements."""
        return QuantizedArray(data=q.data, scales=q.scales, offsets=None, shape=(self.chunk,),
                              bits=q.bits, group_size=q.group_size)

    def storage_to_logical(self, stored: Any) -> jax.Array:
        """`state.params[path]` (global, any storage) -> float32 of the logical `shape`."""
        if self.params_quantized:
            stored = self.dequantize_partitioned(stored)
        return self.from_partitioned(stored) if self.params_partitioned else stored

    def logical_to_storage(self, x: jax.Array) -> Any:
        """Inverse of `storage_to_logical` (up to quantization for quantized storage)."""
        x = jnp.asarray(x, jnp.float32)
        if not self.params_partitioned:
            return x
        partitioned = self.to_partitioned(x)
        return self.quantize_partitioned(partitioned) if self.params_quantized else partitioned

    def storage_kind(self) -> str:
        frozen = "" if self.trainable else ", frozen"
        if self.params_partitioned:
            codes = (f" as int{self.storage_bits} codes (groups of {self.storage_group_size})"
                     if self.params_quantized else "")
            return "partitioned" + codes + frozen
        kind = "replicated: under persistence threshold" if self.persistent else "replicated"
        return kind + frozen + (" (optimizer state partitioned)" if self.optimizer_partitioned
                                else "")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The table of `LeafPlan`s for a model under one ZeRO stage on N data-parallel devices."""

    leaves: tuple[LeafPlan, ...]
    stage: int
    data_size: int
    persistence_threshold: int

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(leaf.path for leaf in self.leaves)

    def __getitem__(self, path: str) -> LeafPlan:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise KeyError(f"no parameter {path!r} in the plan; known: {self.paths[:8]}...")

    @property
    def trainable_leaves(self) -> tuple[LeafPlan, ...]:
        """The leaves with gradients and optimizer state (`state.opt_state` covers these)."""
        return tuple(leaf for leaf in self.leaves if leaf.trainable)

    def param_specs(self) -> dict[str, P | QuantizedArray]:
        return {leaf.path: leaf.param_spec for leaf in self.leaves}

    def total_numel(self) -> int:
        return sum(leaf.numel for leaf in self.leaves)

    def describe(self) -> str:
        """A fixed-width table: path, logical shape, storage, per-device shard, padding, compute."""
        header = ("parameter", "shape", "numel", "storage", "per-device shard", "pad", "compute")
        rows = [header]
        for leaf in self.leaves:
            if leaf.params_partitioned:
                shard = (leaf.layers, leaf.chunk) if leaf.stacked else (leaf.chunk,)
                compute = ("gathered per layer in the scan" if leaf.stacked
                           else "gathered per module call")
            else:
                shard = leaf.shape
                compute = "used in place"
            rows.append((leaf.path, "x".join(map(str, leaf.shape)) or "scalar", str(leaf.numel),
                         leaf.storage_kind(), "x".join(map(str, shard)) or "scalar",
                         str(leaf.padding * leaf.layers if leaf.params_partitioned
                             or leaf.optimizer_partitioned else 0), compute))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"ZeRO stage {self.stage} over {self.data_size} data-parallel devices "
                 f"(persistence threshold {self.persistence_threshold} elements)"]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _stored_group_size(chunk: int, group_size: int) -> int:
    """Group size of a partition's stored codes: `group_size`, or for a partition smaller than
    one group the power of two >= chunk (at least 2, so int4 codes pair up), so a small
    partition is not padded to a whole large group."""
    return min(group_size, max(2, 1 << (chunk - 1).bit_length()))


def make_plan(shapes: Mapping[str, tuple[int, ...]],
              logical_axes: Mapping[str, Sequence[str] | None], *, stage: int, data_size: int, persistence_threshold: int,
              frozen: Collection[str] = (), frozen_storage_bits: int = 0,
              frozen_group_size: int = 2048) -> ShardingPlan:
    """Decides the layout of every leaf.

    A leaf is `stacked` when its first logical axis is 'layers'. At stage 3 it is `persistent`
    (its parameter stays replicated) when one unit of it (one layer of a stacked leaf; DeepSpeed
    applies the threshold per parameter, and a stacked leaf is L parameters) has fewer elements than
    `persistence_threshold`. Leaves in `frozen` are not trained; with `frozen_storage_bits`
    (4 or 8; ZeRO++'s quantized_nontrainable_weights) the partitioned ones among them are stored
    as codes in groups of up to `frozen_group_size` elements.
    """
    unknown = set(frozen) - set(shapes)
    if unknown:
        raise ValueError(f"frozen names parameters not in the model: {sorted(unknown)[:5]}")
    leaves = []
    for path, shape in shapes.items():
        names = tuple(logical_axes.get(path) or ())
        stacked = bool(names) and names[0] == LAYERS_AXIS and len(shape) >= 1
        unit = math.prod(shape[1:] if stacked else shape)
        persistent = stage == 3 and unit < persistence_threshold
        trainable = path not in frozen
        partitioned = stage == 3 and not persistent
        quantized = partitioned and not trainable and frozen_storage_bits > 0
        chunk = -(-unit // data_size)
        leaves.append(LeafPlan(
            path=path, shape=tuple(shape), stacked=stacked, persistent=persistent,
            params_partitioned=partitioned,
            # As in DeepSpeed, persistent parameters still have their optimizer state (and fp32
            # update) partitioned: only their compute copy stays whole on every device.
            optimizer_partitioned=stage >= 1 and trainable,
            data_size=data_size, trainable=trainable,
            storage_bits=frozen_storage_bits if quantized else 0,
            storage_group_size=_stored_group_size(chunk, frozen_group_size) if quantized else 0))
    return ShardingPlan(tuple(leaves), stage, data_size, persistence_threshold)


def plan_for(model_def: Any, config: Any, *, data_size: int,
             frozen: Collection[str] = ()) -> ShardingPlan:
    """The plan of a model (`nnx_bridge.ModelDef`) under a `ZeroConfig` on `data_size` devices:
    what `make_step` runs and `estimate_memory` predicts, decided in one place."""
    return make_plan(
        model_def.shape_dict(), model_def.axes_dict(), stage=config.stage, data_size=data_size,
        persistence_threshold=config.persistence_threshold, frozen=frozen,
        frozen_storage_bits=(config.weight_quantization_bits
                             if config.quantized_nontrainable_weights else 0),
        frozen_group_size=config.weight_quantization_group_size)
