"""LoRA (Hu et al. 2021) as DeepSpeed-Chat runs it: low-rank adapters on any NNX model's linear
weights, chosen by a regular expression over parameter paths, trained alone or with the base.

    config.py    LoRAConfig: dim (rank), alpha, module_name (the path regex), only_optimize_lora
    adapter.py   LoRAWeight: a weight read as W + (alpha / r) A @ B, B zero-initialised
    convert.py   convert_linear_layer_to_lora (in place), lora_trainable (make_step's filter),
                 fuse_lora_weight (the merged plain model), lora_parameter_count
    export.py    save_merged (HF safetensors of the fused model), save_peft_adapter (a PEFT
                 adapter for the base's HF export); imported on use, not here

Layer: above `zeroxla.models` (it reads the logical axis names), below everything that runs a
model: the adapters are ordinary `nnx.LoRAParam`s, planned, partitioned, quantized (the frozen
base) and checkpointed as any parameter (tests/zeroxla/test_package.py holds the rules).
"""

from zeroxla.lora.adapter import LoRAWeight
from zeroxla.lora.config import LoRAConfig
from zeroxla.lora.convert import (convert_linear_layer_to_lora, fuse_lora_weight,
                                  lora_parameter_count, lora_trainable)

__all__ = ["LoRAConfig", "LoRAWeight", "convert_linear_layer_to_lora", "fuse_lora_weight",
           "lora_parameter_count", "lora_trainable"]
