"""Save and restore a training state: `save`, `Checkpointer` (periodic / async), `restore`.

    zeroxla.save(directory, state, layout=zero_step.layout, metadata={"data_position": 1234})
    restored = zeroxla.restore(directory, zero_step)            # newest complete checkpoint
    restored = zeroxla.restore(directory, (mesh, ZeroConfig(stage=1)),  # model rebuilt from it,
                               optimizer=optax.adamw(1e-3))    # with the run's own optimizer
    state, metadata = restored.state, restored.metadata

    with zeroxla.Checkpointer(directory, keep=2, async_save=True) as checkpointer:
        for ...:
            checkpointer.save(state, layout=zero_step.layout)   # returns once copied to host

What is stored is the state's logical form (`zeroxla.engine.logical`): independent of the mesh,
the ZeRO stage and hpZ, so a checkpoint restores onto any of them. A frozen leaf held as
int8/int4 codes (`quantized_nontrainable_weights`) is stored as its codes and steps, in groups
cut on the logical tensor, so they too restore onto any mesh bit for bit
(`zeroxla.checkpoint.codes`). Each process writes only the
shards it holds and reads back only the slices its devices need. The directory layout and crash
safety are described in `zeroxla.checkpoint.listing`, the checksums in `.integrity`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from zeroxla.checkpoint import codes
from zeroxla.checkpoint.integrity import (
    checksums,
    digest,
    encode,
    host_int,
    read_meta,
)
from zeroxla.checkpoint.listing import (
    FORMAT_VERSION,
    META_ITEM,
    STATE_ITEM,
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpointError,
    select,
)
from zeroxla.checkpoint.model_record import (
    config_record,
    known_model_config,
    model_config_from_record,
    model_config_of,
)
from zeroxla.checkpoint.target import check_compatible, target_step
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.leaf_plan import LeafPlan
from zeroxla.engine.layout import ZeroLayout
from zeroxla.engine.layout_argument import layout_argument
from zeroxla.engine.logical import LogicalLayout, logical_sharding, named_leaves
from zeroxla.engine.loss_scale import init_loss_scale
from zeroxla.engine.state import TrainState
from zeroxla.engine.step import ZeroStep


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """'a/b/c' keys -> nested dicts, orbax's natural tree (stored as 'a.b.c')."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = name.split("/")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return root


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore` returns.

    `state` is in `step`'s storage layout; `metadata` is the dict the caller passed to `save`
    (data position, RNG state...); `checkpoint_step` names the checkpoint that was read.
    """

    state: TrainState
    step: ZeroStep
    metadata: dict[str, Any]
    checkpoint_step: int
    path: Path
    zero_config: ZeroConfig
    model_config: Any
    loss_scale: float | None


# ------------------------------------------------------------------------------------------------
# Save.

class Checkpointer:
    """Writes the checkpoints of one run into `directory`.

    `keep` keeps only the newest `keep` checkpoints (older ones are deleted after a newer one
    has committed). With `async_save`, `save` returns once the arrays are copied to host memory
    and the files are written in the background; `wait_until_finished()`, the next `save`,
    `close()` and leaving a `with` block wait for them. Every process must call `save`; each
    writes only the shards it holds.
    """

    def __init__(self, directory: str | Path, *, keep: int | None = None,
                 async_save: bool = False):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep < 1):
            raise ValueError(f"Checkpointer: keep={keep!r} is invalid; accepted: None (keep "
                             "all) or an integer >= 1")
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.async_save = async_save
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=ocp.checkpoint_managers.LatestN(keep) if keep else None))

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_until_finished(self) -> None:
        """Blocks until every save of this checkpointer has committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def save(self, state: TrainState, *, layout: ZeroLayout,
             metadata: Mapping[str, Any] | None = None, model_config: Any = None) -> Path:
        """Saves `state` as checkpoint number `state.step`; returns its (final) path.

        `layout` is the `ZeroLayout` of the step that produced `state` (`step.layout`: the plan,
        optimizer and ZeroConfig). `metadata` is the caller's JSON-able dict (data position,
        RNG keys, ...), returned by `restore`. `model_config` defaults to the model's own
        `config` attribute.
        """
        layout = layout_argument(layout, "save(..., layout=step)",    # a ZeroStep warns
                                 "save(..., layout=step.layout)")
        if not isinstance(layout, ZeroLayout):
            raise TypeError(f"save(layout=...) takes the ZeroLayout of the step that produced "
                            f"the state (step.layout); got {type(layout).__name__}")
        if not isinstance(state, TrainState):
            raise TypeError(f"save: state is a {type(state).__name__}; accepted: a TrainState "
                            "(step.init(), or what step(state, batch) returned)")
        if state.plan is not layout.plan and state.plan != layout.plan:
            raise ValueError("save: state is not a TrainState of this layout (its plan differs "
                             "from layout.plan); pass the layout of the step that produced it")
        if model_config is None:
            model_config = model_config_of(layout)
        arrays = layout.logical.to_logical(state)
        # Frozen leaves stored as codes are saved as their codes and steps, not as floats, in
        # the logical group order (`zeroxla.checkpoint.codes`).
        quantized = [leaf for leaf in layout.plan.leaves if leaf.params_quantized]
        for leaf in quantized:
            del arrays[f"params/{leaf.path}"]
            arrays.update(_logical_codes(layout.mesh, leaf, state.params[leaf.path]))
        sums = checksums(arrays)
        number = host_int(state.step)
        loss_scale = (float(np.asarray(state.loss_scale.scale.addressable_data(0)))
                      if state.loss_scale is not None else None)
        meta = {
            "format": FORMAT_VERSION,
            "step": number,
            "zero_config": dataclasses.asdict(layout.config),
            "model_config": config_record(model_config),
            "loss_scale": loss_scale,
            "mesh": {"shape": dict(layout.mesh.shape), "data_size": layout.data_size},
            "metadata": dict(metadata or {}),
            "frozen_codes": {leaf.path: codes.layout_record(leaf) for leaf in quantized},
            "arrays": {name: {"shape": list(a.shape), "dtype": a.dtype.name,
                              "checksum": host_int(sums[name])} for name, a in arrays.items()},
        }
        meta = json.loads(json.dumps(meta, default=encode))
        meta["digest"] = digest(meta)
        # One layer of a stacked [L, ...] parameter per chunk, so export reads a layer alone.
        stacked = {name for leaf in layout.plan.leaves if leaf.stacked
                   for name in (f"params/{leaf.path}",
                                *(codes.array_name(leaf.path, f) for f in codes.FIELDS))}
        save_args = {name: ocp.SaveArgs(shard_axes=(0,) if name in stacked else ())
                     for name in arrays}
        self._manager.wait_until_finished()
        saved = self._manager.save(number, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.PyTreeSave(_nest(arrays), save_args=_nest(save_args)),
            META_ITEM: ocp.args.JsonSave(meta)}))
        if not saved:
            raise CheckpointError(
                f"checkpoint step {number} was not written: {self.directory} already has step "
                f"{self._manager.latest_step()} and orbax only saves steps newer than its "
                "latest; save into another directory or remove the newer steps")
        if not self.async_save:
            self._manager.wait_until_finished()
        return self.directory / str(number)


def _logical_codes(mesh: Mesh, leaf: LeafPlan, stored: Any) -> dict[str, jax.Array]:
    """A frozen leaf's codes in the state -> its checkpoint arrays (`codes.to_logical`), kept
    sharded over the data devices."""
    shapes = codes.LogicalCodes.of(leaf).shapes
    shardings = tuple(logical_sharding(mesh, shapes[f], leaf.stacked, prefer=int(leaf.stacked))
                      for f in codes.FIELDS)
    logical = jax.jit(codes.to_logical, static_argnums=0, out_shardings=shardings)(leaf, stored)
    return {codes.array_name(leaf.path, f): a for f, a in zip(codes.FIELDS, logical)}


def save(directory: str | Path, state: TrainState, *, layout: ZeroLayout,
         metadata: Mapping[str, Any] | None = None, model_config: Any = None,
         keep: int | None = None) -> Path:
    """Saves `state` as checkpoint number `state.step` under `directory` and waits until it has
    committed; returns its path. See `Checkpointer.save` (and `Checkpointer` for periodic or
    asynchronous saves); `keep` keeps only the newest `keep` checkpoints."""
    layout = layout_argument(layout, "save(..., layout=step)",        # a ZeroStep warns
                             "save(..., layout=step.layout)")
    with Checkpointer(directory, keep=keep) as checkpointer:
        return checkpointer.save(state, layout=layout, metadata=metadata,
                                 model_config=model_config)


# ------------------------------------------------------------------------------------------------
# Restore.

def restore(directory: str | Path, target: ZeroStep | Mesh | tuple[Mesh, ZeroConfig | None], *,
            step: int | None = None, optimizer: optax.GradientTransformation | None = None,
            loss_fn: Callable | None = None) -> Restored:
    """Reads checkpoint `step` (default: the newest complete one) into `target`'s layout.

    `target` is a ZeroStep (any mesh, device count, stage or hpZ setting), or a mesh, or
    `(mesh, ZeroConfig)`: then the model is rebuilt from the checkpoint's model config and the
    step is made with `optimizer` (required: the optax transformation the run trained with),
    `loss_fn` and the given config (default: the checkpoint's). Newer incomplete checkpoints are
    skipped with an `IncompleteCheckpointWarning`.

    Raises ValueError when a mesh target comes without `optimizer` (a checkpoint holds the
    optimizer's state, never the optax transformation that reads it, so no default can be
    known to be the run's), naming the first parameter whose path or shape differs between the
    checkpoint and the target, CorruptCheckpointError when an array or the metadata fails its
    checksum, IncompleteCheckpointError when `step` names an uncommitted save.
    """
    directory = Path(directory).absolute()
    info = select(directory, step)
    meta = read_meta(info)
    zero_step = target_step(target, meta, optimizer, loss_fn)
    layout = zero_step.layout
    logical = layout.logical
    stored = meta["arrays"]
    check_compatible(meta, logical, info)
    # Frozen leaves saved as codes: each one's stored form (`zeroxla.checkpoint.codes`).
    frozen = {path: codes.stored_layout(path, record, layout.plan[path])
              for path, record in meta.get("frozen_codes", {}).items()}
    shardings = layout.state_shardings.params

    wanted = _wanted(logical, stored, frozen, layout.mesh)
    arrays = _read_checked(directory, info, wanted, stored)
    target_codes = {}
    for path, leaf in frozen.items():
        data, scales = (arrays.pop(codes.array_name(path, f)) for f in codes.FIELDS)
        name = f"params/{path}"
        # The stored values: a float target's parameter (for a quantized target, overwritten
        # below by the codes themselves).
        arrays[name] = codes.restore_values(leaf, data, scales, logical.abstract[name].sharding,
                                            logical.abstract[name].dtype)
        if layout.plan[path].params_quantized:
            target_codes[path] = codes.restore_codes(leaf, layout.plan[path], data, scales,
                                                     shardings[path])
    fresh = named_leaves({"loss_scale": init_loss_scale(layout.config)})
    for name in [n for n in logical.names if n not in arrays]:
        if name not in fresh:
            raise CheckpointError(f"checkpoint step {info.step}: array {name!r} was not restored")
        arrays[name] = jax.device_put(fresh[name], logical.abstract[name].sharding)
    state = logical.to_storage([arrays[n] for n in logical.names])
    if target_codes:
        state = state.replace(params={**state.params, **target_codes})
    return Restored(state=state, step=zero_step, metadata=meta["metadata"],
                    checkpoint_step=info.step, path=info.path,
                    zero_config=layout.config, model_config=known_model_config(meta),
                    loss_scale=meta["loss_scale"])


def _wanted(layout: LogicalLayout, stored: Mapping[str, Any], frozen: Mapping[str, Any],
            mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays to read, each with the sharding it is read into: the target's logical arrays
    the checkpoint holds, and the codes of each frozen leaf saved as codes."""
    # The loss scale is optional on both sides: fp16 runs carry one, others do not.
    wanted = {n: a for n, a in layout.abstract.items() if n in stored}
    for path, leaf in frozen.items():
        for field in codes.FIELDS:
            name = codes.array_name(path, field)
            shape = tuple(stored[name]["shape"])
            wanted[name] = jax.ShapeDtypeStruct(
                shape, np.dtype(stored[name]["dtype"]),
                sharding=logical_sharding(mesh, shape, leaf.stacked, prefer=int(leaf.stacked)))
    return wanted


def _read_checked(directory: Path, info: CheckpointInfo, wanted: Mapping[str, Any],
                  stored: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Reads the `wanted` arrays of checkpoint `info` (name -> array), each checked against its
    `stored` checksum."""
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True))
    try:
        tree = manager.restore(info.step, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.PyTreeRestore(
                item=_nest(wanted),
                restore_args=ocp.checkpoint_utils.construct_restore_args(_nest(wanted)),
                partial_restore=True)}))[STATE_ITEM]
    except Exception as err:    # tensorstore/orbax: truncated, missing or undecodable files
        raise CorruptCheckpointError(f"checkpoint step {info.step} at {info.path} cannot be "
                                     f"read: {err}") from err
    finally:
        manager.close()
    arrays = named_leaves(tree)
    missing = [n for n in wanted if n not in arrays]
    if missing:
        raise CheckpointError(f"checkpoint step {info.step}: array {missing[0]!r} was not "
                              "restored")
    sums = checksums({n: arrays[n] for n in wanted})
    for name in wanted:
        if host_int(sums[name]) != stored[name]["checksum"]:
            raise CorruptCheckpointError(
                f"checkpoint step {info.step} at {info.path} is corrupted: array {name!r} "
                f"fails its checksum (stored {stored[name]['checksum']:#010x}, read "
                f"{host_int(sums[name]):#010x})")
    return arrays


__all__ = ["Checkpointer", "Restored", "model_config_from_record", "restore", "save"]
