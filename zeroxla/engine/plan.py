"""The sharding plan: for every parameter, how it is stored and how it is computed with.

The difference between a parameter's *storage* layout and its *compute* layout is ZeRO: every
gather, scatter and optimizer slice of the step follows from this table. Both layouts come from
the parameter's logical axis names and a rules table (`zeroxla.engine.rules`), plus the
persistence threshold:

* storage (`ZERO_STORAGE_RULES`): a partitioned parameter keeps its logical shape, with one dim
  split over the data axes ("node", "local") - per-parameter sharding, as PyTorch FSDP2 does,
  rather than DeepSpeed's flat buffers, so that the optimizer can see every parameter whole
  (`zeroxla.engine.optimizer`). The dim is the first one the data size N divides; when none
  does, the one needing the least zero padding, padded up to a multiple of N. A stacked
  `LayerStack` parameter keeps its leading `[L]` dim so the layer scan can gather one layer at a
  time.
* compute (`TRAINING_COMPUTE_RULES`): whole on every device while a layer (or a module call)
  runs: gathered just before, released after, re-gathered in backward.

Padding is zero, receives zero gradient, and is cut off (`unpad`) before the model or the
optimizer sees the parameter, so it never leaks into results.

Frozen (non-trainable) leaves have no gradient, optimizer state or update; at stage 3 they are
still partitioned and gathered for compute. With ZeRO++'s `quantized_nontrainable_weights` a
frozen partitioned leaf is stored as block-quantized codes of each device's shard (a
`QuantizedArray`, quantized once at init and never again): per device, `[L?, G, group_size *
bits / 8]` int8 codes and `[L?, G]` float32 scales, G = ceil(chunk / group_size), chunk = the
elements of one layer's shard.

Under a 16-bit compute dtype at stages 1-2, a leaf whose optimizer state is partitioned is
stored as DeepSpeed's bf16/fp16 optimizers store it: the float32 master is this device's
partition (padded, laid out like the optimizer state) and the state also holds a replicated
copy in the compute dtype, the one forward and backward read (`MasterWithCopy`,
`LeafPlan.compute_copy_dtype`). The update casts the new float32 partition to 16 bits and
all-gathers that: the all-gather after the optimizer moves half the float32 bytes, and the
master is never rounded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroxla.engine.mesh import MeshAxes
from zeroxla.engine.rules import TRAINING_COMPUTE_RULES, ZERO_STORAGE_RULES, AxisRules
from zeroxla.pallas_kernels import QuantizedArray, dequantize, quantize

LAYERS_AXIS = "layers"


@dataclasses.dataclass(frozen=True)
class MasterWithCopy:
    """A stage 1-2 leaf's storage under 16-bit compute (DeepSpeed's bf16/fp16 optimizers):
    `master`, the float32 master weights, partitioned (global `padded_shape`, sharded like the
    optimizer state), and `compute`, their rounding to the compute dtype, replicated over the
    data axes. Only `master` is updated by the optimizer and saved in checkpoints; `compute` is
    re-gathered from it in 16 bits after every update and rebuilt from it on restore, so it is
    always `master` cast to the compute dtype."""

    master: Any
    compute: Any


jax.tree_util.register_dataclass(MasterWithCopy, ["master", "compute"], [])


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Layout of one parameter. `path` is its '/'-joined nnx path (e.g. 'blocks/layers/wq')."""

    path: str
    shape: tuple[int, ...]                       # logical shape
    logical_axes: tuple[str | None, ...]
    stacked: bool              # dim 0 is the layer dim of a LayerStack
    persistent: bool           # under the persistence threshold: parameter replicated at stage 3
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
    # replicated compute copy stored beside the partitioned master (`MasterWithCopy`); "": the
    # leaf is stored as one array.
    compute_copy_dtype: str = ""
    # Pipeline storage (`zeroxla.pipeline.storage`): a stacked leaf's layers split over the
    # mesh's `stage_axis`. Its stored layer dim has `stage_count * local_layers` slots, stage s
    # holding slots [s * local_layers, (s + 1) * local_layers); slot r holds logical layer
    # `stage_slots[r]`, or is padding (-1: zero, never updated, cut off by `unpad` before the
    # optimizer or a norm sees the parameter). () : not split.
    stage_axis: str | None = None
    stage_slots: tuple[int, ...] = ()
    stage_count: int = 1

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
    def padding(self) -> int:
        """Zero elements added by the partitioned layout."""
        return math.prod(self.padded_shape) - self.numel

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """Shape of what one layer (or one call) uses: the parameter without its layer dim."""
        return self.shape[1:] if self.stacked else self.shape

    @property
    def unit_shard_dim(self) -> int:
        """`shard_dim` within one unit (one layer of a stacked leaf)."""
        return self.shard_dim - 1 if self.stacked else self.shard_dim

    @property
    def unit_padded_shape(self) -> tuple[int, ...]:
        return self.padded_shape[1:] if self.stacked else self.padded_shape

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
        """Unpartitioned over the data axes: replicated, or split over the stages."""
        if not self.stage_split:
            return P()
        return P(self.stage_axis, *([None] * (len(self.shape) - 1)))

    def _data_spec(self) -> P:
        entries: list[Any] = list(self._stage_spec()) or [None] * len(self.shape)
        entries[self.shard_dim] = self.data_axes
        return P(*entries)

    @property
    def has_compute_copy(self) -> bool:
        """Stored as a `MasterWithCopy`: a partitioned master and a replicated 16-bit copy."""
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
        return self._stage_spec() if self.has_compute_copy else self.param_spec

    def compute_input(self, stored: Any) -> Any:
        """`state.params[path]` -> what the gradient pass reads: the compute copy where the leaf
        has one, else the stored parameter (cast to the compute dtype where it is used)."""
        return stored.compute if self.has_compute_copy else stored

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Global shape of the stored parameter (of its dequantized values when quantized)."""
        return self.padded_shape if self.master_partitioned else self.slotted_shape

    @property
    def param_spec(self) -> P | QuantizedArray:
        """Sharding of the stored parameter: one spec, or a `QuantizedArray` of specs."""
        if self.params_quantized:
            lead = (None,) if self.stacked else ()
            return self._quantized_storage(P(*lead, self.data_axes, None),
                                           P(*lead, self.data_axes))
        if self.has_compute_copy:
            return MasterWithCopy(master=self._data_spec(), compute=self._stage_spec())
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

    def param_struct(self) -> jax.ShapeDtypeStruct | QuantizedArray:
        """Abstract stored parameter (global shape and dtype), the shape of `state.params`."""
        if self.has_compute_copy:
            return MasterWithCopy(
                master=jax.ShapeDtypeStruct(self.param_shape, self.master_dtype),
                compute=jax.ShapeDtypeStruct(self.slotted_shape, self.compute_copy_dtype))
        if not self.params_quantized:
            return jax.ShapeDtypeStruct(self.param_shape, self.master_dtype)
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
        itemsize = jnp.dtype(self.master_dtype).itemsize
        unit = self.chunk if self.master_partitioned else self.unit_numel
        copy = (jnp.dtype(self.compute_copy_dtype).itemsize * self.local_layers * self.unit_numel
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
        widths = [(0, 0)] * x.ndim
        widths[self.shard_dim] = (0, self.padded_size - self.shape[self.shard_dim])
        return jnp.pad(x, widths)

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
        widths = [(0, 0)] * unit.ndim
        widths[self.unit_shard_dim] = (0, self.padded_size - self.shape[self.shard_dim])
        return jnp.pad(unit, widths)

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

    def _quantized_storage(self, data: Any, scales: Any) -> QuantizedArray:
        # `shape` is what one device's codes stand for: its shard [L?, chunk].
        shape = (self.layers, self.chunk) if self.stacked else (self.chunk,)
        return QuantizedArray(data=data, scales=scales, offsets=None, shape=shape,
                              bits=self.storage_bits, group_size=self.storage_group_size)

    def quantize_partitioned(self, x: jax.Array) -> QuantizedArray:
        """Padded layout -> stored codes: each device's shard is quantized on its own, so a
        device holds exactly the codes and scales of its shard."""
        rows = self.shards_of(x).reshape(self.layers * self.data_size, self.chunk)
        # Runs once, at init: the jnp path, which vmaps over rows on every backend.
        q = jax.vmap(lambda c: quantize(c, bits=self.storage_bits,
                                        group_size=self.storage_group_size, impl="jnp"))(rows)
        lead = (self.layers,) if self.stacked else ()
        groups = self.data_size * self.storage_groups
        return self._quantized_storage(
            q.data.reshape(*lead, groups, q.data.shape[-1]),                # [L?, N*G, packed]
            q.scales.reshape(*lead, groups))                                # [L?, N*G]

    def dequantize_partitioned(self, q: QuantizedArray) -> jax.Array:
        """Stored codes (global) -> float32 padded layout."""
        rows = self.layers * self.data_size
        per_device = QuantizedArray(
            data=q.data.reshape(rows, self.storage_groups, -1),
            scales=q.scales.reshape(rows, self.storage_groups), offsets=None,
            shape=(rows, self.chunk), bits=q.bits, group_size=q.group_size)
        flat = dequantize(per_device)                                      # [L*N, chunk]
        lead = (self.layers,) if self.stacked else ()
        return self.from_shards(flat.reshape(*lead, self.data_size, self.chunk))

    def unit_codes(self, q: QuantizedArray) -> QuantizedArray:
        """One device's codes of one unit (one layer, sliced by the scan, or the whole leaf),
        as a one-row `QuantizedArray` of `chunk` elements."""
        return QuantizedArray(data=q.data, scales=q.scales, offsets=None, shape=(self.chunk,),
                              bits=q.bits, group_size=q.group_size)

    def storage_to_logical(self, stored: Any) -> jax.Array:
        """`state.params[path]` (global, any storage) -> master dtype, the logical `shape`."""
        if self.params_quantized:
            stored = self.dequantize_partitioned(stored)
        if self.has_compute_copy:
            stored = stored.master           # the float32 master, never its 16-bit copy
        return self.unpad(stored) if self.master_partitioned else self.stage_unpad(stored)

    def logical_to_storage(self, x: jax.Array) -> Any:
        """Inverse of `storage_to_logical` (up to quantization for quantized storage)."""
        x = jnp.asarray(x, self.master_dtype)
        if self.has_compute_copy:
            return MasterWithCopy(master=self.pad(x),
                                  compute=self.stage_pad(x).astype(self.compute_copy_dtype))
        if not self.params_partitioned:
            return self.stage_pad(x)
        padded = self.pad(x)
        return self.quantize_partitioned(padded) if self.params_quantized else padded

    # ---- words -------------------------------------------------------------------------------
    def storage_kind(self) -> str:
        frozen = "" if self.trainable else ", frozen"
        if self.params_partitioned:
            codes = (f" as int{self.storage_bits} codes (groups of {self.storage_group_size})"
                     if self.params_quantized else "")
            split = ", layers split over stages" if self.stage_split else ""
            return f"partitioned dim {self.shard_dim}" + codes + split + frozen
        if self.has_compute_copy:
            return (f"replicated {self.compute_copy_dtype} copy (float32 master, optimizer state "
                    f"partitioned dim {self.shard_dim})")
        kind = "replicated: under persistence threshold" if self.persistent else "replicated"
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


def _spec_text(spec: Any) -> str:
    if isinstance(spec, QuantizedArray):
        spec = spec.data
    entries = []
    for entry in spec:
        if entry is None:
            entries.append("-")
        elif isinstance(entry, tuple):
            entries.append("+".join(entry))
        else:
            entries.append(str(entry))
    return "[" + ", ".join(entries) + "]" if entries else "[]"


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The table of `LeafPlan`s for a model under one ZeRO stage on N data-parallel devices."""

    leaves: tuple[LeafPlan, ...]
    stage: int
    data_size: int
    persistence_threshold: int
    mesh_description: str = ""
    storage_rules: AxisRules = ZERO_STORAGE_RULES
    compute_rules: AxisRules = TRAINING_COMPUTE_RULES
    # Shared weights: (alias path, canonical path); one leaf each, gradients summed over uses.
    aliases: tuple[tuple[str, str], ...] = ()
    # Pipelined: which stage holds which layers (`StageSplit.describe`), printed by `describe`.
    pipeline_description: str = ""

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
        """The rules, then one row per parameter: logical shape and axes, storage layout and
        spec, per-device shard, padding, compute layout."""
        header = ("parameter", "shape", "logical axes", "storage", "storage spec",
                  "per-device shard", "pad", "compute", "compute spec")
        rows = [header]
        for leaf in self.leaves:
            if leaf.params_partitioned:
                shard = ((leaf.local_layers,) if leaf.stacked else ()) + leaf.shard_shape
            else:
                shard = ((leaf.local_layers,) if leaf.stacked else ()) + leaf.unit_shape
            padded = leaf.params_partitioned or leaf.optimizer_partitioned
            rows.append((
                leaf.path, "x".join(map(str, leaf.shape)) or "scalar",
                ",".join(a or "-" for a in leaf.logical_axes) or "-",
                leaf.storage_kind(),
                _spec_text(leaf.param_spec if leaf.params_partitioned else leaf.optimizer_spec),
                "x".join(map(str, shard)) or "scalar",
                str(leaf.padding if padded else 0), leaf.compute_kind(),
                _spec_text(leaf.compute_spec)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"ZeRO stage {self.stage} over {self.data_size} data-parallel devices"
                 + (f" (mesh {self.mesh_description})" if self.mesh_description else "")
                 + f", persistence threshold {self.persistence_threshold} elements",
                 f"storage rules: {self.storage_rules.describe()}",
                 f"compute rules: {self.compute_rules.describe()}"]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if self.aliases:
            lines.append("shared parameters (one partition and optimizer state; gathered at "
                         "each use, gradients summed over the uses):")
            lines.extend(f"  {alias} -> {canonical}" for alias, canonical in self.aliases)
        if self.pipeline_description:
            lines.append(self.pipeline_description)
        return "\n".join(lines)


def _stored_group_size(chunk: int, group_size: int) -> int:
    """Group size of a shard's stored codes: `group_size`, or for a shard smaller than one group
    the power of two >= chunk (at least 2, so int4 codes pair up), so a small shard is not padded
    to a whole large group."""
    return min(group_size, max(2, 1 << (chunk - 1).bit_length()))


def _compute_copy_dtype(stage: int, compute_dtype: str, partitioned: bool,
                        optimizer_partitioned: bool) -> str:
    """The compute copy a leaf is stored with (`MasterWithCopy`): at stages 1-2 under 16-bit
    compute, for a leaf whose optimizer state (and so its float32 update) is partitioned while
    its parameter is used whole, DeepSpeed's layout: the updated partition is all-gathered in 16
    bits into a 16-bit replicated copy, instead of in float32 into a float32 replicated master.
    Stage 3's persistent leaves keep one float32 replicated array (the stage-3 inference paths
    read `state.params` as stored)."""
    sixteen = jnp.dtype(compute_dtype).itemsize == 2
    if stage in (1, 2) and sixteen and optimizer_partitioned and not partitioned:
        return jnp.dtype(compute_dtype).name
    return ""


def make_plan(shapes: Mapping[str, tuple[int, ...]],
              logical_axes: Mapping[str, Sequence[str | None] | None], *, stage: int,
              axes: MeshAxes, persistence_threshold: int, frozen: Collection[str] = (),
              frozen_storage_bits: int = 0, frozen_group_size: int = 2048,
              storage_rules: AxisRules = ZERO_STORAGE_RULES,
              compute_rules: AxisRules = TRAINING_COMPUTE_RULES,
              master_dtype: str = "float32", compute_dtype: str = "float32") -> ShardingPlan:
    """Decides the layout of every leaf.

    A leaf is `stacked` when its first logical axis is 'layers'. At stage 3 it is `persistent`
    (its parameter stays replicated) when one unit of it (one layer of a stacked leaf; DeepSpeed
    applies the threshold per parameter, and a stacked leaf is L parameters) has fewer elements
    than `persistence_threshold`. Leaves in `frozen` are not trained; with `frozen_storage_bits`
    (4 or 8; ZeRO++'s quantized_nontrainable_weights) the partitioned ones among them are stored
    as codes in groups of up to `frozen_group_size` elements.
    """
    unknown = set(frozen) - set(shapes)
    if unknown:
        raise ValueError(f"frozen names parameters not in the model: {sorted(unknown)[:5]}")
    leaves = []
    for path, shape in shapes.items():
        shape = tuple(shape)
        names = tuple(logical_axes.get(path) or ()) or (None,) * len(shape)
        if len(names) != len(shape):
            raise ValueError(f"parameter {path!r} has shape {shape} but {len(names)} logical "
                             f"axes {names}; give one name per dim")
        stacked = bool(names) and names[0] == LAYERS_AXIS
        unit = math.prod(shape[1:] if stacked else shape)
        persistent = stage == 3 and unit < persistence_threshold
        trainable = path not in frozen
        partitioned = stage == 3 and not persistent
        if not shape:           # a scalar: nothing to split; always replicated
            assignment_dim, padded = 0, 1
            partitioned, optimizer_partitioned = False, False
        else:
            # The rules never give the layer dim to the data axes: the scan gathers one layer
            # at a time.
            assignment = storage_rules.spec(shape, names, axes)
            if stacked and assignment.data_dim == 0:
                raise ValueError(f"storage rules {storage_rules.name!r} give the layer dim of "
                                 f"{path!r} to the data axes; map 'layers' to None or 'stage'")
            assignment_dim = assignment.data_dim if assignment.data_dim is not None else 0
            padded = assignment.padded_shape[assignment_dim]
            optimizer_partitioned = stage >= 1 and trainable and assignment.data_dim is not None
            partitioned = partitioned and assignment.data_dim is not None
        compute = compute_rules.spec(shape, names, axes, partition_data=False).spec \
            if shape else P()
        quantized = partitioned and not trainable and frozen_storage_bits > 0
        leaf = LeafPlan(
            path=path, shape=shape, logical_axes=names, stacked=stacked, persistent=persistent,
            params_partitioned=partitioned,
            # As in DeepSpeed, persistent parameters still have their optimizer state (and fp32
            # update) partitioned: only their compute copy stays whole on every device.
            optimizer_partitioned=optimizer_partitioned,
            data_size=axes.data_size, data_axes=axes.data, shard_dim=assignment_dim,
            padded_size=padded if shape else 1, compute_spec=compute, trainable=trainable,
            master_dtype=master_dtype,
            compute_copy_dtype=_compute_copy_dtype(stage, compute_dtype, partitioned,
                                                   optimizer_partitioned))
        if quantized:
            leaf = dataclasses.replace(
                leaf, storage_bits=frozen_storage_bits,
                storage_group_size=_stored_group_size(leaf.chunk, frozen_group_size))
        leaves.append(leaf)
    return ShardingPlan(tuple(leaves), stage, axes.data_size, persistence_threshold,
                        axes.describe(), storage_rules, compute_rules)


def plan_for(model_def: Any, config: Any, axes: MeshAxes, *,
             frozen: Collection[str] = ()) -> ShardingPlan:
    """The plan of a model (`zeroxla.engine.model_def.ModelDef`) under a `ZeroConfig` on a mesh
    with `axes`: what `make_step` runs and `estimate_memory` predicts, decided in one place."""
    plan = make_plan(
        model_def.shape_dict(), model_def.axes_dict(), stage=config.stage, axes=axes,
        persistence_threshold=config.persistence_threshold, frozen=frozen,
        frozen_storage_bits=(config.weight_quantization_bits
                             if config.quantized_nontrainable_weights else 0),
        frozen_group_size=config.weight_quantization_group_size,
        master_dtype=jnp.dtype(config.master_dtype).name, compute_dtype=config.compute_dtype)
    alone = set(model_def.gathered_alone)
    leaves = tuple(dataclasses.replace(leaf, gathered_alone=leaf.path in alone)
                   for leaf in plan.leaves)
    return dataclasses.replace(plan, leaves=leaves, aliases=model_def.aliases)
