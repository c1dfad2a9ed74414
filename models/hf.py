"""Hugging Face interop: our parameters <-> `transformers` names and configs (files: safetensors_io).

GPT-2 maps onto `GPT2LMHeadModel`, Llama onto `LlamaForCausalLM`. The mapping is a table of
`Rule`s (`hf_name_map(config)`, printable with `describe_hf_name_map`): each rule names one HF
tensor, the parameter path(s) of ours it is made of, and the two reshapes between them. A rule
whose HF name holds `{i}` is per layer: our side is a slice `[i]` of a stacked `[L, ...]` leaf.

The per-family tables, with the layout conventions they follow (GPT-2's Conv1D, Llama's
nn.Linear, RoPE, tied heads; checked against transformers), are in `hf_rules`.

Reading streams one HF tensor at a time from (possibly sharded) safetensors; writing keeps at most
one shard's tensors in host memory (see `write_safetensors`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .safetensors_io import (  # noqa: F401  (re-exported: part of the hf API)
    INDEX_FILE,
    SINGLE_FILE,
    _np_dtype,
    open_safetensors,
    parse_size,
    write_safetensors,
)

from . import axes
from .hf_config import from_hf_config, read_hf_config, to_hf_config  # noqa: F401  (re-exported)
from . import abstract_model
from .hf_rules import as_is_inv, gpt2_rules, llama_rules
from .gpt import GPTConfig
from .llama import LlamaConfig

Config = GPTConfig | LlamaConfig
# get(path, layer) -> the host array of our parameter `path`, or of its slice [layer] when the
# parameter is stacked and `layer` is not None.
ParamGetter = Callable[[str, int | None], np.ndarray]



# ----------------------------------------------------------------------------- the name map

@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor and the parameter(s) of ours it is made of.

    `to_hf(*ours) -> hf` takes our arrays (one layer's slice for a per-layer rule) in the order of
    `ours`; `from_hf(hf) -> tuple of ours` is its inverse.
    """

    hf: str
    ours: tuple[str, ...]
    to_hf: Callable[..., np.ndarray]
    from_hf: Callable[[np.ndarray], tuple[np.ndarray, ...]]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


@functools.lru_cache(maxsize=16)
def _abstract_params(config: Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Our parameter path -> (shape, logical axes), from an abstract (never allocated) model."""
    model = abstract_model(config)
    return {_path_str(path): (tuple(var.get_value().shape), var.get_metadata()["logical_axes"])
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def param_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Our parameter path -> its shape for `config` (from the cached abstract model)."""
    return {path: shape for path, (shape, _) in _abstract_params(config).items()}


def _resolve(rel: str, per_layer: bool, params: Mapping[str, tuple]) -> str:
    """Our full path for a rule's path: as is for a global one; for a per-layer one, the unique
    stacked (leading `layers` axis) parameter whose path ends with it."""
    if not per_layer:
        if rel not in params:
            raise KeyError(f"models/hf.py expects parameter {rel!r}; "
                           f"the model has {sorted(params)}")
        return rel
    hits = [p for p, (_, names) in params.items()
            if names and names[0] == axes.LAYERS and (p == rel or p.endswith("/" + rel))]
    if len(hits) != 1:
        raise KeyError(f"models/hf.py expects one stacked parameter ending in {rel!r}, "
                       f"found {hits}")
    return hits[0]


@functools.lru_cache(maxsize=16)
def hf_name_map(config: Config) -> tuple[Rule, ...]:
    """The rules between our parameter paths and HF names for `config`'s family.

    Every parameter of ours appears in exactly one rule; per-layer rules (`"{i}"` in `hf`) name
    our stacked `[L, ...]` leaves and convert one layer's slice.
    """
    if config.family == "gpt2":
        table = gpt2_rules(config)
    elif config.family == "llama":
        table = llama_rules(config)
    else:
        raise ValueError(f"no Hugging Face mapping for family {config.family!r}")
    params = _abstract_params(config)
    rules = tuple(Rule(hf, tuple(_resolve(p, "{i}" in hf, params) for p in ours), *fns)
                  for hf, ours, fns in table)
    covered = sorted(p for r in rules for p in r.ours)
    if covered != sorted(params):
        raise AssertionError(f"models/hf.py's map covers {covered}, the model has {sorted(params)}")
    return rules


def describe_hf_name_map(config: Config) -> str:
    """The name map as a table: our path(s) [shape] -> HF name, one line per rule."""
    params = _abstract_params(config)
    lines = []
    for r in hf_name_map(config):
        ours = " | ".join(f"{p}{list(params[p][0])}" for p in r.ours)
        lines.append(f"{ours:<70} -> {r.hf}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tensors

def param_dict(model: nnx.Module) -> dict[str, jax.Array]:
    """Our parameter path ("blocks/layers/wq") -> array, for an nnx model."""
    return {_path_str(p): v.get_value()
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def to_hf_tensors(config: Config,
                  params: Mapping[str, Any] | ParamGetter) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, array)` one HF tensor at a time, in our parameters' dtype.

    `params` is either a mapping path -> array (numpy or jax; a stacked leaf is sliced to one
    layer before it is brought to host) or a getter `get(path, layer)`, so a caller can stream
    from a sharded store. Global tensors come first, then layer 0, 1, ...
    """
    if isinstance(params, Mapping):
        mapping = params

        def get(path, layer):
            leaf = mapping[path]
            return np.asarray(leaf if layer is None else leaf[layer])
    else:
        get = params
    rules = hf_name_map(config)
    for r in rules:
        if not r.per_layer:
            yield r.hf, np.ascontiguousarray(r.to_hf(*(get(p, None) for p in r.ours)))
    for i in range(config.num_layers):
        for r in rules:
            if r.per_layer:
                yield (r.hf.format(i=i),
                       np.ascontiguousarray(r.to_hf(*(get(p, i) for p in r.ours))))


def iter_hf_params(config: Config, get_tensor: Callable[..., np.ndarray], *,
                   select: Callable[[tuple[int, ...]], tuple[slice, ...] | None] | None = None
                   ) -> Iterator[tuple[str, int | None, np.ndarray, tuple[slice, ...] | None]]:
    """Yields `(our path, layer or None, array, index)` converted from HF tensors, one HF tensor
    read at a time: a per-layer rule yields each of its paths' slice `[layer]`, a global one the
    whole parameter. Each rule's layers come in order 0..L-1. Shapes are checked against
    `config`.

    `select(piece shape) -> index or None` (with a reader that has `shape`, e.g.
    `SafetensorsReader`): where our piece is the stored tensor as it is (no transpose, split or
    reshape: embeddings, norms, GPT-2's Conv1D weights), only `array = piece[index]` is read from
    the file, and `index` says which part it is; elsewhere `index` is None (the whole piece).
    """
    expected = _abstract_params(config)
    for r in hf_name_map(config):
        stored_as_is = (select is not None and r.from_hf is as_is_inv and len(r.ours) == 1
                        and hasattr(get_tensor, "shape"))
        for i in range(config.num_layers) if r.per_layer else (None,):
            name = r.hf.format(i=i) if r.per_layer else r.hf
            path = r.ours[0]
            want = expected[path][0] if i is None else expected[path][0][1:]
            if stored_as_is:
                shape = tuple(get_tensor.shape(name))
                _check_piece(path, shape, want, i, config)
                index = select(shape)
                if index is not None:
                    yield path, i, np.asarray(get_tensor(name, index)), index
                    continue
            tensor = np.asarray(get_tensor(name))
            try:
                parts = r.from_hf(tensor)
            except ValueError as e:
                raise ValueError(f"{name} has shape {tensor.shape}, which does not fit "
                                 f"{r.ours} of config {config}") from e
            for path, part in zip(r.ours, parts):
                want = expected[path][0] if i is None else expected[path][0][1:]
                _check_piece(path, part.shape, want, i, config)
                yield path, i, part, None


def _check_piece(path: str, got: tuple[int, ...], want: tuple[int, ...], layer: int | None,
                 config: Config) -> None:
    if tuple(got) != tuple(want):
        full = _abstract_params(config)[path][0]
        got = tuple(got) if layer is None else (full[0],) + tuple(got)
        raise ValueError(f"{path}: HF checkpoint gives shape {got}, config {config} needs {full}")


def from_hf_tensors(config: Config, get_tensor: Callable[[str], np.ndarray], *,
                    dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Our parameters (path -> numpy array in `dtype`, stacked leaves [L, ...]) from HF tensors.

    `get_tensor(hf_name)` is called once per HF tensor; host memory holds the result plus one
    HF tensor. Shapes are checked against `config`.
    """
    expected = _abstract_params(config)
    out: dict[str, np.ndarray] = {}
    for path, layer, part, _ in iter_hf_params(config, get_tensor):
        if layer is None:
            out[path] = np.asarray(part, dtype)
        else:
            if path not in out:
                out[path] = np.empty(expected[path][0], dtype)
            out[path][layer] = part
    return out


def model_from_params(config: Config, params: Mapping[str, Any], *,
                      dtype: Any = jnp.float32) -> nnx.Module:
    """The nnx model of `config` holding `params` (path -> array), cast to `dtype`."""
    graphdef, state = nnx.split(abstract_model(config))
    flat = nnx.to_flat_state(state)
    missing = [p for p, v in flat if isinstance(v, nnx.Param) and _path_str(p) not in params]
    if missing:
        raise KeyError(f"no value for parameters {[_path_str(p) for p in missing]}")
    for path, var in flat:
        if isinstance(var, nnx.Param):
            var.set_value(jnp.asarray(params[_path_str(path)], dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ----------------------------------------------------------------------------- loading and saving

class NameFallbacks:
    """`reader` with the name fallbacks real checkpoints need: GPT-2 saved from `GPT2Model` (the
    hub's openai-community/gpt2) has no `transformer.` prefix; a tied Llama stores no lm_head.
    Called and `shape`d as the reader is (`SafetensorsReader`)."""

    def __init__(self, reader: Callable[..., np.ndarray], hf: Mapping[str, Any]):
        self.reader = reader
        self.tied_llama = hf.get("model_type") == "llama" and hf.get("tie_word_embeddings", False)

    def _resolve(self, fn: Callable[[str], Any], name: str) -> Any:
        try:
            return fn(name)
        except KeyError:
            if self.tied_llama and name == "lm_head.weight":
                return fn("model.embed_tokens.weight")
            if name.startswith("transformer."):
                return fn(name.removeprefix("transformer."))
            raise

    def __call__(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        return self._resolve(lambda n: self.reader(n) if index is None else self.reader(n, index),
                             name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._resolve(self.reader.shape, name)


def load_hf_model(path: str | os.PathLike, *,
                  dtype: Any = jnp.float32) -> tuple[Config, nnx.Module]:
    """(config, nnx model) from a HF checkpoint directory (`config.json` + safetensors, single
    or sharded) or a `.safetensors` file with `config.json` beside it. Parameters are cast to
    `dtype`. Host memory: the model as numpy arrays plus one HF tensor, then the jax arrays
    made from them (to place a large model on a mesh, use `from_hf_tensors` and put each leaf
    with its sharding instead)."""
    path = Path(path)
    hf = read_hf_config(path)
    config = from_hf_config(hf)
    with open_safetensors(path) as get_tensor:
        params = from_hf_tensors(config, NameFallbacks(get_tensor, hf),
                                 dtype=_np_dtype(dtype))
    return config, model_from_params(config, params, dtype=dtype)


def save_hf_model(config: Config, params: Mapping[str, Any] | ParamGetter | nnx.Module,
                  out_dir: str | os.PathLike, *, dtype: Any = "float32",
                  max_shard_size: int | str = "5GB", **config_overrides) -> list[Path]:
    """Writes a HF checkpoint `transformers.AutoModelForCausalLM.from_pretrained` loads:
    `config.json` plus safetensors shards. `params` is an nnx model, a mapping path -> array or a
    getter (see `to_hf_tensors`). Returns the files written."""
    if isinstance(params, nnx.Module):
        params = param_dict(params)
    files = write_safetensors(to_hf_tensors(config, params), out_dir, dtype=dtype,
                              max_shard_size=max_shard_size)
    cfg_file = Path(out_dir) / "config.json"
    cfg_file.write_text(json.dumps(to_hf_config(config, dtype=dtype, **config_overrides),
                                   indent=2) + "\n")
    return files + [cfg_file]


def _path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)
