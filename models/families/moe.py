"""What the Mixture-of-Experts families share (`qwen3_moe`, `qwen2_moe`, `mixtral`, `olmoe`,
all `models.moe_llama.MoeLlama`): the router and expert config.json keys, the layers-are-all-
sparse rule, and the tensor rows of routers and experts (`expert_rows`, which `qwen3_5_moe`'s
periods use too).

Checkpoints: transformers 5.23 writes (`save_pretrained`) one tensor per expert and projection,
`mlp.experts.{e}.gate_proj.weight` [F, D] (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`),
and holds them in memory fused, `mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj`
[E, D, F]; the rows here name the per-expert tensors, and the loader reads a checkpoint written
fused through `models.hf_names.NameFallbacks`. DeepSeek (grouped routing, multi-head latent
attention) is another model_type, refused by name (`families.family`); gpt-oss is its own
family (`families.gpt_oss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..hf_rules import concat, linear
from ..moe_llama import MoeLlamaConfig
from . import llama
from .spec import Row, require

UNSUPPORTED_MOE = {
    "deepseek_v2": "DeepSeek's grouped routing (n_group, topk_group) and multi-head latent "
                   "attention (kv_lora_rank) are not built",
    "deepseek_v3": "DeepSeek's grouped routing (n_group, topk_group), sigmoid scoring with a "
                   "correction bias and multi-head latent attention (kv_lora_rank) are not built",
}


def all_layers_sparse(hf: Mapping[str, Any]) -> None:
    """Refuses dense layers among sparse ones (transformers: layer i is sparse when it is not in
    `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0): the stack's layers are one
    shape. Every released Qwen MoE has decoder_sparse_step 1 and no mlp_only_layers."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    require(step == 1, "decoder_sparse_step", step, "every layer must be sparse (1); a stack "
            "mixing dense and MoE layers is not built")
    require(not dense, "mlp_only_layers", dense, "every layer must be sparse ([]); a stack "
            "mixing dense and MoE layers is not built")


def moe_fields(hf: Mapping[str, Any], experts_key: str, expert_mlp_key: str) -> dict[str, Any]:
    """The `MoeLlamaConfig` fields of the router and experts (and the Llama ones)."""
    fields = llama.llama_fields(hf)
    # transformers 5 writes Qwen3-MoE's count as num_local_experts (its attribute_map), the
    # released checkpoints num_experts: either is read.
    count = next((hf[k] for k in (experts_key, "num_experts", "num_local_experts") if k in hf),
                 None)
    require(isinstance(count, int) and count >= 1, experts_key, count,
            "an MoE config names its expert count (an integer >= 1)")
    return dict(fields, num_experts=count,
                experts_per_token=hf.get("num_experts_per_tok", 2),
                expert_mlp_dim=hf[expert_mlp_key],
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(hf.get("output_router_logits", False)))


def moe_hf(config: MoeLlamaConfig, experts_key: str, expert_mlp_key: str) -> dict[str, Any]:
    return {**llama.llama_hf(config), experts_key: config.num_experts,
            "num_experts_per_tok": config.experts_per_token,
            expert_mlp_key: config.expert_mlp_dim, "norm_topk_prob": config.norm_topk_prob,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": config.output_router_logits,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def expert_linear():
    """Our expert weight [E, in, out] <-> the E stacked nn.Linear weights [E, out, in]."""

    def to_hf(w):
        return np.swapaxes(w, 1, 2)

    def from_hf(t):
        return (np.swapaxes(t, 1, 2),)

    return to_hf, from_hf


def tensor_map(c: MoeLlamaConfig, moe: str = "mlp", names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj")) -> list[Row]:
    """Llama's attention rows (OLMoE's q/k norms over the whole projection) and the MoE's:
    router `{moe}.gate.weight` [E, D], experts `{moe}.experts.{e}.<names>.weight` (an `{e}`
    row: the expert's tensors stacked), Qwen2-MoE's shared expert."""
    d, h, g, k = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    rows = [r for r in llama.tensor_map(c) if ".mlp." not in r[0]
            and not (c.qk_norm_scope == "projection" and "_norm.weight" in r[0]
                     and ".self_attn." in r[0])]
    if c.qk_norm and c.qk_norm_scope == "projection":
        att = "model.layers.{i}.self_attn."
        rows += [(att + "q_norm.weight", ("q_norm/scale",), concat(((h, k),), ((h * k,),))),
                 (att + "k_norm.weight", ("k_norm/scale",), concat(((g, k),), ((g * k,),)))]
    return rows + expert_rows(c, "model.layers.{i}." + moe + ".", "moe/", names)


def expert_rows(c: Any, mlp: str, ours: str, names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj")) -> list[Row]:
    """The rows of one `models.moe.MoeMLP` (`ours`: its path, "moe/") under the HF prefix
    `mlp` ("model.layers.{i}.mlp."): router `{mlp}gate.weight` [E, D], experts
    `{mlp}experts.{e}.<names>.weight` (an `{e}` row: the expert's tensors stacked), and with
    `c.shared_expert_mlp_dim` the shared expert `{mlp}shared_expert.*` and its gate."""
    d, s = c.d_model, c.shared_expert_mlp_dim
    gate, up, down = names
    rows = [(mlp + "gate.weight", (ours + "router",), linear((d, c.num_experts), 1)),
            (mlp + "experts.{e}." + gate + ".weight", (ours + "w_gate",), expert_linear()),
            (mlp + "experts.{e}." + up + ".weight", (ours + "w_up",), expert_linear()),
            (mlp + "experts.{e}." + down + ".weight", (ours + "w_down",), expert_linear())]
    if s:
        shared = mlp + "shared_expert."
        rows += [(shared + "gate_proj.weight", (ours + "shared_gate",), linear((d, s), 1)),
                 (shared + "up_proj.weight", (ours + "shared_up",), linear((d, s), 1)),
                 (shared + "down_proj.weight", (ours + "shared_down",), linear((s, d), 1)),
                 (mlp + "shared_expert_gate.weight", (ours + "shared_expert_gate",),
                  concat(((d,),), ((1, d),)))]
    return rows
