"""Adding LoRA adapters to a model and fusing them back (DeepSpeed-Chat's
`convert_linear_layer_to_lora` and `fuse_lora_weight`), for any NNX model.

    adapted = convert_linear_layer_to_lora(model, LoRAConfig(dim=8, alpha=16), rngs=nnx.Rngs(1))
    step = make_step(model, mesh, trainable=lora_trainable(config), ...)
    merged = fuse_lora_weight(model)        # a copy whose weights are W + (alpha / r) A @ B

The weights adapted are the `nnx.Param` attributes of modules (an `nnx.Linear`'s `kernel`, a
Llama block's `wq`) of rank >= 2 per layer, with the `embed` axis where the model names its
axes (so not GPT's per-head biases), whose path matches `LoRAConfig.module_name`; a
`LayerStack`'s weights carry a leading `layers` dim and get per-layer adapters, an MoE layer's
experts (`experts` dim) one adapter each.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from typing import Any

from flax import nnx

from zeroxla.lora.adapter import LoRAWeight
from zeroxla.lora.config import LoRAConfig
from zeroxla.models import axes

Filter = Any


def _weights(model: nnx.Module) -> list[tuple[str, nnx.Module, str, nnx.Param]]:
    """(path, owning module, attribute, Param) for every Param held as a module attribute."""
    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and not isinstance(node, LoRAWeight):
            for name, child in vars(node).items():
                if isinstance(child, nnx.Param) and not isinstance(child, nnx.LoRAParam):
                    found.append(("/".join(map(str, (*path, name))), node, name, child))
    return found


def _stacked_dims(param: nnx.Param) -> int:
    """The leading dims that hold one weight each: a stack's `layers`, then an MoE layer's
    `experts` (each expert its own adapter, as PEFT adapts each expert's linear layers)."""
    names = param.get_metadata().get("logical_axes") or ()
    count = 0
    for expected in (axes.LAYERS, axes.EXPERTS):
        if len(names) > count and names[count] == expected:
            count += 1
    return count


def _is_linear_weight(param: nnx.Param) -> bool:
    """A projection's weight: rank >= 2 per layer and, where the model names its per-layer
    logical axes, one of them the model dim `embed` (wq [D, H, K], wo [H, K, D], w_up [D, F]);
    a per-head bias (GPT's bq [H, K]) has rank 2 but no `embed` and is not a linear layer's
    weight, as PEFT and DeepSpeed-Chat adapt only the weights of linear layers."""
    stacked = _stacked_dims(param)
    if param.get_value().ndim - stacked < 2:
        return False
    # A user's nnx.Linear in a LayerStack is named ('layers', None, None): only the stack's
    # axis, so it names none of its own.
    names = [n for n in (param.get_metadata().get("logical_axes") or ())[stacked:] if n]
    return not names or axes.EMBED in names


def fan_in_dims(param: nnx.Param) -> int:
    """W's input dims (after the stacked one): one, except for a projection back into the
    model dim of rank > 2 (`wo` [H, K, D]: input H, K), whose output is its last dim."""
    names = param.get_metadata().get("logical_axes") or ()
    rank = param.get_value().ndim - _stacked_dims(param)
    return rank - 1 if rank > 2 and names and names[-1] == axes.EMBED else 1


def convert_linear_layer_to_lora(model: nnx.Module, config: LoRAConfig, *,
                                 rngs: nnx.Rngs) -> tuple[str, ...]:
    """Replaces, in place, every matching weight of `model` by a `LoRAWeight` around it.

    Returns the adapted weights' paths (their base now at '<path>/base'). ValueError when the
    pattern matches no weight (listing the candidates), when a matched weight is shared by two
    paths (a tied embedding: adapting one use would make the two uses differ), or when the
    model already has adapters.
    """
    if not config.enabled:
        raise ValueError(f"LoRAConfig.dim={config.dim}: no adapters to add (dim must be > 0)")
    if any(isinstance(node, LoRAWeight) for _, node in nnx.iter_graph(model)):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    weights = [w for w in _weights(model) if _is_linear_weight(w[3])]
    pattern = re.compile(config.module_name)
    chosen = [w for w in weights if pattern.search(w[0])]
    if not chosen:
        raise ValueError(f"LoRAConfig.module_name={config.module_name!r} matches none of the "
                         f"linear weights {[w[0] for w in weights][:12]}")
    uses = Counter(id(param) for *_, param in _weights(model))
    shared = [path for path, _, _, param in chosen if uses[id(param)] > 1]
    if shared:
        raise ValueError(f"LoRAConfig.module_name={config.module_name!r} matches shared "
                         f"weights {shared}; exclude them (a tied weight read at two places "
                         "would get its adapter at one only)")
    for path, owner, name, param in chosen:
        setattr(owner, name, LoRAWeight(param, rank=config.dim, scaling=config.scaling,
                                        stacked_dims=_stacked_dims(param),
                                        fan_in_dims=fan_in_dims(param), key=rngs.params()))
    return tuple(w[0] for w in chosen)


def lora_trainable(config: LoRAConfig) -> Filter | None:
    """`make_step`'s `trainable` filter: the adapters alone with `only_optimize_lora`, else
    None (everything trains)."""
    return nnx.LoRAParam if config.only_optimize_lora else None


def lora_parameter_count(model: nnx.Module) -> int:
    """Elements in the model's adapters (A and B of every `LoRAWeight`)."""
    return sum(v.get_value().size for v in
               nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)).leaves)


def fuse_lora_weight(model: nnx.Module) -> nnx.Module:
    """A deep copy of `model` with every `LoRAWeight` replaced by an `nnx.Param` holding
    W + (alpha / r) A @ B (the base's metadata kept): the plain model the adapters define,
    with the paths of the model before `convert_linear_layer_to_lora`. `model` is unchanged."""
    fused = copy.deepcopy(model)
    for _, node in list(nnx.iter_graph(fused)):
        if isinstance(node, nnx.Module):
            for name, child in list(vars(node).items()):
                if isinstance(child, LoRAWeight):
                    child.base.set_value(child())
                    setattr(node, name, child.base)
    return fused
