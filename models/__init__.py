"""Flax NNX decoder-only language models. They name logical axes and know nothing of meshes."""

from .gpt import GPT, GPTConfig
from .layers import LayerStack, scan_layers
from .llama import Llama, LlamaConfig

PRESETS = {
    "gpt-tiny": (GPT, GPTConfig.tiny),
    "gpt-small": (GPT, GPTConfig.small),
    "gpt2-124m": (GPT, GPTConfig.gpt2_124m),
    "gpt2-350m": (GPT, GPTConfig.gpt2_350m),
    "llama-tiny": (Llama, LlamaConfig.tiny),
    "llama-small": (Llama, LlamaConfig.small),
    "llama-1b": (Llama, LlamaConfig.llama_1b),
    "llama-7b": (Llama, LlamaConfig.llama_7b),
}


# config.family -> (model class, config class): how a stored or loaded config becomes a model.
FAMILIES = {"gpt2": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}


def model_class(config):
    """The model class of a models config (by its `family`); ValueError for anything else."""
    family = getattr(config, "family", None)
    if family not in FAMILIES:
        raise ValueError(f"{type(config).__name__} is not a models config; known families: "
                         f"{sorted(FAMILIES)}")
    return FAMILIES[family][0]


def abstract_model(config):
    """The model of `config` as shapes only (`nnx.eval_shape`): nothing is allocated."""
    from flax import nnx

    cls = model_class(config)
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))


def build(name: str, *, seed: int = 0, **overrides):
    """Instantiates the preset `name` (see PRESETS), with config fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(PRESETS)}")
    cls, preset = PRESETS[name]
    config = preset().replace(**overrides) if overrides else preset()
    from flax import nnx

    return cls(config, rngs=nnx.Rngs(seed))


__all__ = ["FAMILIES", "GPT", "GPTConfig", "abstract_model", "model_class", "Llama", "LlamaConfig", "LayerStack", "PRESETS", "build", "scan_layers"]
