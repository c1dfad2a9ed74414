"""Real model shapes, as their Hugging Face `config.json`s say, for planning (`zeroxla plan`).

Each preset is the keys of the published `config.json` that fix the model's shape (sizes, heads,
RoPE, biases, tied head, sliding-window switches), read through the family's own mapping
(`hf_config.from_hf_config`), so a preset is exactly the config loading that checkpoint gives.
Values from huggingface.co/<repo>/blob/main/config.json of the repositories named:

    Llama-3.2-1B   meta-llama/Llama-3.2-1B     Llama-3.1-8B  meta-llama/Llama-3.1-8B
    Qwen2.5-0.5B   Qwen/Qwen2.5-0.5B           Qwen2.5-1.5B  Qwen/Qwen2.5-1.5B
    Qwen2.5-7B     Qwen/Qwen2.5-7B             Qwen3-0.6B    Qwen/Qwen3-0.6B
    Qwen3-8B       Qwen/Qwen3-8B               Qwen3-30B-A3B Qwen/Qwen3-30B-A3B
    gpt-oss-20b    openai/gpt-oss-20b          Qwen3.5-27B   Qwen/Qwen3.5-27B
    Qwen3.5-35B-A3B  Qwen/Qwen3.5-35B-A3B     Gemma-4-31B   google/gemma-4-31B

The Qwen3.5 checkpoints are multimodal (`Qwen3_5[Moe]ForConditionalGeneration`): presets are
the `text_config` the language model is built from, nested as published; the vision tower and
the multi-token-prediction layer (`mtp_num_hidden_layers`) are not built, so a preset's count
is the text model's (26.9 B and 34.7 B of the cards' 27 B and 35 B). Gemma-4-31B is multimodal
too (`Gemma4ForConditionalGeneration`): its preset is the `text_config`, whose count is the
card's 30.7 B (the vision tower not built). Its values as MaxText's
`src/maxtext/configs/models/gemma4-31b.yml` holds them (60 layers of 5 sliding + 1 global,
d 5376, 32 heads, 16 key-value heads of 256, the global layer's 4 of 512 with keys equal to
values, MLP 21504, window 1024, final soft-cap 30, RoPE 1e4 sliding and proportional 1e6 at
0.25 global), the vocabulary and the 256 K context (262144) the model card gives, and
`Gemma4TextConfig`'s defaults (transformers 5.23) for the rest; no per-layer input embeddings
(`hidden_size_per_layer_input` 0), no shared KV layers, no MoE block.

No weights: `config(name)` is a config dataclass, `models.abstract_model(config)` its shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False}
_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
          "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "use_sliding_window": False}
_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu",
          "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "head_dim": 128, "attention_bias": False,
          "use_sliding_window": False, "sliding_window": None}
# Qwen3.5's text_config keys both sizes share: 3 Gated DeltaNet layers then 1 gated attention
# layer, head_dim 256, partial RoPE (0.25 of the dims, mRoPE sections that text reads as plain)
_QWEN3_5_TEXT = {"hidden_act": "silu", "vocab_size": 248320, "head_dim": 256,
                 "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                 "initializer_range": 0.02, "attention_bias": False, "attn_output_gate": True,
                 "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                 "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                 "linear_num_key_heads": 16, "mtp_num_hidden_layers": 1,
                 "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                     "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                     "mrope_section": [11, 11, 10]}}

# Gemma-4-31B's text_config (module docstring: where each value comes from)
_GEMMA4_31B_TEXT = {
    "model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size": 262144, "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
    "attention_k_eq_v": True, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "sliding_window": 1024, "final_logit_softcapping": 30.0, "attention_bias": False,
    "tie_word_embeddings": True, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "use_double_wide_mlp": False,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                           "partial_rotary_factor": 0.25}}}


def _qwen3_5(model_type: str, architecture: str, layers: int, **text: Any) -> dict[str, Any]:
    """A Qwen3.5 config.json: the text model's keys under `text_config` (its vision_config
    omitted: not built), `layers` of the repeating 3 + 1 pattern."""
    types = ["linear_attention"] * 3 + ["full_attention"]
    return {"model_type": model_type, "architectures": [architecture],
            "tie_word_embeddings": False,
            "text_config": {**_QWEN3_5_TEXT, "model_type": f"{model_type}_text",
                            "num_hidden_layers": layers, "layer_types": types * (layers // 4),
                            **text}}


# name -> the shape keys of its config.json
HF_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "Llama-3.2-1B": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}},
    "Llama-3.1-8B": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "tie_word_embeddings": False,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "Qwen2.5-0.5B": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "max_position_embeddings": 32768,
                     "max_window_layers": 24, "sliding_window": 32768,
                     "tie_word_embeddings": True},
    "Qwen2.5-1.5B": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "max_position_embeddings": 131072,
                     "max_window_layers": 21, "sliding_window": 131072,
                     "tie_word_embeddings": True},
    "Qwen2.5-7B": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "max_position_embeddings": 131072,
                   "max_window_layers": 28, "sliding_window": 131072, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "max_window_layers": 28,
                   "tie_word_embeddings": True},
    "Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "max_window_layers": 36, "tie_word_embeddings": False},
    "Qwen3-30B-A3B": {**_QWEN3, "model_type": "qwen3_moe",
                      "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "max_window_layers": 48, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "router_aux_loss_coef": 0.001, "output_router_logits": False,
                      "tie_word_embeddings": False},
    # its experts stored as MXFP4 (read decoded, `models.mxfp4`): planned in the compute dtype
    "gpt-oss-20b": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                    "hidden_act": "silu", "vocab_size": 201088, "hidden_size": 2880,
                    "intermediate_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                    "attention_bias": True, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
                    "router_aux_loss_coef": 0.9, "output_router_logits": False,
                    "rope_theta": 150000, "rope_scaling": {
                        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096},
                    "quantization_config": {"quant_method": "mxfp4"},
                    "tie_word_embeddings": False},
    "Qwen3.5-27B": _qwen3_5("qwen3_5", "Qwen3_5ForConditionalGeneration", 64,
                            hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                            num_key_value_heads=4, linear_num_value_heads=48),
    "Qwen3.5-35B-A3B": _qwen3_5("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", 40,
                                hidden_size=2048, num_attention_heads=16,
                                num_key_value_heads=2, linear_num_value_heads=32,
                                num_experts=256, num_experts_per_tok=8,
                                moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                router_aux_loss_coef=0.001, output_router_logits=False),
    "Gemma-4-31B": {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                    "tie_word_embeddings": True, "text_config": _GEMMA4_31B_TEXT},
}

NAMES = tuple(HF_CONFIGS)


def config(name: str) -> Any:
    """The model config of preset `name` (its family's config dataclass); a ValueError lists
    the presets."""
    from .hf_config import from_hf_config

    if name not in HF_CONFIGS:
        raise ValueError(f"unknown preset {name!r}; accepted: {', '.join(NAMES)}")
    return from_hf_config(HF_CONFIGS[name])


__all__ = ["HF_CONFIGS", "NAMES", "config"]
