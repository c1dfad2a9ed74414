"""The model families, one module each, registered in one table (`REGISTRY`).

A family (`spec.Family`, torchtitan's `ModelSpec`) is its config dataclass and nnx module, the
transformers classes of its heads, its `config.json` mapping both ways (what is not built is
refused by key before any tensor is read) and its tensor name map. docs/models.md says how to
add one.

- `spec`: the `Family` record, the head names, `require` (the refusal by key).
- `gpt2`: GPT-2 (`models.gpt`).
- `llama`: Llama 2/3.x (`models.llama`) and the config keys and tensors Llama-like families share.
- `qwen2`: Qwen2 / Qwen2.5: Llama + q/k/v biases.
- `qwen3`: Qwen3 dense: Llama + per-head q/k RMSNorm, explicit head_dim.
- `mistral`: Mistral: Llama + sliding-window attention.
- `gemma2`: Gemma 2 (`models.gemma2`): (sliding, global) layer pairs, soft-capping, (1 + w) norms.
- `gemma3`: Gemma 3 text (`models.gemma3`): periods of sliding layers and one global layer, two
  RoPE bases, q/k norms, `text_config` nesting.
- `gemma4`: Gemma 4 text (`models.gemma4`): Gemma 3's periods with a global layer of its own
  head dim, proportional RoPE and k = v, the MoE block beside the dense MLP, `text_config`.
- `qwen3_5`: Qwen3.5 dense (`models.qwen3_5`): periods of Gated DeltaNet layers and one gated
  attention layer, `text_config` nesting, partial RoPE, (1 + w) norms.
- `qwen3_5_moe`: Qwen3.5 MoE (`models.qwen3_5_moe`): `qwen3_5`'s keys and periods, every
  layer's MLP an MoE with a shared expert (`moe`'s expert rows).
- `moe`: what the Mixture-of-Experts families share (router and expert keys and tensors).
- `qwen3_moe`, `qwen2_moe` (a shared expert), `mixtral`, `olmoe` (q/k norms over the whole
  projection): `models.moe_llama`.
- `gpt_oss`: gpt-oss (`models.gpt_oss`): (sliding, full) pairs of MoE layers, attention sinks,
  a router with a bias, clamped SwiGLU experts with biases, MXFP4 experts read.
"""

from __future__ import annotations

from . import (gemma2, gemma3, gemma4, gpt2, gpt_oss, llama, mistral, mixtral, olmoe, qwen2,
               qwen2_moe,
               qwen3, qwen3_5, qwen3_5_moe, qwen3_moe)
from .gemma2 import Gemma2Config
from .gemma3 import Gemma3Config
from .gemma4 import Gemma4Config
from .gpt_oss import GptOssConfig
from .mistral import MistralConfig
from .mixtral import MixtralConfig
from .moe import UNSUPPORTED_MOE
from .olmoe import OlmoeConfig
from .qwen2 import Qwen2Config
from .qwen2_moe import Qwen2MoeConfig
from .qwen3 import Qwen3Config
from .qwen3_5 import Qwen3_5Config
from .qwen3_5_moe import Qwen3_5MoeConfig
from .qwen3_moe import Qwen3MoeConfig
from .spec import CAUSAL_LM, SEQUENCE_CLASSIFICATION, Family, require

REGISTRY: dict[str, Family] = {spec.name: spec for spec in
                               (gpt2.SPEC, llama.SPEC, qwen2.SPEC, qwen3.SPEC, mistral.SPEC,
                                gemma2.SPEC, gemma3.SPEC, gemma4.SPEC, qwen3_moe.SPEC,
                                qwen2_moe.SPEC,
                                mixtral.SPEC, olmoe.SPEC, qwen3_5.SPEC, qwen3_5_moe.SPEC,
                                gpt_oss.SPEC)}
# another model_type a family's checkpoints may carry -> the family's name
ALIASES: dict[str, str] = {alias: spec.name for spec in REGISTRY.values()
                           for alias in spec.aliases}


def family(name: str | None) -> Family:
    """The registered family `name` (config.json's model_type, a config's `family`); a
    ValueError naming it and the families built otherwise."""
    name = ALIASES.get(name, name)
    if name in UNSUPPORTED_MOE:
        raise ValueError(f"config.json model_type={name!r} is not supported: "
                         f"{UNSUPPORTED_MOE[name]}; zeroxla builds {', '.join(sorted(REGISTRY))}")
    if name not in REGISTRY:
        raise ValueError(f"config.json model_type={name!r} is not supported; zeroxla builds "
                         f"{', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


__all__ = ["CAUSAL_LM", "Family", "Gemma2Config", "Gemma3Config", "Gemma4Config", "GptOssConfig", "MistralConfig",
           "MixtralConfig",
           "OlmoeConfig",
           "Qwen2Config", "Qwen2MoeConfig", "Qwen3Config", "Qwen3MoeConfig", "Qwen3_5Config",
           "Qwen3_5MoeConfig", "REGISTRY",
           "SEQUENCE_CLASSIFICATION", "family", "require"]
