"""A LoRA model as Hugging Face files: the merged model (plain safetensors transformers loads),
or the adapters alone as a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`)
that `peft.PeftModel.from_pretrained` loads onto the base checkpoint.

    save_merged(model, config, "out")                          # W + (alpha / r) A @ B
    save_peft_adapter(model, lora, config, "adapter", base_model_name_or_path="base")

PEFT's LoRA on an `nn.Linear` of weight W [out, in] adds (lora_alpha / r) * lora_B @ lora_A,
lora_A [r, in], lora_B [out, r]. Ours adds (alpha / r) * A @ B to W [*IN, *OUT] (`LoRAWeight`).
`models.hf` owns how our W becomes the HF tensor (reshapes, transposes, the RoPE row order);
that map only moves entries, so it is read off once per weight from W's entry indices: HF entry
[o, i] holds our entry (in_index, out_index), and lora_A / lora_B are A's rows / B's columns in
that order. A weight whose HF tensor is not one `nn.Linear` [out, in] of ours alone (GPT-2's
Conv1D [in, out], its fused c_attn) is refused by name, and so is an embedding table (our
weight indexed by token or position, an `nn.Embedding` [num_embeddings, embedding_dim] in
transformers), whose PEFT adapter is another pair, `lora_embedding_A` / `lora_embedding_B`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from zeroxla.lora.adapter import LoRAWeight
from zeroxla.lora.config import LoRAConfig
from zeroxla.lora.convert import fuse_lora_weight
from zeroxla.models import axes, hf

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."          # PeftModel's prefix before the transformers names
# The input dim of a table the model indexes instead of contracting: transformers' nn.Embedding.
EMBEDDING_AXES = (axes.VOCAB, axes.POSITION)


def save_merged(model: nnx.Module, config: Any, out_dir: str | Path, **kwargs) -> list[Path]:
    """The fused model (`fuse_lora_weight`) as a HF checkpoint (`models.hf.save_hf_model`, its
    keyword arguments passed on); returns the files written."""
    return hf.save_hf_model(config, fuse_lora_weight(model), out_dir, **kwargs)


def _adapters(model: nnx.Module) -> dict[str, LoRAWeight]:
    return {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model)
            if isinstance(node, LoRAWeight)}


def _order(rule: hf.Rule, shape: tuple[int, ...], split: int) -> tuple[np.ndarray, np.ndarray]:
    """(our input index of each HF column, our output index of each HF row) for a weight of
    per-layer `shape` whose first `split` dims are its input; ValueError when the HF tensor is
    not an [out, in] matrix of that weight's entries."""
    fan_out = math.prod(shape[split:])
    where = np.asarray(rule.to_hf(np.arange(math.prod(shape), dtype=np.float64).reshape(shape)))
    ins, outs = where.astype(np.int64) // fan_out, where.astype(np.int64) % fan_out
    if where.ndim != 2 or not ((ins == ins[:1]).all() and (outs == outs[:, :1]).all()):
        raise ValueError(f"PEFT export: HF tensor {rule.hf} is not an nn.Linear [out, in] of "
                         f"{rule.ours[0]} (a Conv1D [in, out] or a fused tensor); accepted: "
                         "adapters on weights each mapped to one nn.Linear (Llama's)")
    return ins[0], outs[:, 0]


def _check_not_embedding(path: str, rule: hf.Rule, adapter: LoRAWeight) -> None:
    """ValueError naming the table when the adapted weight is an embedding (its input dim the
    vocabulary or the positions): PEFT adapts an nn.Embedding with lora_embedding_A [r,
    num_embeddings] and lora_embedding_B [embedding_dim, r], not the nn.Linear pair."""
    names = adapter.base.get_metadata().get("logical_axes") or ()
    stacked = 1 if rule.per_layer else 0
    if len(names) > stacked and names[stacked] in EMBEDDING_AXES:
        raise ValueError(f"PEFT export of the adapter on {path!r}: HF tensor {rule.hf} is an "
                         "embedding table (transformers' nn.Embedding [num_embeddings, "
                         "embedding_dim]), whose PEFT adapter is lora_embedding_A / "
                         "lora_embedding_B, which this export does not write; accepted: "
                         "adapters on weights each mapped to one nn.Linear (Llama's projections "
                         "and lm_head): leave the embedding out of --lora-module-name, or export "
                         "the merged model")


def peft_tensors(model: nnx.Module, config: Any) -> dict[str, np.ndarray]:
    """PEFT's `adapter_model.safetensors` entries of `model`'s adapters, float32."""
    rules = {r.ours[0]: r for r in hf.hf_name_map(config) if len(r.ours) == 1}
    tensors = {}
    for path, adapter in sorted(_adapters(model).items()):
        if path not in rules:
            raise ValueError(f"PEFT export: {path} has no HF tensor of its own in the "
                             f"{config.family} name map (models/hf.py)")
        rule = rules[path]
        if rule.experts:
            raise ValueError(f"PEFT export of the adapter on {path!r}: {config.family}'s "
                             f"experts are one tensor per expert ({rule.hf!r}), an adapter per "
                             "expert the PEFT export does not write; export the merged model "
                             "(save_merged) instead")
        if "{pair[" in rule.hf or "{unit[" in rule.hf:
            raise ValueError(f"PEFT export of the adapter on {path!r}: {config.family} stores "
                             f"several HF layers per block ({rule.hf!r}), which the adapter "
                             "export does not split; export the merged model instead")
        _check_not_embedding(path, rule, adapter)
        a = np.asarray(adapter.lora_a[...], np.float32)                # [*L, *IN, r]
        b = np.asarray(adapter.lora_b[...], np.float32)                # [*L, r, *OUT]
        layers = range(a.shape[0]) if rule.per_layer else [None]
        shape = adapter.base.get_value().shape[1 if rule.per_layer else 0:]
        ins, outs = _order(rule, tuple(shape), adapter.fan_in_dims)
        rank = a.shape[-1]
        for i in layers:
            ai, bi = (a, b) if i is None else (a[i], b[i])
            module = PEFT_PREFIX + rule.name(i).removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = ai.reshape(-1, rank)[ins].T      # [r, in]
            tensors[f"{module}.lora_B.weight"] = bi.reshape(rank, -1)[:, outs].T  # [out, r]
    return tensors


def save_peft_adapter(model: nnx.Module, lora: LoRAConfig, config: Any, out_dir: str | Path, *,
                      base_model_name_or_path: str | None = None) -> list[Path]:
    """Writes `model`'s adapters as a PEFT LoRA adapter (`adapter_config.json`,
    `adapter_model.safetensors`) for the HF export of its base; returns the files written."""
    tensors = peft_tensors(model, config)
    if not tensors:
        raise ValueError("PEFT export: the model has no LoRA adapters "
                         "(convert_linear_layer_to_lora adds them)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.split(".")[-3] for name in tensors})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.dim, "lora_alpha": lora.alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path}
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    weights = out / ADAPTER_WEIGHTS
    save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(weights))
    return [out / ADAPTER_CONFIG, weights]
