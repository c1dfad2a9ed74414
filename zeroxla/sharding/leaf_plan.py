"""One parameter's layout (`LeafPlan`): its storage and compute shapes and specs, and the
pure layout conversions between them (padding, stage slots, expert blocks, per-device shards);
the stored forms that are pytrees are `stored_forms`' (`MasterWithCopy`, `StoredCodes`).
`zeroxla.sharding.plan` decides these for a whole model (`make_plan`) and prints the table
(`ShardingPlan.describe`); the module docstring there says what each layout means and why. The
plan only names bit widths and group sizes: quantizing and dequantizing stored codes is the step
layer's (`zeroxla.engine.stored`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroxla.sharding.stored_forms import MasterWithCopy, StoredCodes


LAYERS_AXIS = "layers"


def pad_along(x: jax.Array, dim: int, pad: int) -> jax.Array:
    """`x` with `pad` zeros appended along its dim `dim`."""
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, pad)
    return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Layout of one parameter. `path` is its '/'-joined nnx path (e.g. 'blocks/layers/wq')."""

    path: str
    shape: tuple[int, ...]                       # logical shape
    logical_axes: tuple[str | None, ...]
    stacked: bool              # dim 0 is the layer dim of a LayerStack
    persistent: bool           # under the persistence threshold (or a data group of one
                               # device): parameter replicated at stage 3
    params_partitioned: bool   # parameter storage partitioned (stage 3, not persistent)
    optimizer_partitioned: bool  # optimizer state partitioned (stage >= 1, trainable)
    data_size: int
    data_axes: tuple[str, ...]
    shard_dim: int             # the dim of `shape` split over the data axes when partitioned
    padded_size: int           # `shape[shard_dim]` rounded up to a multiple of data_size
    compute_spec: P = P()      # the compute layout (over the logical shape)
    trainable: bool = True     # False: frozen, no gradient / optimizer state / update
    # quantized_nontrainable_weights: a frozen partitioned leaf stored as codes of this many bits
    # in groups of `storage_group_size` elements; 0 keeps it float32.
    storage_bits: int = 0
    storage_group_size: int = 0
    # Owned by a module that also has children: gathered alone, once, when the step's model copy
    # is built (`zeroxla.engine.gather.gathered_value`), not around each call of its module.
    gathered_alone: bool = False
    # The stored (master) weights' dtype: float32, or float64 in a float64 verification run.
    master_dtype: str = "float32"
    # Stage 1-2 under bf16/fp16 compute, optimizer state partitioned: the dtype of the
    # replicated compute copy stored beside the partitioned master (`MasterWithCopy`); at stage
    # 3 with the optimizer offloaded, a partitioned leaf's 16-bit partition beside its float32
    # master (in host memory); "": the leaf is stored as one array.
    compute_copy_dtype: str = ""
    # Pipeline storage (`zeroxla.pipeline.storage`): a stacked leaf's layers split over the
    # mesh's `stage_axis`. Its stored layer dim has `stage_count * local_layers` slots, stage s
    # holding slots [s * local_layers, (s + 1) * local_layers); slot r holds logical layer
    # `stage_slots[r]`, or is padding (-1: zero, never updated, cut off by `unpad` before the
    # optimizer or a norm sees the parameter). () : not split.
    stage_axis: str | None = None
    stage_slots: tuple[int, ...] = ()
    stage_count: int = 1
    # Expert parallelism: an MoE leaf's `experts` dim (of `shape`) split over `expert_axis`
    # into `expert_size` blocks of E / EP experts; `data_axes` are then its expert-data group.
    # Everything "unit" below is one device's block: E / EP experts. None: not split.
    expert_dim: int | None = None
    expert_axis: str | None = None
    expert_size: int = 1

    # ---- shapes ------------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return self.shape[0] if self.stacked else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stage_split(self) -> bool:
        """Layers stored split over the pipeline stages (`stage_slots`)."""
        return bool(self.stage_slots)

    @property
    def local_layers(self) -> int:
        """Layer slots of the stored leaf on one device: its stage's (all layers when not
        split; 1 for an unstacked leaf)."""
        return len(self.stage_slots) // self.stage_count if self.stage_split else self.layers

    @property
    def slotted_shape(self) -> tuple[int, ...]:
        """`shape` with the layer dim as stored: `stage_count * local_layers` slots if split."""
        if not self.stage_split:
            return self.shape
        return (len(self.stage_slots), *self.shape[1:])

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The partitioned layout's global shape: `slotted_shape` with `shard_dim` padded."""
        shape = list(self.slotted_shape)
        shape[self.shard_dim] = self.padded_size
        return tuple(shape)

    @property
    def shard_padding(self) -> int:
        """Zeros appended along `shard_dim` by the partitioned layout."""
        return self.padded_size - self.shape[self.shard_dim]

    @property
    def padding(self) -> int:
        """Zero elements added by the partitioned layout."""
        return math.prod(self.padded_shape) - self.numel

    @property
    def expert_split(self) -> bool:
        """The leaf's experts are split over the expert axis (`expert_dim`)."""
        return self.expert_dim is not None

    def _local(self, unit: tuple[int, ...]) -> tuple[int, ...]:
        """A unit shape with its expert dim cut to this device's E / EP experts."""
        if not self.expert_split:
            return unit
        shape = list(unit)
        shape[self.expert_dim - (1 if self.stacked else 0)] //= self.expert_size
        return tuple(shape)

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of what one layer (or one call) uses on one device: the parameter without its
        layer dim (with E / EP experts under expert parallelism)."""
        return self._local(self.shape[1:] if self.stacked else self.shape)

    @property
    def unit_shard_dim(self) -> int:
        """`shard_dim` within one unit (one layer of a stacked leaf)."""
        return self.shard_dim - 1 if self.stacked else self.shard_dim

    @property
    def unit_padded_shape(self) -> tuple[int, ...]:
        return self._local(self.padded_shape[1:] if self.stacked else self.padded_shape)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """One device's piece of one unit: `unit_padded_shape` with the shard dim divided by N."""
        shape = list(self.unit_padded_shape)
        shape[self.unit_shard_dim] //= self.data_size
        return tuple(shape)

    @property
    def chunk(self) -> int:
        """Elements of one unit's shard on one device."""
        return math.prod(self.shard_shape)

    @property
    def padded_numel(self) -> int:
        """Elements of one padded unit: what one gather of it assembles (`chunk` x N)."""
        return math.prod(self.unit_padded_shape)

    @property
    def unit_numel(self) -> int:
        return math.prod(self.unit_shape)

    # ---- specs -------------------------------------------------------------------------------
    def _stage_spec(self) -> P:
        """Unpartitioned over the data axes: replicated, or split over the stages and / or
        the expert axis."""
        if not self.stage_split and not self.expert_split:
            return P()
        entries: list[Any] = [None] * len(self.shape)
        if self.stage_split:
            entries[0] = self.stage_axis
        if self.expert_split:
            entries[self.expert_dim] = self.expert_axis
        return P(*entries)

    def _data_spec(self) -> P:
        entries: list[Any] = list(self._stage_spec()) or [None] * len(self.shape)
        entries[self.shard_dim] = self.data_axes
        return P(*entries)

    @property
    def has_compute_copy(self) -> bool:
        """Stored as a `MasterWithCopy`: a partitioned master and a 16-bit copy, replicated
        (stages 1-2, persistent leaves) or partitioned like the master (`params_partitioned`:
        stage 3 with the optimizer offloaded)."""
        return bool(self.compute_copy_dtype)

    @property
    def master_partitioned(self) -> bool:
        """The stored master weights are partitioned over the data axes: stage 3's partitioned
        leaves and the leaves with a compute copy (`params_partitioned` is the compute side:
        gathered for each use)."""
        return self.params_partitioned or self.has_compute_copy

    @property
    def compute_input_spec(self) -> Any:
        """Sharding of what the gradient pass reads (`compute_input`): the compute copy's
        (replicated over the data axes) where the leaf has one, else `param_spec`."""
        if self.has_compute_copy:
            return self._data_spec() if self.params_partitioned else self._stage_spec()
        return self.param_spec

    def compute_input(self, stored: Any) -> Any:
        """`state.params[path]` -> what the gradient pass reads: the compute copy where the leaf
        has one, else the stored parameter (cast to the compute dtype where it is used)."""
        return stored.compute if self.has_compute_copy else stored

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Global shape of the stored parameter (of its dequantized values when quantized)."""
        return self.padded_shape if self.master_partitioned else self.slotted_shape

    @property
    def param_spec(self) -> Any:
        """Sharding of the stored parameter: one spec, or a `StoredCodes` or `MasterWithCopy`
        of specs."""
        if self.params_quantized:
            lead = (None,) if self.stacked else ()
            return StoredCodes(data=P(*lead, self.data_axes, None),
                               scales=P(*lead, self.data_axes))
        if self.has_compute_copy:
            return MasterWithCopy(master=self._data_spec(), compute=self.compute_input_spec)
        return self._data_spec() if self.params_partitioned else self._stage_spec()

    @property
    def optimizer_shape(self) -> tuple[int, ...]:
        """Global shape of the stored optimizer state of this parameter (param-shaped leaves)."""
        return self.padded_shape if self.optimizer_partitioned else self.slotted_shape

    @property
    def optimizer_spec(self) -> P:
        return self._data_spec() if self.optimizer_partitioned else self._stage_spec()

    @property
    def gradient_spec(self) -> P:
        """Layout of the reduced gradient leaving the gradient pass: partitioned with the
        parameter at stage 3 and with the optimizer state at stage 2, else replicated (over the
        data axes; split over the stages when `stage_split`)."""
        return self._data_spec() if self.params_partitioned else self._stage_spec()

    def param_struct(self) -> Any:
        """Abstract stored parameter (global shape and dtype), the shape of `state.params`."""
        if self.has_compute_copy:
            return MasterWithCopy(
                master=jax.ShapeDtypeStruct(self.param_shape, self.master_dtype),
                compute=jax.ShapeDtypeStruct(
                    self.param_shape if self.params_partitioned else self.slotted_shape,
                    self.compute_copy_dtype))
        if not self.params_quantized:
            return jax.ShapeDtypeStruct(self.param_shape, self.master_dtype)
        lead = (self.layers,) if self.stacked else ()
        groups = self.storage_groups * self.data_size
        packed = self.storage_group_size * self.storage_bits // 8
        return StoredCodes(data=jax.ShapeDtypeStruct((*lead, groups, packed), jnp.int8),
                           scales=jax.ShapeDtypeStruct((*lead, groups), jnp.float32))

    @property
    def param_bytes_per_device(self) -> int:
        """Bytes of the stored parameter on one device (codes + scales when quantized)."""
        if self.params_quantized:
            code_bytes = self.storage_group_size * self.storage_bits // 8
            return self.layers * self.storage_groups * (code_bytes + 4)
        itemsize = jnp.dtype(self.master_dtype).itemsize
        unit = self.chunk if self.master_partitioned else self.unit_numel
        copy = (jnp.dtype(self.compute_copy_dtype).itemsize * self.local_layers
                * (self.chunk if self.params_partitioned else self.unit_numel)
                if self.has_compute_copy else 0)
        return itemsize * self.local_layers * unit + copy

    @property
    def optimizer_numel_per_device(self) -> int:
        """Elements of one param-shaped optimizer leaf on one device."""
        unit = self.chunk if self.optimizer_partitioned else self.unit_numel
        return self.local_layers * unit

    # ---- global-array conversions (under jit; XLA partitions them) ---------------------------
    def pad(self, x: jax.Array) -> jax.Array:
        """Logical `shape` -> `padded_shape` (zeros appended along `shard_dim`; layers moved
        to their stage slots when `stage_split`)."""
        return self.stage_pad(self.data_pad(x))

    def unpad(self, x: jax.Array) -> jax.Array:
        """`padded_shape` -> logical `shape` (padding cut off)."""
        return self.data_unpad(self.stage_unpad(x))

    def data_pad(self, x: jax.Array) -> jax.Array:
        """Zeros appended along `shard_dim` only (the layer dim, logical or slotted, as is)."""
        return pad_along(x, self.shard_dim, self.shard_padding)

    def data_unpad(self, x: jax.Array) -> jax.Array:
        """Inverse of `data_pad`."""
        return jax.lax.slice_in_dim(x, 0, self.shape[self.shard_dim], axis=self.shard_dim)

    def _slots_are_layers(self) -> bool:
        return not self.stage_split or self.stage_slots == tuple(range(self.shape[0]))

    def stage_pad(self, x: jax.Array) -> jax.Array:
        """Layer dim logical `[L, ...]` -> stage slots `[S * local_layers, ...]`, padding slots
        zero (the identity when not split, or when every stage holds L / S layers)."""
        if self._slots_are_layers():
            return x
        slots = np.asarray(self.stage_slots)
        rows = jnp.take(x, np.maximum(slots, 0), axis=0)
        real = (slots >= 0).reshape(-1, *([1] * (x.ndim - 1)))
        return jnp.where(real, rows, jnp.zeros((), x.dtype))

    def stage_unpad(self, x: jax.Array) -> jax.Array:
        """Inverse of `stage_pad`: stage slots -> logical layers (padding slots dropped)."""
        if self._slots_are_layers():
            return x
        return jnp.take(x, np.asarray([self.stage_slots.index(layer)
                                       for layer in range(self.shape[0])]), axis=0)

    # ---- one unit inside shard_map -------------------------------------------------------------
    def unit_pad(self, unit: jax.Array) -> jax.Array:
        """A unit of logical shape -> `unit_padded_shape`, ready to reduce-scatter."""
        return pad_along(unit, self.unit_shard_dim, self.shard_padding)

    def unit_unpad(self, unit: jax.Array) -> jax.Array:
        """A gathered unit `unit_padded_shape` -> the unit's logical shape."""
        return jax.lax.slice_in_dim(unit, 0, self.shape[self.shard_dim], axis=self.unit_shard_dim)

    def shards_of(self, x: jax.Array) -> jax.Array:
        """Padded global layout `[L?, ...]` -> every device's shard, flattened: `[L?, N, chunk]`
        (row d is device d's shard in its own row-major order)."""
        lead = 1 if self.stacked else 0
        pieces = jnp.stack(jnp.split(x, self.data_size, axis=self.shard_dim), axis=lead)
        return pieces.reshape(*x.shape[:lead], self.data_size, self.chunk)

    def from_shards(self, rows: jax.Array) -> jax.Array:
        """Inverse of `shards_of`: `[L?, N, chunk]` -> the padded global layout."""
        lead = 1 if self.stacked else 0
        pieces = rows.reshape(*rows.shape[:lead], self.data_size, *self.shard_shape)
        return jnp.concatenate([jax.lax.index_in_dim(pieces, d, lead, keepdims=False)
                                for d in range(self.data_size)], axis=self.shard_dim)

    # ---- quantized storage (quantized_nontrainable_weights) ----------------------------------
    @property
    def params_quantized(self) -> bool:
        """Stored as block-quantized codes (a frozen partitioned leaf under ZeRO++)."""
        return self.storage_bits > 0

    @property
    def storage_groups(self) -> int:
        """Quantization groups in one unit's shard on one device."""
        return -(-self.chunk // self.storage_group_size)

    # ---- words -------------------------------------------------------------------------------
    def storage_kind(self) -> str:
        frozen = "" if self.trainable else ", frozen"
        if self.params_partitioned:
            codes = (f" as int{self.storage_bits} codes (groups of {self.storage_group_size})"
                     if self.params_quantized else "")
            split = ", layers split over stages" if self.stage_split else ""
            copy = (f" as a {self.compute_copy_dtype} copy (float32 master partition apart)"
                    if self.has_compute_copy else "")
            return f"partitioned dim {self.shard_dim}" + codes + copy + split + frozen
        if self.has_compute_copy:
            under = ", under persistence threshold" if self.persistent else ""
            return (f"replicated {self.compute_copy_dtype} copy{under} (float32 master, optimizer "
                    f"state partitioned dim {self.shard_dim})")
        if self.data_size == 1:
            kind = "not partitioned: a data group of one device"
        elif self.persistent:
            kind = "replicated: under persistence threshold"
        else:
            kind = "replicated"
        if self.stage_split:
            kind += " within a stage"
        return kind + frozen + (f" (optimizer state partitioned dim {self.shard_dim})"
                                if self.optimizer_partitioned else "")

    def compute_kind(self) -> str:
        if not self.params_partitioned:
            return "used in place"
        if self.stacked:
            return "gathered per layer in the scan"
        return "gathered alone once per step" if self.gathered_alone else "gathered per module call"
