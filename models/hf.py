"""Hugging Face interop: our parameters <-> `transformers` names and configs (files: safetensors_io).

Each family (`models.families`) maps onto its transformers class (`GPT2LMHeadModel`,
`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...). The mapping is a table of
`Rule`s (`hf_name_map(config)`, printable with `describe_hf_name_map`): each rule names one HF
tensor, the parameter path(s) of ours it is made of, and the two reshapes between them. A rule
whose HF name holds `{i}` is per layer: our side is a slice `[i]` of a stacked `[L, ...]` leaf.

The per-family tables, with the layout conventions they follow (GPT-2's Conv1D, Llama's
nn.Linear, RoPE, tied heads; checked against transformers), are each family's `tensor_map`.

Every function takes the checkpoint's `head` (`hf_config`): CAUSAL_LM (default) is our model as it
is; SEQUENCE_CLASSIFICATION (`*ForSequenceClassification`, one label) is our reward-model layout
(`zeroxla.rlhf.RewardModel`, DeepSpeed-Chat's names): the base model's parameters under `base/`
and the score vector `v_head` [D] <-> `score.weight` [1, D]. The base's LM output projection
(Llama's `head/weight`) has no tensor in such a checkpoint (`unmapped_params`).

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
from .hf_config import (ARCHITECTURES, CAUSAL_LM, SEQUENCE_CLASSIFICATION,  # noqa: F401
                        architecture, check_head, from_hf_config, hf_head, read_hf_config,
                        to_hf_config)
from . import abstract_model
from .families import family
from .hf_names import NameFallbacks  # noqa: F401  (re-exported: part of the hf API)
from .hf_rules import (LM_HEAD, SCORE, Rule, as_is_inv, is_per_layer,  # noqa: F401
                       score_fns)
from .gpt import GPTConfig
from .gemma2 import Gemma2Config
from .llama import LlamaConfig

Config = GPTConfig | LlamaConfig | Gemma2Config
# get(path, layer) -> the host array of our parameter `path`, or of its slice [layer] when the
# parameter is stacked and `layer` is not None.
ParamGetter = Callable[[str, int | None], np.ndarray]
# The reward-model layout of a sequence classifier: the base model under REWARD_BASE, the score
# vector REWARD_SCORE [D] (zeroxla.rlhf.RewardModel's attributes).
REWARD_BASE = "base"
REWARD_SCORE = "v_head"


# ----------------------------------------------------------------------------- the name map

@functools.lru_cache(maxsize=16)
def _abstract_params(config: Config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Our parameter path -> (shape, logical axes), from an abstract (never allocated) model."""
    model = abstract_model(config)
    return {_path_str(path): (tuple(var.get_value().shape), var.get_metadata()["logical_axes"])
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@functools.lru_cache(maxsize=16)
def _head_params(config: Config,
                 head: str = CAUSAL_LM) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """`_abstract_params` of the model a `head` checkpoint loads into (the module docstring)."""
    base = _abstract_params(config)
    if head == CAUSAL_LM:
        return base
    if head == SEQUENCE_CLASSIFICATION:
        return ({f"{REWARD_BASE}/{p}": v for p, v in base.items()}
                | {REWARD_SCORE: ((config.d_model,), (axes.EMBED,))})
    raise ValueError(f"head={head!r} is invalid; accepted: {CAUSAL_LM!r}, "
                     f"{SEQUENCE_CLASSIFICATION!r}")


def param_shapes(config: Config, head: str = CAUSAL_LM) -> dict[str, tuple[int, ...]]:
    """Our parameter path -> its shape for `config` and `head` (from the cached abstract
    model)."""
    return {path: shape for path, (shape, _) in _head_params(config, head).items()}


def param_axes(config: Config, head: str = CAUSAL_LM) -> dict[str, tuple[str, ...]]:
    """Our parameter path -> its logical axis names (`models.axes`) for `config` and `head`."""
    return {path: names for path, (_, names) in _head_params(config, head).items()}


def unmapped_params(config: Config, head: str = CAUSAL_LM) -> tuple[str, ...]:
    """Our parameters that no HF tensor of a `head` checkpoint holds: under
    SEQUENCE_CLASSIFICATION, the base's LM output projection (Llama's; GPT-2's is tied), which a
    reward model never reads. A loader fills them with zeros."""
    covered = {p for r in hf_name_map(config, head) for p in r.ours}
    return tuple(sorted(set(_head_params(config, head)) - covered))


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
def hf_name_map(config: Config, head: str = CAUSAL_LM) -> tuple[Rule, ...]:
    """The rules between our parameter paths and HF names for `config`'s family and `head`.

    Every parameter of ours appears in at most one rule (all of them but `unmapped_params`);
    per-layer rules (`"{i}"` in `hf`) name our stacked `[L, ...]` leaves and convert one layer's
    slice.
    """
    _head_params(config, head)                        # refuses an unknown head
    table = family(config.family).tensor_map(config)
    base = _abstract_params(config)
    rules = []
    for hf, ours, fns in table:
        paths = tuple(_resolve(p, is_per_layer(hf), base) for p in ours)
        tail = "{tail[" in hf
        rules.append(Rule(hf, paths, *fns, experts=config.num_experts if "{e}" in hf else 0,
                          unit=config.layers_per_block if "{unit[" in hf or tail else 1,
                          layers=base[paths[0]][0][0] if is_per_layer(hf) else 0,
                          first=config.layers_per_block * config.num_layers if tail else 0))
    covered = sorted(p for r in rules for p in r.ours)
    if covered != sorted(base):
        raise AssertionError(f"models/hf.py's map covers {covered}, the model has {sorted(base)}")
    if head == SEQUENCE_CLASSIFICATION:
        rules = tuple(dataclasses.replace(r, ours=tuple(f"{REWARD_BASE}/{p}" for p in r.ours))
                      for r in rules if r.hf != LM_HEAD)
        rules += (Rule(SCORE, (REWARD_SCORE,), *score_fns(config.d_model)),)
    return tuple(rules)


def describe_hf_name_map(config: Config, head: str = CAUSAL_LM) -> str:
    """The name map as a table: our path(s) [shape] -> HF name, one line per rule."""
    params = _head_params(config, head)
    lines = []
    for r in hf_name_map(config, head):
        ours = " | ".join(f"{p}{list(params[p][0])}" for p in r.ours)
        lines.append(f"{ours:<70} -> {r.hf}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tensors

def param_dict(model: nnx.Module) -> dict[str, jax.Array]:
    """Our parameter path ("blocks/layers/wq") -> array, for an nnx model."""
    return {_path_str(p): v.get_value()
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def to_hf_tensors(config: Config, params: Mapping[str, Any] | ParamGetter,
                  head: str = CAUSAL_LM) -> Iterator[tuple[str, np.ndarray]]:
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
    rules = hf_name_map(config, head)
    for r in rules:
        if not r.per_layer:
            yield r.hf, np.ascontiguousarray(r.to_hf(*(get(p, None) for p in r.ours)))
    for i in range(max((r.layers for r in rules), default=0)):
        for r in rules:
            if i < r.layers:
                yield from r.named(i, r.to_hf(*(get(p, i) for p in r.ours)))


def iter_hf_params(config: Config, get_tensor: Callable[..., np.ndarray], *,
                   select: Callable[[tuple[int, ...]], tuple[slice, ...] | None] | None = None,
                   head: str = CAUSAL_LM
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
    expected = _head_params(config, head)
    for r in hf_name_map(config, head):
        stored_as_is = (select is not None and r.from_hf is as_is_inv and len(r.ours) == 1
                        and hasattr(get_tensor, "shape") and not r.experts)
        for i in range(r.layers) if r.per_layer else (None,):
            name = r.name(i)
            path = r.ours[0]
            want = expected[path][0] if i is None else expected[path][0][1:]
            if stored_as_is:
                shape = tuple(get_tensor.shape(name))
                _check_piece(path, shape, want, i, config, head)
                index = select(shape)
                if index is not None:
                    yield path, i, np.asarray(get_tensor(name, index)), index
                    continue
            tensor = r.read(get_tensor, i)
            try:
                parts = r.from_hf(tensor)
            except ValueError as e:
                raise ValueError(f"{name} has shape {tensor.shape}, which does not fit "
                                 f"{r.ours} of config {config}") from e
            for path, part in zip(r.ours, parts):
                want = expected[path][0] if i is None else expected[path][0][1:]
                _check_piece(path, part.shape, want, i, config, head)
                yield path, i, part, None


def _check_piece(path: str, got: tuple[int, ...], want: tuple[int, ...], layer: int | None,
                 config: Config, head: str) -> None:
    if tuple(got) != tuple(want):
        full = _head_params(config, head)[path][0]
        got = tuple(got) if layer is None else (full[0],) + tuple(got)
        raise ValueError(f"{path}: HF checkpoint gives shape {got}, config {config} needs {full}")


def from_hf_tensors(config: Config, get_tensor: Callable[[str], np.ndarray], *,
                    dtype: Any = np.float32, head: str = CAUSAL_LM) -> dict[str, np.ndarray]:
    """Our parameters (path -> numpy array in `dtype`, stacked leaves [L, ...]) from the HF
    tensors of a `head` checkpoint; `unmapped_params` are zeros.

    `get_tensor(hf_name)` is called once per HF tensor; host memory holds the result plus one
    HF tensor. Shapes are checked against `config`.
    """
    expected = _head_params(config, head)
    out = {p: np.zeros(expected[p][0], dtype) for p in unmapped_params(config, head)}
    for path, layer, part, _ in iter_hf_params(config, get_tensor, head=head):
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

def load_hf_model(path: str | os.PathLike, *,
                  dtype: Any = jnp.float32) -> tuple[Config, nnx.Module]:
    """(config, nnx model) from a HF checkpoint directory (`config.json` + safetensors, single
    or sharded) or a `.safetensors` file with `config.json` beside it. Parameters are cast to
    `dtype`. Host memory: the model as numpy arrays plus one HF tensor, then the jax arrays
    made from them (to place a large model on a mesh, use `from_hf_tensors` and put each leaf
    with its sharding instead)."""
    path = Path(path)
    hf = read_hf_config(path)
    check_head(hf, (CAUSAL_LM,), user="load_hf_model",
               instead="read a reward model's tensors with from_hf_tensors(..., head="
                       "SEQUENCE_CLASSIFICATION) or zeroxla.rlhf.load_hf_reward_model")
    config = from_hf_config(hf)
    with open_safetensors(path) as get_tensor:
        params = from_hf_tensors(config, NameFallbacks(get_tensor, hf),
                                 dtype=_np_dtype(dtype))
    return config, model_from_params(config, params, dtype=dtype)


def save_hf_model(config: Config, params: Mapping[str, Any] | ParamGetter | nnx.Module,
                  out_dir: str | os.PathLike, *, dtype: Any = "float32",
                  max_shard_size: int | str = "5GB", head: str = CAUSAL_LM,
                  **config_overrides) -> list[Path]:
    """Writes a HF checkpoint `transformers.AutoModelForCausalLM.from_pretrained` loads (or,
    with `head=SEQUENCE_CLASSIFICATION`, `AutoModelForSequenceClassification`): `config.json`
    plus safetensors shards. `params` is an nnx model, a mapping path -> array or a getter (see
    `to_hf_tensors`). Returns the files written."""
    if isinstance(params, nnx.Module):
        params = param_dict(params)
    files = write_safetensors(to_hf_tensors(config, params, head), out_dir, dtype=dtype,
                              max_shard_size=max_shard_size)
    cfg_file = Path(out_dir) / "config.json"
    cfg_file.write_text(json.dumps(to_hf_config(config, dtype=dtype, head=head,
                                                **config_overrides), indent=2) + "\n")
    return files + [cfg_file]


def with_vocab_size(config: Config, get: ParamGetter, vocab_size: int,
                    head: str = CAUSAL_LM) -> tuple[Config, ParamGetter]:
    """`config` with `vocab_size` (>= its own) token ids, and a getter whose parameters are
    `get`'s zero-padded to it along every dim named `axes.VOCAB`: rows that no token of the old
    vocabulary reads (a pad token's), so every output of the old ids is unchanged."""
    if vocab_size < config.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} < the model's {config.vocab_size}; accepted: "
                         "a larger vocabulary (rows are added, never dropped)")
    names = {path: logical for path, (_, logical) in _head_params(config, head).items()}

    def padded(path: str, layer: int | None) -> np.ndarray:
        array = get(path, layer)
        dims = names[path] if layer is None else names[path][1:]
        widths = [(0, vocab_size - config.vocab_size if d == axes.VOCAB else 0) for d in dims]
        return np.pad(array, widths) if any(w for _, w in widths) else array

    return config.replace(vocab_size=vocab_size), padded


def _path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)
