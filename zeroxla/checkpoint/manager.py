"""Checkpoints: the training state in a layout-independent (logical) form, on orbax.

    zeroxla.save(directory, state, step=zero_step, metadata={"data_position": 1234, "rng": key})
    restored = zeroxla.restore(directory, zero_step)            # newest complete checkpoint
    restored = zeroxla.restore(directory, (mesh, ZeroConfig(stage=1)))   # model rebuilt from it
    state, metadata = restored.state, restored.metadata

What is stored is independent of the mesh and the ZeRO stage, so a checkpoint restores onto
any device count, stage or hpZ setting with no offline conversion (DeepSpeed needs
`zero_to_fp32`/universal checkpoints for that): every parameter in its logical shape (the flat
padded partitions of `plan.py` are cut back with `LeafPlan.from_partitioned`), every
parameter-shaped optimizer leaf likewise (found with `optax.tree_map_params`), scalars as they
are. Both conversions run under `jax.jit` with explicit output shardings, so the logical arrays
stay sharded over the data devices (`logical_sharding`) and orbax writes, per process, only the
shards that process holds, and reads back only the slices each new device needs.

One orbax `CheckpointManager` directory:

    DIR/<n>/state/      orbax PyTree of logical arrays, named `params/<path>`,
                        `opt_state/<optax path>`, `step`, `loss_scale/<field>`
    DIR/<n>/zeroxla/    JSON: the ZeroConfig, the model config (family + fields), the caller's
                        metadata (data position, RNG keys...), the loss scale, and every array's
                        shape, dtype and checksum, closed by a digest of the JSON itself
    DIR/<n>.orbax-checkpoint-tmp/   a save still running, or one killed before it committed

Crash safety. Orbax writes a step into `<n>.orbax-checkpoint-tmp`, and commits it by writing
`commit_success.txt` into it and renaming it to `<n>` (an atomic rename on POSIX file systems;
object stores keep the name and rely on the commit file). A killed save therefore leaves only the
temporary directory: `list_checkpoints` reports it as incomplete and `restore` skips it with a
warning naming it. Orbax does not verify what it reads back: a flipped byte in a data file is
decompressed into wrong values without an error. So every array's checksum (a position-weighted
sum of its bits mod 2**32, independent of the sharding) is stored in the JSON and verified after
every restore and export; the JSON carries a SHA-256 digest of itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import math
import re
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroxla import models

from zeroxla.engine.config import ZeroConfig
from zeroxla.engine.loss_scale import init_loss_scale
from zeroxla.engine.mesh import DATA_AXES, LOCAL_AXIS, NODE_AXIS, data_size
from zeroxla.engine.state import TrainState
from zeroxla.engine.step import ZeroStep, make_step

FORMAT_VERSION = 1
STATE_ITEM = "state"          # orbax item holding the arrays
META_ITEM = "zeroxla"         # orbax item holding our JSON
TMP_SUFFIX = ".orbax-checkpoint-tmp"          # orbax's temporary step directories
COMMIT_FILE = "commit_success.txt"            # orbax writes it just before the commit rename
_TMP_RE = re.compile(r"^(\d+)" + re.escape(TMP_SUFFIX))
_CHECKSUM_MULTIPLIER = 0x9E3779B1   # odd: any change to one element changes the checksum
_CHECKSUM_BLOCK = 8192


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint's save never committed (killed or still running)."""


class CorruptCheckpointError(CheckpointError):
    """A stored array or the metadata does not match what was written."""


class IncompleteCheckpointWarning(UserWarning):
    """`restore` skipped an incomplete checkpoint."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One step directory: `complete` checkpoints can be restored; `problem` says why not."""

    step: int
    path: Path
    complete: bool
    problem: str | None = None


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
# Listing.

def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """Every step directory under `directory`, complete or not, by step then path."""
    directory = Path(directory)
    _wait_pending(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        if not entry.is_dir():
            continue
        if entry.name.isdigit():
            if (entry / COMMIT_FILE).exists():
                problem = (None if (entry / META_ITEM).is_dir() else
                           f"no {META_ITEM}/ item: not written by zeroxla.save")
            else:
                problem = f"no {COMMIT_FILE}: the save never committed"
            found.append(CheckpointInfo(int(entry.name), entry, problem is None, problem))
        elif match := _TMP_RE.match(entry.name):
            found.append(CheckpointInfo(
                int(match.group(1)), entry, False,
                "a save was interrupted (or is still running) before orbax committed it"))
    return sorted(found, key=lambda c: (c.step, c.path.name))


def latest_step(directory: str | Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = [c.step for c in list_checkpoints(directory) if c.complete]
    return max(steps) if steps else None


def _select(directory: Path, step: int | None) -> CheckpointInfo:
    """The checkpoint to read: `step`, or the newest complete one (warning about skipped ones)."""
    infos = list_checkpoints(directory)
    if step is not None:
        matching = [c for c in infos if c.step == step]
        complete = [c for c in matching if c.complete]
        if complete:
            return complete[0]
        if matching:
            raise IncompleteCheckpointError(
                f"checkpoint step {step} at {matching[0].path} is incomplete: "
                f"{matching[0].problem}; complete steps: {[c.step for c in infos if c.complete]}")
        raise FileNotFoundError(f"no checkpoint step {step} in {directory}; complete steps: "
                                f"{[c.step for c in infos if c.complete]}")
    complete = [c for c in infos if c.complete]
    if not complete:
        broken = [str(c.path) for c in infos]
        raise FileNotFoundError(f"no complete checkpoint in {directory}"
                                + (f" (incomplete: {broken})" if broken else ""))
    chosen = complete[-1]
    for c in infos:
        if not c.complete:
            warnings.warn(f"skipping incomplete checkpoint {c.path} (step {c.step}): {c.problem}; "
                          f"restoring step {chosen.step}", IncompleteCheckpointWarning,
                          stacklevel=3)
    return chosen


# ------------------------------------------------------------------------------------------------
# The logical form and its conversions.

def logical_sharding(mesh: Mesh, shape: Sequence[int], stacked: bool = False) -> NamedSharding:
    """How a logical array is sharded while it is saved or restored.

    Over all data devices (else the `local` axis, else the `node` axis) on the first of its dims
    that the device count divides, trying first the parameter's leading dim after the layer dim:
    the flat partitions of `plan.py` are contiguous blocks of exactly that dim, so converting
    to and from the storage layout needs no communication when it divides evenly. Then the
    other dims, largest first, and the layer dim last (export reads one layer at a time).
    Replicated when nothing divides (small or oddly shaped leaves).
    """
    first = 1 if stacked and len(shape) > 1 else 0
    rest = sorted((d for d in range(len(shape)) if d != first and not (stacked and d == 0)),
                  key=lambda d: -shape[d])
    order = [first] + rest + ([0] if first == 1 else [])
    for axes in (DATA_AXES, (LOCAL_AXIS,), (NODE_AXIS,)):
        n = math.prod(mesh.shape[a] for a in axes)
        if n == 1:
            break
        for dim in order:
            if dim < len(shape) and shape[dim] % n == 0:
                spec = [None] * len(shape)
                spec[dim] = axes if len(axes) > 1 else axes[0]
                return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unsupported pytree key {key!r}")


def _named_leaves(tree: Any) -> dict[str, Any]:
    """{'opt_state/0/mu/blocks/layers/wq': leaf, ...} in flatten order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


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


def _u32_bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """sum_i bits(x_i) * (i * K + 1) mod 2**32 over the row-major flat index i."""
    weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(
        _CHECKSUM_MULTIPLIER) + jnp.uint32(1)
    return jnp.sum(_u32_bits(x) * weights, dtype=jnp.uint32)


def checksum_numpy(x: np.ndarray, offset: int = 0) -> int:
    """`_checksum`'s contribution of `x`, a block of a larger array starting at flat `offset`.

    Works through `x` in small blocks, so its scratch memory stays ~100 KiB at any size.
    """
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype != np.bool_:
        flat = flat.view(f"uint{8 * flat.dtype.itemsize}")
    total = 0
    for start in range(0, flat.size, _CHECKSUM_BLOCK):
        bits = flat[start:start + _CHECKSUM_BLOCK].astype(np.uint32)
        index = np.arange(bits.size, dtype=np.uint32) + np.uint32((offset + start) & 0xFFFFFFFF)
        index *= np.uint32(_CHECKSUM_MULTIPLIER)
        index += np.uint32(1)
        bits *= index
        total = (total + int(np.sum(bits, dtype=np.uint32))) & 0xFFFFFFFF
    return total


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A ZeroStep's logical form: names, abstract arrays, and the two jitted conversions."""

    names: tuple[str, ...]                        # flatten order of the logical tree
    abstract: dict[str, jax.ShapeDtypeStruct]     # with `logical_sharding`
    treedef: Any
    to_logical: Callable                          # state -> ({name: array}, {name: checksum})
    to_storage: Callable                          # [arrays in `names` order] -> (state, checksums)


_NOT_A_PARAM = object()
_LAYOUTS: "weakref.WeakKeyDictionary[ZeroStep, _Layout]" = weakref.WeakKeyDictionary()


def _layout(step: ZeroStep) -> _Layout:
    if step not in _LAYOUTS:
        _LAYOUTS[step] = _build_layout(step)
    return _LAYOUTS[step]


def _build_layout(step: ZeroStep) -> _Layout:
    plan, optimizer, mesh = step.plan, step.optimizer, step.mesh
    leaves = {leaf.path: leaf for leaf in plan.leaves}
    trainable = {leaf.path: leaf for leaf in plan.trainable_leaves}   # what opt_state covers

    def logical_tree(state: TrainState) -> dict[str, Any]:
        # Frozen leaves stored as int8/int4 codes are saved dequantized (layout-independent).
        params = {p: leaf.storage_to_logical(state.params[p]) for p, leaf in leaves.items()}
        opt_state = optax.tree_map_params(
            optimizer, lambda x, leaf: leaf.from_partitioned(x) if leaf.optimizer_partitioned
            else x, state.opt_state, trainable)
        tree = {"step": state.step, "params": params, "opt_state": opt_state}
        if state.loss_scale is not None:
            tree["loss_scale"] = state.loss_scale
        return tree

    def storage_state(tree: dict[str, Any]) -> TrainState:
        params = {p: leaf.logical_to_storage(tree["params"][p]) for p, leaf in leaves.items()}
        opt_state = optax.tree_map_params(
            optimizer, lambda x, leaf: leaf.to_partitioned(x) if leaf.optimizer_partitioned
            else x, tree["opt_state"], trainable)
        return TrainState(step=tree["step"], params=params, opt_state=opt_state,
                          loss_scale=tree.get("loss_scale"), plan=plan,
                          model_def=step.model_def)

    abstract_state = _abstract_storage_state(step)
    abstract_tree = jax.eval_shape(logical_tree, abstract_state)
    named = _named_leaves(abstract_tree)
    # The LeafPlan behind every parameter-shaped leaf (params and optimizer moments).
    plans = _named_leaves({"params": leaves, "opt_state": optax.tree_map_params(
        optimizer, lambda _, leaf: leaf, abstract_state.opt_state, trainable,
        transform_non_params=lambda _: _NOT_A_PARAM)})
    abstract = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=logical_sharding(
        mesh, a.shape, stacked=getattr(plans.get(name), "stacked", False)))
                for name, a in named.items()}
    treedef = jax.tree.structure(abstract_tree)
    names = tuple(named)
    shardings = {name: a.sharding for name, a in abstract.items()}
    replicated = {name: NamedSharding(mesh, P()) for name in names}

    def to_logical(state):
        flat = _named_leaves(logical_tree(state))
        return flat, {name: _checksum(x) for name, x in flat.items()}

    def to_storage(arrays):
        flat = dict(zip(names, arrays))
        return (storage_state(jax.tree.unflatten(treedef, arrays)),
                {name: _checksum(x) for name, x in flat.items()})

    return _Layout(
        names=names, abstract=abstract, treedef=treedef,
        to_logical=jax.jit(to_logical, out_shardings=(shardings, replicated)),
        to_storage=jax.jit(to_storage, out_shardings=(step.state_shardings, replicated)))


def _abstract_storage_state(step: ZeroStep) -> TrainState:
    f32 = jnp.float32
    view = {leaf.path: jax.ShapeDtypeStruct(leaf.optimizer_shape, f32)
            for leaf in step.plan.trainable_leaves}
    loss_scale = (jax.eval_shape(lambda: init_loss_scale(step.config))
                  if step.config.uses_loss_scaling else None)
    return TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params={leaf.path: leaf.param_struct() for leaf in step.plan.leaves},
        opt_state=jax.eval_shape(step.optimizer.init, view), loss_scale=loss_scale,
        plan=step.plan, model_def=step.model_def)


def _host_int(x: jax.Array) -> int:
    """A replicated scalar's value, also when the array spans several processes."""
    return int(np.asarray(x.addressable_data(0)))


# ------------------------------------------------------------------------------------------------
# Metadata: JSON with arrays, numpy scalars and PRNG keys encoded.

def _encode(obj: Any) -> Any:
    if isinstance(obj, jax.Array) and jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
        return {"__prng_key__": str(jax.random.key_impl(obj)),
                "data": np.asarray(jax.random.key_data(obj)).tolist()}
    if isinstance(obj, (np.ndarray, jax.Array)):
        array = np.asarray(obj)
        return {"__ndarray__": array.tolist(), "dtype": array.dtype.name}
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"checkpoint metadata must be JSON-serialisable (dicts, lists, numbers, "
                    f"strings, numpy/jax arrays, PRNG keys); got {type(obj).__name__}")


def _decode(obj: dict[str, Any]) -> Any:
    if "__prng_key__" in obj:
        return jax.random.wrap_key_data(np.asarray(obj["data"], np.uint32),
                                        impl=obj["__prng_key__"])
    if "__ndarray__" in obj:
        return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
    return obj


def _digest(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _config_record(config: Any) -> dict[str, Any] | None:
    """A frozen model config dataclass -> {'family', 'class', 'fields'} (init fields only)."""
    if config is None:
        return None
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"model_config must be a dataclass (e.g. GPTConfig), got "
                        f"{type(config).__name__}")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return {"family": getattr(config, "family", None), "class": type(config).__qualname__,
            "fields": fields}


def model_config_from_record(record: Mapping[str, Any] | None) -> Any:
    """Inverse of the stored model-config record (None stays None)."""
    if record is None:
        return None
    if record.get("family") not in models.FAMILIES:
        raise ValueError(f"checkpoint model family {record.get('family')!r} is not one of "
                         f"{sorted(models.FAMILIES)}; restore into a ZeroStep you build yourself")
    return models.FAMILIES[record["family"]][1](**record["fields"])


def _known_model_config(meta: Mapping[str, Any]) -> Any:
    """The checkpoint's model config, or None if it has none of a family `models` knows."""
    record = meta["model_config"]
    return (model_config_from_record(record)
            if record and record.get("family") in models.FAMILIES else None)


def _model_config_of(step: ZeroStep) -> Any:
    """The `config` dataclass of the step's model, if the model keeps one (models/ do)."""
    md = step.model_def
    abstract = md.module({p: jax.ShapeDtypeStruct(s, d)
                          for p, s, d in zip(md.paths, md.shapes, md.dtypes)})
    config = getattr(abstract, "config", None)
    return config if dataclasses.is_dataclass(config) else None


def read_metadata(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """The stored JSON of checkpoint `step` (default: newest complete), digest verified.

    Keys: format, step, zero_config, model_config, loss_scale, mesh, metadata (the caller's,
    decoded), arrays ({name: {shape, dtype, checksum}}), digest.
    """
    directory = Path(directory).absolute()
    return _read_meta(_select(directory, step))


def _read_meta(info: CheckpointInfo) -> dict[str, Any]:
    path = info.path / META_ITEM / "metadata"
    try:
        text = path.read_text()
        meta = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"checkpoint step {info.step}: cannot read {path}: "
                                     f"{err}") from err
    if not isinstance(meta, dict) or meta.get("digest") != _digest(meta):
        raise CorruptCheckpointError(f"checkpoint step {info.step}: {path} fails its digest "
                                     "check (the file was modified or corrupted)")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint step {info.step} has format {meta.get('format')!r}; "
                              f"this zeroxla reads format {FORMAT_VERSION}")
    meta["metadata"] = json.loads(json.dumps(meta["metadata"]), object_hook=_decode)
    return meta


# ------------------------------------------------------------------------------------------------
# Save.

_PENDING: dict[Path, ocp.CheckpointManager] = {}   # async saves still being written


def _wait_pending(directory: Path) -> None:
    manager = _PENDING.pop(Path(directory).absolute(), None)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()


def wait_until_finished(directory: str | Path | None = None) -> None:
    """Blocks until the async saves into `directory` (default: all directories) have committed."""
    for path in [Path(directory).absolute()] if directory is not None else list(_PENDING):
        _wait_pending(path)


atexit.register(wait_until_finished)


def save(directory: str | Path, state: TrainState, *, step: ZeroStep,
         metadata: Mapping[str, Any] | None = None, model_config: Any = None,
         keep: int | None = None, async_save: bool = False) -> Path:
    """Saves `state` as checkpoint number `state.step` under `directory`; returns its path.

    `step` is the ZeroStep that produced `state` (it knows the plan, optimizer and ZeroConfig).
    `metadata` is the caller's JSON-able dict (data position, RNG keys, ...), returned by
    `restore`. `model_config` defaults to the model's own `config` attribute. `keep` keeps only
    the newest `keep` checkpoints. `async_save` returns once the arrays are copied to host;
    the files are written in the background (`wait_until_finished`; the next save or restore of
    `directory` and interpreter exit wait too). Every process must call `save`; each writes
    only the shards it holds.
    """
    if not isinstance(step, ZeroStep):
        raise TypeError(f"save(step=...) takes the ZeroStep that produced the state (the "
                        f"checkpoint is numbered by state.step); got {type(step).__name__}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"save: keep={keep!r} is invalid; accepted: None (keep all) or an "
                         "integer >= 1")
    if model_config is None:
        model_config = _model_config_of(step)
    directory = Path(directory).absolute()
    layout = _layout(step)
    arrays, checksums = layout.to_logical(state)
    number = _host_int(state.step)
    loss_scale = (float(np.asarray(state.loss_scale.scale.addressable_data(0)))
                  if state.loss_scale is not None else None)
    meta = {
        "format": FORMAT_VERSION,
        "step": number,
        "zero_config": dataclasses.asdict(step.config),
        "model_config": _config_record(model_config),
        "loss_scale": loss_scale,
        "mesh": {"shape": dict(step.mesh.shape), "data_size": data_size(step.mesh)},
        "metadata": dict(metadata or {}),
        "arrays": {name: {"shape": list(a.shape), "dtype": a.dtype.name,
                          "checksum": _host_int(checksums[name])} for name, a in arrays.items()},
    }
    meta = json.loads(json.dumps(meta, default=_encode))
    meta["digest"] = _digest(meta)

    _wait_pending(directory)
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=async_save,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep) if keep else None)
    manager = ocp.CheckpointManager(directory, options=options)
    # One layer of a stacked [L, ...] parameter per chunk, so export reads a layer alone.
    stacked = {f"params/{leaf.path}" for leaf in step.plan.leaves if leaf.stacked}
    save_args = {name: ocp.SaveArgs(shard_axes=(0,) if name in stacked else ())
                 for name in arrays}
    saved = manager.save(number, args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeSave(_nest(arrays), save_args=_nest(save_args)),
        META_ITEM: ocp.args.JsonSave(meta)}))
    if not saved:
        manager.close()
        raise CheckpointError(
            f"checkpoint step {number} was not written: {directory} already has step "
            f"{manager.latest_step()} and orbax only saves steps newer than its latest; save "
            "into another directory or remove the newer steps")
    if async_save:
        _PENDING[directory] = manager
    else:
        manager.wait_until_finished()
        manager.close()
    return directory / str(number)


# ------------------------------------------------------------------------------------------------
# Restore.

def restore(directory: str | Path, target: ZeroStep | Mesh | tuple[Mesh, ZeroConfig | None], *,
            step: int | None = None, optimizer: optax.GradientTransformation | None = None,
            loss_fn: Callable | None = None) -> Restored:
    """Reads checkpoint `step` (default: the newest complete one) into `target`'s layout.

    `target` is a ZeroStep (any mesh, device count, stage or hpZ setting), or a mesh, or
    `(mesh, ZeroConfig)`: then the model is rebuilt from the checkpoint's model config and the
    step is made with `optimizer` (default: make_step's AdamW; pass the one you trained with),
    `loss_fn` and the given config (default: the checkpoint's). Newer incomplete checkpoints are
    skipped with an `IncompleteCheckpointWarning`.

    Raises ValueError naming the first parameter whose path or shape differs between the
    checkpoint and the target, CorruptCheckpointError when an array or the metadata fails its
    checksum, IncompleteCheckpointError when `step` names an uncommitted save.
    """
    directory = Path(directory).absolute()
    _wait_pending(directory)
    info = _select(directory, step)
    meta = _read_meta(info)
    zero_step = _target_step(target, meta, optimizer, loss_fn)
    layout = _layout(zero_step)
    stored = meta["arrays"]
    _check_compatible(meta, layout, info)

    # The loss scale is optional on both sides: fp16 runs carry one, others do not.
    wanted = {n: a for n, a in layout.abstract.items() if n in stored}
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
    arrays = _named_leaves(tree)
    fresh = _named_leaves({"loss_scale": init_loss_scale(zero_step.config)})
    missing = [n for n in layout.names if n not in arrays]
    for name in missing:
        if name not in fresh:
            raise CheckpointError(f"checkpoint step {info.step}: array {name!r} was not restored")
        arrays[name] = jax.device_put(fresh[name], layout.abstract[name].sharding)
    state, checksums = layout.to_storage([arrays[n] for n in layout.names])
    for name in layout.names:
        if name in stored and _host_int(checksums[name]) != stored[name]["checksum"]:
            raise CorruptCheckpointError(
                f"checkpoint step {info.step} at {info.path} is corrupted: array {name!r} "
                f"fails its checksum (stored {stored[name]['checksum']:#010x}, read "
                f"{_host_int(checksums[name]):#010x})")
    return Restored(state=state, step=zero_step, metadata=meta["metadata"],
                    checkpoint_step=info.step, path=info.path,
                    zero_config=zero_step.config, model_config=_known_model_config(meta),
                    loss_scale=meta["loss_scale"])


def _target_step(target: Any, meta: Mapping[str, Any], optimizer: Any,
                 loss_fn: Any) -> ZeroStep:
    if isinstance(target, ZeroStep):
        if optimizer is not None or loss_fn is not None:
            raise ValueError("restore: optimizer/loss_fn are only used with a (mesh, config) "
                             "target; a ZeroStep already has them")
        return target
    if isinstance(target, Mesh):
        mesh, config = target, None
    elif isinstance(target, tuple) and len(target) == 2 and isinstance(target[0], Mesh):
        mesh, config = target
    else:
        raise TypeError(f"restore: target must be a ZeroStep, a Mesh or (mesh, ZeroConfig); "
                        f"got {type(target).__name__}")
    if config is None:
        known = {f.name for f in dataclasses.fields(ZeroConfig)}
        config = ZeroConfig(**{k: v for k, v in meta["zero_config"].items() if k in known})
    record = meta["model_config"]
    if record is None:
        raise ValueError("restore: the checkpoint records no model config; restore into a "
                         "ZeroStep built with the model")
    model_config = model_config_from_record(record)
    model_cls = models.model_class(model_config)

    def factory():
        from flax import nnx

        return model_cls(model_config, rngs=nnx.Rngs(0))

    return make_step(factory, mesh, optimizer=optimizer, config=config, loss_fn=loss_fn)


def _check_compatible(meta: Mapping[str, Any], layout: _Layout, info: CheckpointInfo) -> None:
    """Raises ValueError at the first parameter (then optimizer leaf) that differs."""
    stored = meta["arrays"]
    record = meta.get("model_config")
    where = f"checkpoint step {info.step} at {info.path}"
    if record:
        fields = ", ".join(f"{k}={v}" for k, v in record["fields"].items())
        where += f" ({record['class']}({fields}))"

    def shape(name, table):
        if name not in table:
            return "absent"
        entry = table[name]
        return tuple(entry["shape"] if isinstance(entry, dict) else entry.shape)

    target = layout.abstract
    for prefix, what in (("params/", "parameter"), ("opt_state/", "optimizer state leaf"),
                         ("step", "step counter")):
        names = [n for n in target if n.startswith(prefix)]
        names += [n for n in stored if n.startswith(prefix) and n not in target]
        for name in names:
            ours, theirs = shape(name, target), shape(name, stored)
            if ours != theirs:
                label = name[len(prefix):] if prefix.endswith("/") else name
                hint = ("; restore with the optimizer the checkpoint was trained with"
                        if prefix == "opt_state/" else "")
                raise ValueError(f"{where} does not match the target: first mismatched {what} "
                                 f"{label!r}: checkpoint shape {theirs}, target shape {ours}"
                                 f"{hint}")


# ------------------------------------------------------------------------------------------------
# Reading single arrays (for export): one tensor, or one layer of it, at a time.

class StoredArrays:
    """Reads arrays of one checkpoint as numpy, whole or one index of dim 0 at a time, straight
    from tensorstore (no devices). Checksums are verified once every index of an array has
    been read (or the whole array at once)."""

    def __init__(self, directory: str | Path, step: int | None = None):
        directory = Path(directory).absolute()
        _wait_pending(directory)
        self.info = _select(directory, step)
        self.meta = _read_meta(self.info)
        item = self.info.path / STATE_ITEM
        stored = json.loads((item / "_METADATA").read_text())
        self._use_ocdbt = stored.get("use_ocdbt", True)
        self._use_zarr3 = stored.get("use_zarr3", False)
        self._item = epath.Path(item)
        import tensorstore as ts

        self._ts = ts
        # B-tree nodes of the OCDBT index are cached (bounded); array data is not.
        self._context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 16 * 2**20}})
        self._stores: dict[str, Any] = {}                     # name -> opened TensorStore
        self._partial: dict[str, tuple[int, set[int]]] = {}   # name -> (checksum so far, indices)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta["arrays"][name]["shape"])

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Array `name` (e.g. 'params/embed/wte'), or its slice `[index]`."""
        try:
            store = self._open(name)
            # Copied into numpy-owned memory: tensorstore's buffer is freed at once, and the
            # array is visible to tracemalloc (tests/zeroxla/test_export.py bounds the peak).
            value = np.array((store if index is None else store[index]).read().result())
        except ValueError as err:
            raise CorruptCheckpointError(f"checkpoint step {self.info.step} at {self.info.path}:"
                                         f" cannot read {name!r}: {err}") from err
        self._account(name, value, index)
        return value

    def _open(self, name: str) -> Any:
        if name not in self.meta["arrays"]:
            raise KeyError(f"no array {name!r} in checkpoint step {self.info.step}")
        if name not in self._stores:
            spec = ocp.type_handlers.get_json_tspec_read(
                ocp.type_handlers.ParamInfo(name=name.replace("/", "."), parent_dir=self._item,
                                            use_zarr3=self._use_zarr3,
                                            ts_context=self._context),
                use_ocdbt=self._use_ocdbt)
            store = self._ts.open(spec, context=self._context, read=True).result()
            if tuple(store.shape) != self.shape(name):
                raise CorruptCheckpointError(
                    f"checkpoint step {self.info.step}: array {name!r} is stored with shape "
                    f"{tuple(store.shape)}, its metadata says {self.shape(name)}")
            self._stores[name] = store
        return self._stores[name]

    def _account(self, name: str, value: np.ndarray, index: int | None) -> None:
        shape = self.shape(name)
        if index is None:
            total, seen = checksum_numpy(value), set(range(shape[0] if shape else 1))
        else:
            block = math.prod(shape[1:])
            total, seen = self._partial.get(name, (0, set()))
            total = (total + checksum_numpy(value, offset=index * block)) & 0xFFFFFFFF
            seen = seen | {index}
        self._partial[name] = (total, seen)
        if len(seen) == (shape[0] if shape else 1):
            expected = self.meta["arrays"][name]["checksum"]
            if total != expected:
                raise CorruptCheckpointError(
                    f"checkpoint step {self.info.step} at {self.info.path} is corrupted: array "
                    f"{name!r} fails its checksum (stored {expected:#010x}, read {total:#010x})")


__all__ = ["CheckpointError", "CheckpointInfo", "CorruptCheckpointError",
           "IncompleteCheckpointError", "IncompleteCheckpointWarning", "Restored", "StoredArrays",
           "checksum_numpy", "latest_step", "list_checkpoints", "logical_sharding",
           "model_config_from_record", "read_metadata", "restore", "save", "wait_until_finished"]
