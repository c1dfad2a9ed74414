"""Flax NNX decoder-only language models. They name logical axes and know nothing of meshes.

- `axes.py`: the logical axis names; `layers.py`: shared building blocks (norms, attention,
  the `LayerStack`); `rope.py`: RoPE, its frequencies plain and scaled; `config.py`: what
  every model config shares (sizes, the length rule, the attention and tiled-MLP options).
- `online_softmax.py`: the online softmax, once: a block step (running max, denominator,
  unnormalised output), the finish (output, log-sum-exp) and the merge of two partial results
  by their log-sum-exps; the cached, blockwise, paged and ring attention all call it.
- `blockwise_attention.py`: memory-linear causal attention (FlashAttention-2's blocks and
  backward in plain JAX, with segment ids for packed sequences); equals `layers.causal_attention`.
- `attention.py`: the one attention every family calls (`ModelConfig.attention`): naive,
  blockwise, cuDNN's fused attention or the Pallas flash kernel, "auto" choosing per platform,
  refusals by name; and the KV-cached decode (the cache read block by block,
  `layers.cached_attention`).
- `pallas_attention.py`: jax's Pallas (Triton) flash attention kernel behind our contract (GQA,
  padding rows zeroed, refusals by name): the GPU's route for packed rows.
- `paged_attention.py`: attention against a paged KV cache (`PagedKV`: page pools, each token
  its sequence's page table; vLLM's PagedAttention), what a continuous-batching engine decodes
  with through the same `cached_attention`.
- `recurrent_slots.py`: a recurrent layer's per-sequence state under continuous batching
  (`RecurrentSlots`, carried in `PagedKV.recurrent`): pools of slots beside the pages, each
  step's places run through their slots in each sequence's position order (`scan_places`).
- `kv_groups.py`: one KV cache for layers of different key-value shapes (Gemma 4's global
  layer): the cache's head groups (the gcd of the layers' KV heads) each hold a contiguous run
  of a layer's heads side by side, so tensor parallelism splits every layer's heads as it
  splits its weights; the dense and paged caches read and write it.
- `sequence_parallel.py`: DeepSpeed-Ulysses (`SequenceParallel`, the all-to-alls that swap a
  sequence split for a head split around attention, KV heads repeated as DeepSpeed does) and
  all-gather context parallelism (the zigzag split).
- `ring_attention.py`: ring attention, the keys and values passed around the sequence devices
  (forward and a custom backward), 1/P of them held.
- `usp_attention.py`: USP, Ulysses' all-to-alls inside groups of consecutive sequence devices
  (as far as the heads divide) and a ring across the groups.
- `tiled_mlp.py`: a block's MLP over chunks of the sequence (ALST's TiledMLP,
  `ModelConfig.mlp_chunk`), its [B, T, F] intermediate one chunk at a time.
- `invariant.py`: the batch-invariant mode's kernels (`LlamaConfig.batch_invariant`): matmul,
  RMSNorm, log-softmax and attention with every sum a chain of adds in a fixed order, so a
  row's bits do not depend on the row count, the chunking or the cache length;
  `invariant_attention.py`: its causal and KV-cached attention; `invariant_moe.py`: its MoE
  MLP (the router's softmax and top-k weights, every expert on every token, the k outputs and
  a shared expert's combined in order).
- `chunked_logits.py`: the head's log-probs and entropies per chunk of the sequence in a scan
  (fused linear + cross-entropy), its [B, T, V] logits never whole; each family's
  `token_logprobs(tokens, labels)` runs it.
- `moe.py`: the Mixture-of-Experts MLP (float32 top-k router, router statistics of the
  auxiliary loss); `grouped_matmul.py`: its dropless expert compute over tiles of expert-sorted
  tokens (custom VJP), `ragged_dot` where native; `expert_parallel.py`: the layer's experts
  split over the mesh's expert axis (tokens all-gathered, outputs reduce-scattered);
  `moe_llama.py`: Llama with MoE blocks, the module of the MoE families; `gpt_oss.py`:
  gpt-oss, (sliding, full) pairs of MoE layers with attention sinks, a biased router and
  clamped SwiGLU experts with biases; `mxfp4.py`: the MXFP4 (OCP microscaling FP4) decode of
  its released experts, exact.
- `gated_delta.py`: the gated delta rule (Gated DeltaNet's token mixer, Qwen3.5's linear
  attention) as pure functions: the recurrent form (decode) and the chunked WY / UT-transform
  form (training, prefill), a scan over chunks with each chunk rematerialised, memory-linear in
  T; float32 state, packed segments reset the state.
- `gated_deltanet.py`: Gated DeltaNet's token mixer as a layer (projections, the causal
  depthwise conv1d whose window restarts at segment starts, the gated output norm) around
  `gated_delta`.
- `gpt.py` (GPT-2), `llama.py` (Llama and the Llama-plus-options families), `gemma2.py`
  (Gemma 2), `gemma3.py` (Gemma 3 text: Gemma 2's layers with q/k norms, a period of sliding
  layers and a global one as one block, a RoPE base each; a trailing partial period's sliding
  layers as a stack of their own), `gemma4.py` (Gemma 4 text:
  Gemma 3's period with a global layer of its own head dim, proportional RoPE and k = v; its
  MoE block beside the dense MLP in `gemma4_moe.py`), `qwen3_5.py` (Qwen3.5 dense:
  periods of DeltaNet layers and a gated attention layer as one block), `qwen3_5_moe.py`
  (Qwen3.5 MoE: the same periods, every layer's MLP an MoE with a shared expert): the modules.
- `families/`: one module per family (config mapping, tensor map, module), in one table
  (`families.REGISTRY`; docs/models.md).
- `hf.py`, `hf_config.py`, `hf_rules.py`, `hf_names.py`, `safetensors_io.py`: Hugging Face
  names, configs, checkpoints' name fallbacks and files.
- `presets.py`: real shapes (Llama 3.x, Qwen2.5, Qwen3, gpt-oss-20b, Qwen3.5) as their config.json
  gives them, for the planner (`zeroxla plan`).
"""

from .gpt import GPT, GPTConfig
from .layers import LayerStack, scan_layers
from .llama import Llama, LlamaConfig
from .families import (REGISTRY, Gemma2Config, Gemma3Config, Gemma4Config, GptOssConfig,
                       MistralConfig,
                       MixtralConfig, OlmoeConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                       Qwen3MoeConfig, Qwen3_5Config, Qwen3_5MoeConfig)
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .gemma4 import Gemma4
from .gpt_oss import GptOss
from .qwen3_5 import Qwen3_5
from .qwen3_5_moe import Qwen3_5Moe

# preset name -> (model class, config factory), from the families' presets.
PRESETS = {name: (spec.model_class, preset) for spec in REGISTRY.values()
           for name, preset in spec.presets.items()}


# config.family -> (model class, config class): how a stored or loaded config becomes a model
# (from the one family table, `families.REGISTRY`).
FAMILIES = {name: (spec.model_class, spec.config_class) for name, spec in REGISTRY.items()}


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


__all__ = ["FAMILIES", "GPT", "GPTConfig", "Gemma2", "Gemma2Config", "Gemma3", "Gemma3Config",
           "Gemma4", "Gemma4Config",
           "GptOss", "GptOssConfig", "MistralConfig", "MixtralConfig", "OlmoeConfig", "Qwen2MoeConfig", "Qwen3MoeConfig",
           "Qwen2Config",
           "Qwen3Config", "Qwen3_5", "Qwen3_5Config", "Qwen3_5Moe", "Qwen3_5MoeConfig", "REGISTRY", "abstract_model", "model_class", "Llama", "LlamaConfig", "LayerStack", "PRESETS", "build", "scan_layers"]
