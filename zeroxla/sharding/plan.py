"""The sharding plan: for every parameter, how it is stored and how it is computed with.

The difference between a parameter's *storage* layout and its *compute* layout is ZeRO: every
gather, scatter and optimizer slice of the step follows from this table. Both layouts come from
the parameter's logical axis names and a rules table (`zeroxla.sharding.rules`), plus the
persistence threshold:

* storage (`ZERO_STORAGE_RULES`): a partitioned parameter keeps its logical shape, with one dim
  split over the data axes ("node", "local") - per-parameter sharding, as PyTorch FSDP2 does,
  rather than DeepSpeed's flat buffers, so that the optimizer can see every parameter whole
  (`zeroxla.engine.optimizer`). The dim is the first one the data size N divides, one that
  tensor-parallel generation splits (heads, kv_heads, mlp, vocab) before the others, so the
  Hybrid Engine's reshard is at its byte floor (`rules.ZERO_STORAGE_RULES`); when none
  divides, the one needing the least zero padding, padded up to a multiple of N. A stacked
  `LayerStack` parameter keeps its leading `[L]` dim so the layer scan can gather one layer at a
  time.
* compute (`TRAINING_COMPUTE_RULES`): whole on every device while a layer (or a module call)
  runs: gathered just before, released after, re-gathered in backward.

Padding is zero, receives zero gradient, and is cut off (`unpad`) before the model or the
optimizer sees the parameter, so it never leaks into results.

A leaf whose data group is one device (a 1 x 1 mesh; an expert leaf when the expert axis takes
every device of a data group) has nothing to partition: at every stage it is stored, updated and
used whole, its optimizer state too, and at stage 3 it counts as persistent. Partitioned, it
would be gathered and released per layer and all-gathered after each update, over one device
(one H200, stage 3 at 1K tokens: 0.884 of a plain `jax.jit` step from that alone).

Frozen (non-trainable) leaves have no gradient, optimizer state or update; at stage 3 they are
still partitioned and gathered for compute. With ZeRO++'s `quantized_nontrainable_weights` a
frozen partitioned leaf is stored as block-quantized codes of each device's shard (a
`stored_forms.StoredCodes`, quantized once at init by the step layer, `zeroxla.engine.stored`, and
never again): per device, `[L?, G, group_size * bits / 8]` int8 codes and `[L?, G]` float32
scales, G = chunk / group_size, chunk = the elements of one layer's shard. Its groups are cut
on the logical tensor, not on the shards (`frozen_code_groups`): runs of `group_size` elements
within a row (the dims after its first data-role dim), a size dividing the row, and a shard dim
whose boundaries fall between rows. So every shard on every mesh is a whole number of the same
groups, and a checkpoint's codes and steps restore onto any mesh bit for bit
(`zeroxla.checkpoint.codes`).

Under a 16-bit compute dtype at stages 1-2, and for stage 3's persistent leaves, a leaf whose
optimizer state is partitioned while its parameter is replicated is stored as DeepSpeed's
bf16/fp16 optimizers store it: the float32 master is this device's
partition (padded, laid out like the optimizer state) and the state also holds a replicated
copy in the compute dtype, the one forward and backward read (`stored_forms.MasterWithCopy`,
`LeafPlan.compute_copy_dtype`). The update casts the new float32 partition to 16 bits and
all-gathers that: the all-gather after the optimizer moves half the float32 bytes, and the
master is never rounded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeroxla.sharding.leaf_plan import LAYERS_AXIS, LeafPlan
from zeroxla.sharding.stored_forms import StoredCodes
from zeroxla.sharding.mesh import LOCAL_AXIS, MeshAxes
from zeroxla.sharding.rules import TRAINING_COMPUTE_RULES, ZERO_STORAGE_RULES, AxisRules


def _spec_text(spec: Any) -> str:
    if isinstance(spec, StoredCodes):
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

    def param_specs(self) -> dict[str, Any]:
        return {leaf.path: leaf.param_spec for leaf in self.leaves}

    def compute_input_specs(self) -> dict[str, Any]:
        """`{path: spec}` of what compute reads of each parameter (`compute_inputs`)."""
        return {leaf.path: leaf.compute_input_spec for leaf in self.leaves}

    def compute_inputs(self, params: dict[str, Any]) -> dict[str, Any]:
        """`state.params` -> what compute reads: a leaf stored with a 16-bit compute copy
        (`MasterWithCopy`) gives the copy, never its float32 master partition."""
        return {leaf.path: leaf.compute_input(params[leaf.path]) for leaf in self.leaves}

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
                _spec_text(leaf.compute_input_spec if leaf.params_partitioned
                           else leaf.optimizer_spec),
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
        if any(None in leaf.logical_axes for leaf in self.leaves):
            lines.append("logical axis '-': a dim the model does not name (a Param without "
                         "logical_axes, e.g. nnx.Linear's); the rules' '*' entry (the default "
                         "rule) decides its layout")
        if self.aliases:
            lines.append("shared parameters (one partition and optimizer state; gathered at "
                         "each use, gradients summed over the uses):")
            lines.extend(f"  {alias} -> {canonical}" for alias, canonical in self.aliases)
        if self.pipeline_description:
            lines.append(self.pipeline_description)
        return "\n".join(lines)


def frozen_code_groups(shape: Sequence[int], data_dims: Sequence[int], *, bits: int,
                       group_size: int) -> tuple[int, tuple[int, ...]]:
    """The quantization groups of a frozen leaf stored as codes, and the dims that may carry
    its partition: `(g, dims)`.

    Groups live on the logical tensor, independent of the mesh: a *row* is the elements after
    the first data-role dim k0 at fixed indices up to k0 (one layer of a stacked leaf at a
    time), R = prod(shape[k0 + 1:]) long; a group is g consecutive elements of a row, g the
    largest divisor of R not above `group_size` (even under int4, whose bytes pair codes).
    A shard cut along dim k is a whole number of groups exactly when g divides
    prod(shape[k + 1:]); `dims` are those data-role dims (k0 always among them), so neither a
    shard boundary nor the zero padding ever splits a group, whatever the data size, and the
    codes of one mesh are the codes of every other. (0, ()) when no g >= 2 exists (a row of
    one element, or an odd row under int4): codes would not be smaller than float32, and the
    leaf stays float32.
    """
    if not data_dims:
        return 0, ()
    row = math.prod(shape[data_dims[0] + 1:])
    divisors = {d for k in range(1, math.isqrt(row) + 1) if row % k == 0 for d in (k, row // k)}
    g = max((d for d in divisors if d <= group_size and (bits != 4 or d % 2 == 0)), default=0)
    if g < 2:
        return 0, ()
    return g, tuple(k for k in data_dims if math.prod(shape[k + 1:]) % g == 0)


def _compute_copy_dtype(stage: int, compute_dtype: str, partitioned: bool,
                        optimizer_partitioned: bool, master_offloaded: bool) -> str:
    """The compute copy a leaf is stored with (`MasterWithCopy`): under 16-bit compute, for a
    leaf whose optimizer state (and so its float32 update) is partitioned while its parameter is
    used whole (stages 1-2; stage 3's persistent leaves, DeepSpeed's `ds_persist` parameters,
    which its bf16/fp16 optimizer also keeps as a 16-bit parameter beside a float32 master
    partition), DeepSpeed's layout: the updated partition is all-gathered in 16 bits into a
    16-bit replicated copy, instead of in float32 into a float32 replicated master. What the
    forward reads is the copy (`LeafPlan.compute_input`), on every path: training, evaluation,
    the stage-3 inference baseline.

    At stage 3 with the optimizer offloaded (`master_offloaded`), a partitioned leaf is stored
    as DeepSpeed's ZeRO-Offload stores it: a 16-bit partition on the device, gathered for each
    use, beside the float32 master partition in host memory (`zeroxla.engine.offload`); the
    update casts the new master to 16 bits, with no gather. Without offload the float32
    partition is the only copy (no 16-bit one is worth its bytes beside it)."""
    sixteen = jnp.dtype(compute_dtype).itemsize == 2
    if stage in (1, 2, 3) and sixteen and optimizer_partitioned and not partitioned:
        return jnp.dtype(compute_dtype).name
    if stage == 3 and sixteen and optimizer_partitioned and partitioned and master_offloaded:
        return jnp.dtype(compute_dtype).name
    return ""


def make_plan(shapes: Mapping[str, tuple[int, ...]],
              logical_axes: Mapping[str, Sequence[str | None] | None], *, stage: int,
              axes: MeshAxes, persistence_threshold: int, frozen: Collection[str] = (),
              frozen_storage_bits: int = 0, frozen_group_size: int = 2048,
              storage_rules: AxisRules = ZERO_STORAGE_RULES,
              compute_rules: AxisRules = TRAINING_COMPUTE_RULES,
              master_dtype: str = "float32", compute_dtype: str = "float32",
              master_offloaded: bool = False) -> ShardingPlan:
    """Decides the layout of every leaf.

    A leaf is `stacked` when its first logical axis is 'layers'. At stage 3 it is `persistent`
    (its parameter stays replicated) when one unit of it (one layer of a stacked leaf; DeepSpeed
    applies the threshold per parameter, and a stacked leaf is L parameters) has fewer elements
    than `persistence_threshold`, or when its data group (`LeafPlan.data_size`) is one device:
    then no stage partitions it, its optimizer state included. Leaves in `frozen` are not
    trained; with `frozen_storage_bits`
    (4 or 8; ZeRO++'s quantized_nontrainable_weights) the partitioned ones among them are stored
    as codes in groups of up to `frozen_group_size` elements (`frozen_code_groups`).
    `master_offloaded`: the float32 masters live in host memory (`offload_optimizer`), which
    gives stage 3's partitioned leaves a 16-bit device partition (`_compute_copy_dtype`).
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
        group, code_dims = 0, None        # frozen codes: groups on the logical tensor
        if partitioned and not trainable and frozen_storage_bits > 0 and shape:
            group, code_dims = frozen_code_groups(
                shape, storage_rules.data_dims(names, len(shape)), bits=frozen_storage_bits,
                group_size=frozen_group_size)
        assignment, assignment_dim, padded = _data_assignment(
            path, shape, names, stacked, axes, storage_rules, code_dims if group else None)
        data_group = _data_group(assignment, axes)
        # A ZeRO group of one device (a 1 x 1 mesh; an expert leaf whose experts the expert
        # axis takes from every device of its group): a partition is the whole leaf, so no
        # stage partitions it: nothing is gathered, released or all-gathered after the update.
        lone = data_group["data_size"] == 1
        splits = assignment is not None and assignment.data_dim is not None and not lone
        persistent = persistent or (stage == 3 and lone)
        partitioned = partitioned and splits
        optimizer_partitioned = stage >= 1 and trainable and splits
        compute = compute_rules.spec(shape, names, axes, partition_data=False).spec \
            if shape else P()
        quantized = partitioned and group > 0
        leaf = LeafPlan(
            path=path, shape=shape, logical_axes=names, stacked=stacked, persistent=persistent,
            params_partitioned=partitioned,
            # As in DeepSpeed, persistent parameters still have their optimizer state (and fp32
            # update) partitioned: only their compute copy stays whole on every device.
            optimizer_partitioned=optimizer_partitioned,
            shard_dim=assignment_dim, **data_group,
            padded_size=padded if shape else 1, compute_spec=compute, trainable=trainable,
            master_dtype=master_dtype,
            compute_copy_dtype=_compute_copy_dtype(stage, compute_dtype, partitioned,
                                                   optimizer_partitioned,
                                                   master_offloaded))
        if quantized:
            leaf = dataclasses.replace(
                leaf, storage_bits=frozen_storage_bits,
                storage_group_size=group)
        leaves.append(leaf)
    return ShardingPlan(tuple(leaves), stage, axes.data_size, persistence_threshold,
                        axes.describe(), storage_rules, compute_rules)


def _data_assignment(path: str, shape: tuple[int, ...], names: tuple[str | None, ...],
                     stacked: bool, axes: MeshAxes, storage_rules: AxisRules,
                     data_dims: Collection[int] | None) -> tuple[Any, int, int]:
    """Where the storage rules put a leaf's data partition: `(assignment, dim, padded size of
    dim)`; `(None, 0, 1)` for a scalar (nothing to split). ValueError when the rules give a
    stacked leaf's layer dim to the data axes or the expert axis does not divide its experts."""
    if not shape:
        return None, 0, 1
    # The rules never give the layer dim to the data axes: the scan gathers one layer at a time.
    assignment = storage_rules.spec(shape, names, axes, data_dims=data_dims)
    if stacked and assignment.data_dim == 0:
        raise ValueError(f"storage rules {storage_rules.name!r} give the layer dim of "
                         f"{path!r} to the data axes; map 'layers' to None or 'stage'")
    _check_expert_split(path, shape, assignment, axes)
    dim = assignment.data_dim if assignment.data_dim is not None else 0
    return assignment, dim, assignment.padded_shape[dim]


def _check_expert_split(path: str, shape: tuple[int, ...], assignment: Any,
                        axes: MeshAxes) -> None:
    """ValueError when the expert axis does not divide a leaf's experts (DeepSpeed-MoE needs
    `ep_size` to divide `num_experts` too): naming the leaf, E, EP and the degrees accepted,
    those dividing E and a node's local x expert devices (what `make_mesh` builds with the
    mesh's other axes as they are)."""
    room = axes.size(LOCAL_AXIS) * axes.expert_size
    for dim, role in assignment.unsplit:
        if role == "expert":
            accepted = [d for d in range(1, shape[dim] + 1)
                        if shape[dim] % d == 0 and room % d == 0]
            raise ValueError(
                f"parameter {path!r} has {shape[dim]} experts (dim {dim}), which the mesh's "
                f"'expert' axis of {axes.expert_size} does not divide: each device holds E / "
                f"EP whole experts; accepted: make_mesh(..., expert=) one of {accepted} (the "
                f"degrees dividing both the {shape[dim]} experts and the {room} devices of a "
                "node's local x expert axes)")


def _data_group(assignment: Any, axes: MeshAxes) -> dict[str, Any]:
    """A leaf's data axes and their size (its expert-data group when its experts are split
    over the expert axis), with the expert split's fields."""
    if assignment is None or assignment.expert_dim is None:
        return dict(data_size=axes.data_size, data_axes=axes.data)
    return dict(data_size=axes.data_size // axes.expert_size, data_axes=axes.expert_data,
                expert_dim=assignment.expert_dim, expert_axis=axes.expert,
                expert_size=axes.expert_size)


def plan_for(model_def: Any, config: Any, axes: MeshAxes, *,
             frozen: Collection[str] = ()) -> ShardingPlan:
    """The plan of a model (`zeroxla.sharding.model_def.ModelDef`) under a `ZeroConfig` on a mesh
    with `axes`: what `make_step` runs and `estimate_memory` predicts, decided in one place."""
    plan = make_plan(
        model_def.shape_dict(), model_def.axes_dict(), stage=config.stage, axes=axes,
        persistence_threshold=config.persistence_threshold, frozen=frozen,
        frozen_storage_bits=(config.weight_quantization_bits
                             if config.quantized_nontrainable_weights else 0),
        frozen_group_size=config.weight_quantization_group_size,
        master_dtype=jnp.dtype(config.master_dtype).name, compute_dtype=config.compute_dtype,
        master_offloaded=config.offload_optimizer != "none")
    alone = set(model_def.gathered_alone)
    leaves = tuple(dataclasses.replace(leaf, gathered_alone=leaf.path in alone)
                   for leaf in plan.leaves)
    return dataclasses.replace(plan, leaves=leaves, aliases=model_def.aliases)
