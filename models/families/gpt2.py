"""GPT-2 (`model_type: gpt2`, `GPT2LMHeadModel`): `models.gpt.GPT`, tied head, Conv1D layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..gpt import GPT, GPTConfig
from ..hf_rules import as_is, as_is_inv, concat
from .spec import CAUSAL_LM, SEQUENCE_CLASSIFICATION, Family, Row, require

LN_EPS = 1e-5            # models.layers.LayerNorm's eps, which GPT uses
GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")   # all the tanh approximation


def to_hf(config: GPTConfig) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_seq_len,
        "n_embd": config.d_model, "n_layer": config.num_layers, "n_head": config.num_heads,
        "n_inner": config.mlp_dim, "activation_function": "gelu_new",
        "layer_norm_epsilon": LN_EPS, "initializer_range": config.init_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": True,
        # Our model has no dropout; HF's 0.1 defaults would change fine-tuning there.
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        # GPT-2's BPE <|endoftext|>; only meaningful with that vocabulary.
        "bos_token_id": 50256 if config.vocab_size > 50256 else None,
        "eos_token_id": 50256 if config.vocab_size > 50256 else None,
    }


def from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    require(act in GELUS, "activation_function", act, f"GPT uses tanh GELU {GELUS}")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    require(eps == LN_EPS, "layer_norm_epsilon", eps, f"GPT's LayerNorm uses {LN_EPS}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False), ("tie_word_embeddings", True)):
        require(hf.get(key, want) == want, key, hf.get(key), f"GPT needs {key}={want}")
    d = hf["n_embd"]
    return GPTConfig(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], d_model=d,
                     num_heads=hf["n_head"], num_layers=hf["n_layer"],
                     mlp_dim=hf.get("n_inner") or 4 * d, init_std=hf.get("initializer_range", 0.02))


def tensor_map(c: GPTConfig) -> list[Row]:
    """GPT-2 projections are `Conv1D`, weight stored [in, out] (x @ W + b): no transpose;
    `c_attn` fuses q|k|v along `out`, each [D, H*K] head-major. `lm_head` is tied to `wte` and
    absent from its checkpoints."""
    d, h, k = c.d_model, c.num_heads, c.head_dim
    same = (as_is, as_is_inv)
    layer = "transformer.h.{i}."
    return [
        ("transformer.wte.weight", ("embed/wte",), same),                 # [V, D]
        ("transformer.wpe.weight", ("embed/wpe",), same),                 # [P, D]
        (layer + "ln_1.weight", ("ln1/scale",), same),
        (layer + "ln_1.bias", ("ln1/bias",), same),
        (layer + "attn.c_attn.weight", ("wq", "wk", "wv"),                # [D, 3*H*K]
         concat(((d, h, k),) * 3, ((d, h * k),) * 3)),
        (layer + "attn.c_attn.bias", ("bq", "bk", "bv"),                  # [3*H*K]
         concat(((h, k),) * 3, ((h * k,),) * 3)),
        (layer + "attn.c_proj.weight", ("wo",), concat(((h, k, d),), ((h * k, d),))),  # [H*K, D]
        (layer + "attn.c_proj.bias", ("bo",), same),
        (layer + "ln_2.weight", ("ln2/scale",), same),
        (layer + "ln_2.bias", ("ln2/bias",), same),
        (layer + "mlp.c_fc.weight", ("w_fc",), same),                     # [D, F]
        (layer + "mlp.c_fc.bias", ("b_fc",), same),
        (layer + "mlp.c_proj.weight", ("w_proj",), same),                 # [F, D]
        (layer + "mlp.c_proj.bias", ("b_proj",), same),
        ("transformer.ln_f.weight", ("ln_f/scale",), same),
        ("transformer.ln_f.bias", ("ln_f/bias",), same),
    ]


SPEC = Family("gpt2", GPTConfig, GPT,
              {CAUSAL_LM: "GPT2LMHeadModel", SEQUENCE_CLASSIFICATION: "GPT2ForSequenceClassification"},
              from_hf, to_hf, tensor_map,
              {"gpt-tiny": GPTConfig.tiny, "gpt-small": GPTConfig.small,
               "gpt2-124m": GPTConfig.gpt2_124m, "gpt2-350m": GPTConfig.gpt2_350m})
