"""A pretrained Hugging Face checkpoint loaded straight into ZeRO partitions.

    step, state = zeroxla.load_pretrained("gpt2_dir", mesh, optimizer=optax.adamw(1e-5),
                                          config=zeroxla.ZeroConfig(stage=3))

DeepSpeed's `zero.Init` + `from_pretrained` materialises each parameter once and partitions it at
once, so a model that fits no single device can be fine-tuned. The same here, in three moves:

1. the model class and config come from the directory's `config.json` (`models.hf`: GPT-2 and
   Llama families; anything else is refused by name), and `make_step` builds the step from the
   model's shapes alone (a factory, never called outside a trace);
2. the HF tensors are read one at a time (safetensors, single file or sharded with an index) and
   converted with the name map of `models.hf`; each converted piece (a whole parameter, or one
   layer's slice of a stacked `[L, ...]` parameter) goes straight onto the mesh, spread over all
   its devices along its largest evenly dividing dim (an MoE expert piece under an expert axis:
   its experts over that axis and a dim over the rest, as it is stored), and its host copy is
   dropped; a stacked parameter's layers are then stacked on the devices. On a pipeline's
   mesh the pieces are spread over the devices of one stage (each stage holding a copy) and
   the stacked layers split over the stages, so each device keeps its stage's layers
   (`layer_axis`);
3. `ZeroStep.init_from` lays the spread parameters out in their ZeRO storage (partitions, padding,
   codes, compute copies) and creates the optimizer state, as `init` does for a fresh model.

Host memory: one HF tensor and the pieces converted from it (a transpose may copy) at a time.
Device memory: the spread parameters (1/N of the model per device, N devices, plus parameters too
small to divide; on a pipeline's mesh of S stages the embedding, head and norms take S/N, as
they are stored, and a stacked parameter's layer slices S/N until they are stacked, or for
good where S does not divide the layers) and then the state being built from them.

In a multi-process run each process reads only the part its own devices hold where our piece is
the stored tensor as it is (embeddings, norms, GPT-2's Conv1D weights: `owned_index`, read
with safetensors' slices); a piece that needs a transpose or a split (Llama's projections,
GPT-2's fused q|k|v) is read whole, one at a time, and only its devices' slices are copied.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import EXPERT_AXIS, STAGE_AXIS
from zeroxla.engine.state import TrainState
from zeroxla.engine.step import ZeroStep
from zeroxla.make import make_step
from zeroxla.models import hf as hf_io
from zeroxla.models import model_class
from zeroxla.models.axes import EXPERTS


def spread_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a loaded piece is spread over: all of them, less a pipeline's `stage`
    axis (a stacked leaf's layers go over it when they are stacked, `layer_axis`; the
    embedding, head and norms are stored replicated over the stages)."""
    return tuple(a for a in mesh.axis_names if a != STAGE_AXIS)


def layer_axis(mesh: Mesh, stage_layers: tuple[int, ...] | None) -> str | None:
    """The mesh axis a stacked leaf's layer dim is split over when loaded: a pipeline's
    `stage` axis where its stages hold equally many layers (`stage_layers`, the pipeline
    split's `num_layers`: stage s then holds layers [s L / S, (s + 1) L / S), where the
    pipeline stores them), else None (every stage holds every layer's spread slice until
    `init_from` keeps its own: moving layers between stages there would gather them)."""
    stages = dict(mesh.shape).get(STAGE_AXIS, 1)
    uniform = (stage_layers is not None and len(stage_layers) == stages
               and len(set(stage_layers)) == 1)
    return STAGE_AXIS if stages > 1 and uniform else None


def spread_spec(shape: tuple[int, ...], mesh: Mesh, expert_dim: int | None = None) -> P:
    """The layout a loaded piece of `shape` takes on `mesh`: its largest dim that the devices
    of `spread_axes` divide evenly, split over them; replicated when none does (biases and
    norms smaller than the mesh). An expert piece (`expert_dim`: its dim of experts) on a mesh
    with an expert axis that divides it is spread as it is stored: its experts over the
    expert axis, its largest other dim that the rest divide over the rest, so that `init_from`
    moves no expert leaf across expert groups (spread over all the devices, XLA would
    replicate it whole to regroup it: "Involuntary full rematerialization")."""
    axes = spread_axes(mesh)
    sizes = dict(mesh.shape)
    ep = sizes.get(EXPERT_AXIS, 1)
    experts = (expert_dim is not None and ep > 1 and EXPERT_AXIS in axes
               and shape[expert_dim] % ep == 0)
    if experts:
        axes = tuple(a for a in axes if a != EXPERT_AXIS)
    n = int(np.prod([sizes[a] for a in axes]))
    dims = sorted((d for d, size in enumerate(shape)
                   if size % n == 0 and size >= n and not (experts and d == expert_dim)),
                  key=lambda d: -shape[d])
    spec: list[Any] = [None] * len(shape)
    if experts:
        spec[expert_dim] = EXPERT_AXIS
    if dims and axes:
        spec[dims[0]] = axes
    return P(*spec) if any(a is not None for a in spec) else P()


def owned_index(shape: tuple[int, ...], mesh: Mesh,
                devices: Any = None) -> tuple[slice, ...] | None:
    """The part of a piece of `shape` that `devices` (default: this process's) hold in
    `spread_spec` layout, as one slice along the spread dim; None when they hold all of it
    (one process, or a replicated piece)."""
    spec = spread_spec(shape, mesh)
    if spec == P():
        return None
    mine = set(jax.local_devices() if devices is None else devices)
    dim = next(d for d, axes in enumerate(spec) if axes is not None)
    index_map = NamedSharding(mesh, spec).devices_indices_map(shape)
    parts = [index[dim] for device, index in index_map.items() if device in mine]
    start, stop = min(p.start for p in parts), max(p.stop for p in parts)
    if (start, stop) == (0, shape[dim]):
        return None
    return tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))


def device_part(piece: np.ndarray, device_index: tuple[slice, ...], shape: tuple[int, ...],
                index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The block `device_index` of the array of `shape` (a device's slice, as a sharding's
    `devices_indices_map` gives it), cut from `piece`, which holds only the part `index` of
    that array (None: all of it): the device's slice moved back by where the part starts."""
    starts = [0 if index is None else (index[d].start or 0) for d in range(len(shape))]
    block = tuple(slice((s.start or 0) - o, (n if s.stop is None else s.stop) - o)
                  for s, o, n in zip(device_index, starts, shape))
    if any(b.start < 0 or b.stop > size for b, size in zip(block, piece.shape)):
        raise ValueError(f"a device's slice {device_index} of {shape} lies outside the part "
                         f"{index} read for it ({list(piece.shape)})")
    return piece[block]


def place(piece: np.ndarray, mesh: Mesh, dtype: Any, *, shape: tuple[int, ...] | None = None,
          index: tuple[slice, ...] | None = None, expert_dim: int | None = None) -> jax.Array:
    """The array of `shape` (default: `piece`'s) on `mesh` in `spread_spec` layout (an expert
    piece's with its `expert_dim`), each device receiving only its slice (with several
    processes, each fills only its own devices). `piece` is the whole array, or only its part
    `index` (`owned_index`: the part this process's devices hold; never an expert piece, which
    is read whole, stacked from its experts' tensors)."""
    piece = np.asarray(piece, dtype)
    shape = piece.shape if shape is None else tuple(shape)
    sharding = NamedSharding(mesh, spread_spec(shape, mesh, expert_dim))
    blocks = _device_blocks(piece, sharding.addressable_devices_indices_map(shape).values(),
                            shape, index)
    return jax.make_array_from_callback(
        shape, sharding, lambda device_index: blocks[_bounds(device_index, shape)])


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """`index` as (start, stop) per dim of `shape` (hashable, None resolved)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _show(bounds: tuple[tuple[int, int], ...]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in bounds) + "]"


def _device_blocks(piece: np.ndarray, device_indices: Any, shape: tuple[int, ...],
                   index: tuple[slice, ...] | None) -> dict[tuple, np.ndarray]:
    """{device slice's bounds: its block of `piece`} (`device_part`, views: no copy) for each
    of `device_indices`; ValueError naming the span of the devices' slices that the part
    `index` does not hold (a part read for other devices, e.g. the first node's rows given to
    a process of the second), and the part, before any device receives anything."""
    blocks, outside = {}, []
    for device_index in device_indices:
        try:
            blocks[_bounds(device_index, shape)] = device_part(piece, device_index, shape, index)
        except ValueError:
            outside.append(_bounds(device_index, shape))
    if outside:
        span = tuple((min(b[d][0] for b in outside), max(b[d][1] for b in outside))
                     for d in range(len(shape)))
        part = _bounds(index or (slice(None),) * len(shape), shape)
        raise ValueError(f"place: the slice {_show(span)} of a {list(shape)} array that this "
                         f"process's devices hold lies outside the part {_show(part)} read for "
                         f"them ({list(piece.shape)}); accepted: the part owned_index(shape, "
                         "mesh) names for this process's devices, or the whole array")
    return blocks


@functools.lru_cache(maxsize=64)
def _stacker(mesh: Mesh, spec: P, count: int, axis: str | None) -> Callable[..., jax.Array]:
    """`count` layer slices -> their stack [count, ...], spread like each slice, the layer dim
    over `axis` (no data moves between devices: each keeps its slices of its layers)."""
    return jax.jit(lambda *layers: jnp.stack(layers),
                   out_shardings=NamedSharding(mesh, P(axis, *spec)))


def spread_hf_params(config: Any, path: str | os.PathLike, mesh: Mesh, *,
                     dtype: Any = np.float32, progress: bool = True,
                     head: str = hf_io.CAUSAL_LM,
                     stage_layers: tuple[int, ...] | None = None) -> dict[str, jax.Array]:
    """`{our path: array}` of a HF checkpoint's parameters, each spread over `mesh` (see the
    module docstring), converted to `dtype`. `config` is the models config `config.json` gives;
    `head` says which model the paths are those of (`models.hf`: a causal LM's, or a reward
    model's `base/...` and `v_head` for a sequence classifier). Parameters the checkpoint has
    no tensor for (`models.hf.unmapped_params`: a reward model's unused LM projection) are
    zeros, created on the devices. On a pipeline's mesh, `stage_layers` (the pipeline split's
    blocks per stage, `step.pipeline.split.num_layers`) lets the stacked leaves be split over
    the stages as loaded (`layer_axis`)."""
    hf = hf_io.read_hf_config(path)
    abstract = hf_io.param_shapes(config, head)
    names = hf_io.param_axes(config, head)
    values = {name: _zeros(abstract[name], mesh, dtype)
              for name in hf_io.unmapped_params(config, head)}
    layers: dict[str, list[jax.Array]] = {}
    pieces = sum(len(r.ours) * (r.layers if r.per_layer else 1)
                 for r in hf_io.hf_name_map(config, head))
    with (hf_io.open_safetensors(path) as get_tensor,
          tqdm(total=pieces, desc="loading", unit="tensor", disable=not progress or None) as bar):
        for name, layer, piece, index in hf_io.iter_hf_params(
                config, hf_io.NameFallbacks(get_tensor, hf),
                select=lambda shape: owned_index(shape, mesh), head=head):
            full = abstract[name] if layer is None else abstract[name][1:]
            array = place(piece, mesh, dtype, shape=full, index=index,
                          expert_dim=expert_dim(names[name], layer is not None))
            if layer is None:
                values[name] = array
            else:
                layers.setdefault(name, []).append(array)
                if len(layers[name]) == abstract[name][0]:          # all its [L] layers
                    slices = layers.pop(name)
                    values[name] = _stacker(mesh, slices[0].sharding.spec, len(slices),
                                            layer_axis(mesh, stage_layers))(*slices)
            del piece                     # the host copy goes as soon as the devices have it
            bar.update()
    return values


def expert_dim(names: tuple[str, ...], layer_slice: bool) -> int | None:
    """The dim of experts (`models.axes.EXPERTS`) of a loaded piece whose parameter has the
    logical axes `names` (a layer's slice of a stacked one: without the leading layer dim);
    None for a piece of no expert leaf."""
    if EXPERTS not in names:
        return None
    return names.index(EXPERTS) - (1 if layer_slice else 0)


def _zeros(shape: tuple[int, ...], mesh: Mesh, dtype: Any) -> jax.Array:
    """Zeros of `shape` in `spread_spec` layout, made on the devices (no host copy)."""
    sharding = NamedSharding(mesh, spread_spec(shape, mesh))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def load_pretrained(path: str | os.PathLike, mesh: Mesh, *, optimizer: Any = None,
                    config: ZeroConfig | None = None, pipeline: Any = None,
                    loss_fn: Any = None, trainable: Any = None, seed: int = 0,
                    progress: bool = True) -> tuple[ZeroStep, TrainState]:
    """`(step, state)`: the ZeRO step of the HF checkpoint at `path` (a directory with
    `config.json` and safetensors, single or sharded with an index) and its initial state
    holding the pretrained parameters in their ZeRO partitions (see the module docstring).

    `optimizer`, `config`, `pipeline`, `loss_fn` and `trainable` are `make_step`'s; `seed` seeds
    the run's random draws (as `ZeroStep.init`). `zeroxla.gathered_model(state)` is the
    unsharded model, whose `.config` is the models config read from `config.json`."""
    hf = hf_io.read_hf_config(path)
    try:
        hf_io.check_head(hf, (hf_io.CAUSAL_LM,), user="load_pretrained",
                         instead="load a reward model with `zeroxla reward --init-from` or "
                                 "zeroxla.rlhf.load_hf_reward_model")
        model_config = hf_io.from_hf_config(hf)
    except ValueError as e:
        raise ValueError(f"{Path(path)}: {e}") from None
    cls = model_class(model_config)
    step = make_step(lambda: cls(model_config, rngs=nnx.Rngs(0)), mesh, optimizer=optimizer,
                     config=config, loss_fn=loss_fn, trainable=trainable, pipeline=pipeline)
    values = spread_hf_params(model_config, path, mesh,
                              dtype=np.dtype(step.layout.config.master_dtype), progress=progress,
                              stage_layers=stage_layers(step))
    return step, step.init_from(values, seed)


def stage_layers(step: ZeroStep) -> tuple[int, ...] | None:
    """The blocks each pipeline stage of `step` holds (None without a pipeline), for
    `spread_hf_params`."""
    return None if step.pipeline is None else tuple(step.pipeline.split.num_layers)


__all__ = ["device_part", "expert_dim", "layer_axis", "load_pretrained", "owned_index", "place",
           "spread_axes", "spread_hf_params", "spread_spec", "stage_layers"]
