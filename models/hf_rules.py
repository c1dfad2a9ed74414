"""The Hugging Face name map's tables, one per family: each HF tensor, the parameter path(s) of
ours it is made of, and the two reshapes between them (`models.hf` resolves them into `Rule`s).

A row is `(hf name, our paths, (to_hf, from_hf))`; an HF name holding `{i}` is per layer. Our
paths are relative: a per-layer one names the stacked `[L, ...]` leaf ending with it.

Conventions, checked against transformers 5.23.0 (`models/gpt2/modeling_gpt2.py`,
`models/llama/modeling_llama.py`, `pytorch_utils.py`; tests/models/test_hf.py also passes on 4.57):
- GPT-2 projections are `Conv1D`, weight stored `[in, out]` (x @ W + b), so ours map with no
  transpose; `c_attn` fuses q|k|v along `out`, each `[D, H*K]` with head-major columns.
- Llama projections are `nn.Linear`, weight stored `[out, in]`: ours are transposed.
- Llama RoPE: HF's checkpoints are already in the rotate-half layout (`rotate_half`), which is the
  one `models.layers.rope` uses, so q/k need no row permutation.
- GPT-2's `lm_head.weight` is tied to `wte` and absent from its checkpoints.
- A `*ForSequenceClassification` (`GenericForSequenceClassification`, GPT-2's own class) holds the
  same base tensors under the same names, no `lm_head.weight`, and `score.weight`
  [num_labels, D], an `nn.Linear` without bias: with one label, a reward model's `v_head` [D].
"""

from __future__ import annotations

import math

import numpy as np

from .gpt import GPTConfig
from .llama import LlamaConfig


def as_is(a: np.ndarray) -> np.ndarray:
    """The identity: the HF tensor is ours as it is (`as_is_inv` is its inverse)."""
    return a


def as_is_inv(a: np.ndarray) -> tuple[np.ndarray, ...]:
    return (a,)


def _concat(shapes: tuple[tuple[int, ...], ...], hf_shapes: tuple[tuple[int, ...], ...]):
    """Our arrays, each reshaped to its `hf_shapes` entry, concatenated on the last dim.

    GPT-2's Conv1D weights are [in, out] with `out` flattened head-major; c_attn fuses q|k|v.
    """
    cuts = np.cumsum([s[-1] for s in hf_shapes])[:-1]

    def to_hf(*ours):
        parts = [a.reshape(s) for a, s in zip(ours, hf_shapes)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    def from_hf(t):
        return tuple(p.reshape(s) for p, s in zip(np.split(t, cuts, axis=-1), shapes))

    return to_hf, from_hf


def _linear(shape: tuple[int, ...], split: int):
    """Our weight [in..., out...] (in = dims [:split]) <-> nn.Linear's [out, in]."""
    rows, cols = math.prod(shape[:split]), math.prod(shape[split:])

    def to_hf(w):
        return w.reshape(rows, cols).T

    def from_hf(t):
        return (t.T.reshape(shape),)

    return to_hf, from_hf


LM_HEAD = "lm_head.weight"     # a causal LM's output projection (Llama's; GPT-2's is tied)
SCORE = "score.weight"         # a sequence classifier's head, nn.Linear(D, num_labels, bias=False)


def score_fns(d: int):
    """Our score vector [D] <-> `score.weight` [1, D] (one label); another shape is refused."""

    def to_hf(v):
        return v.reshape(1, d)

    def from_hf(t):
        if t.shape != (1, d):
            raise ValueError(f"{SCORE} must be [1, {d}] (num_labels=1), not {list(t.shape)}")
        return (t.reshape(d),)

    return to_hf, from_hf


def gpt2_rules(c: GPTConfig) -> list[tuple[str, tuple[str, ...], tuple]]:
    d, h, k = c.d_model, c.num_heads, c.head_dim
    same = (as_is, as_is_inv)
    layer = "transformer.h.{i}."
    return [
        ("transformer.wte.weight", ("embed/wte",), same),                 # [V, D]
        ("transformer.wpe.weight", ("embed/wpe",), same),                 # [P, D]
        (layer + "ln_1.weight", ("ln1/scale",), same),
        (layer + "ln_1.bias", ("ln1/bias",), same),
        (layer + "attn.c_attn.weight", ("wq", "wk", "wv"),                # [D, 3*H*K]
         _concat(((d, h, k),) * 3, ((d, h * k),) * 3)),
        (layer + "attn.c_attn.bias", ("bq", "bk", "bv"),                  # [3*H*K]
         _concat(((h, k),) * 3, ((h * k,),) * 3)),
        (layer + "attn.c_proj.weight", ("wo",), _concat(((h, k, d),), ((h * k, d),))),  # [H*K, D]
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


def llama_rules(c: LlamaConfig) -> list[tuple[str, tuple[str, ...], tuple]]:
    d, h, g, k, f, v = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.vocab_size
    same = (as_is, as_is_inv)
    layer = "model.layers.{i}."
    return [
        ("model.embed_tokens.weight", ("embed/weight",), same),           # [V, D]
        (layer + "input_layernorm.weight", ("attn_norm/scale",), same),
        (layer + "self_attn.q_proj.weight", ("wq",), _linear((d, h, k), 1)),   # [H*K, D]
        (layer + "self_attn.k_proj.weight", ("wk",), _linear((d, g, k), 1)),   # [G*K, D]
        (layer + "self_attn.v_proj.weight", ("wv",), _linear((d, g, k), 1)),   # [G*K, D]
        (layer + "self_attn.o_proj.weight", ("wo",), _linear((h, k, d), 2)),   # [D, H*K]
        (layer + "post_attention_layernorm.weight", ("mlp_norm/scale",), same),
        (layer + "mlp.gate_proj.weight", ("w_gate",), _linear((d, f), 1)),     # [F, D]
        (layer + "mlp.up_proj.weight", ("w_up",), _linear((d, f), 1)),         # [F, D]
        (layer + "mlp.down_proj.weight", ("w_down",), _linear((f, d), 1)),     # [D, F]
        ("model.norm.weight", ("head/norm/scale",), same),
        (LM_HEAD, ("head/weight",), _linear((d, v), 1)),                       # [V, D]
    ]


__all__ = ["LM_HEAD", "SCORE", "as_is", "as_is_inv", "gpt2_rules", "llama_rules", "score_fns"]
