"""Helpers of the inference tests: a few ZeRO-3 training steps of a small model, and the independent greedy
reference (the unsharded `gathered_model`, a full forward per token, no KV cache)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla.models import GPT, GPTConfig, Llama, LlamaConfig

MODELS = {
    # init_std 0.2: logits far apart enough that greedy continuations vary
    "gpt-tiny": lambda: GPT(GPTConfig.tiny().replace(init_std=0.2), rngs=nnx.Rngs(0)),
    "llama-tiny": lambda: Llama(LlamaConfig.tiny().replace(init_std=0.2), rngs=nnx.Rngs(1)),
    # 8 query heads, 4 KV heads: tp 4 splits both; tp 8 replicates each KV head twice
    "llama-small": lambda: Llama(LlamaConfig.small().replace(init_std=0.1), rngs=nnx.Rngs(2)),
    # every dim tensor parallelism splits (8 heads, mlp 256, a tied vocabulary of 72) divisible
    # by 8 devices: the reshard's byte floor is reachable for tp 1, 2, 4 and 8
    "gpt-8heads": lambda: GPT(GPTConfig(vocab_size=72, max_seq_len=16, d_model=64, num_heads=8,
                                        num_layers=2, mlp_dim=256, init_std=0.2),
                              rngs=nnx.Rngs(3)),
}
PROMPT_LENGTHS = (1, 3, 5, 7)


def batches(seed, count=3, rows=8, length=17):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        t = jnp.asarray(rng.integers(0, 65, (rows, length)), jnp.int32)
        yield {"inputs": t[:, :-1], "targets": t[:, 1:]}


@functools.cache
def zero3_step(name, persistence_threshold=0):
    """The ZeRO-3 step of model `name` on a 2 x 4 mesh (compiled once per session)."""
    return zeroxla.make_step(MODELS[name](), zeroxla.make_mesh(2, 4),
                             optimizer=optax.adam(3e-3),
                             # threshold 0: every leaf partitioned, as a large model is
                             config=zeroxla.ZeroConfig(stage=3,
                                                       persistence_threshold=persistence_threshold))


def train(step, steps, seed=0):
    """A fresh state of `step` after `steps` optimizer steps."""
    state = step.init()
    for batch in batches(seed, steps):
        state, _ = step(state, batch)
    return state


def prompts_of(lengths=PROMPT_LENGTHS, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 65, n).astype(np.int32) for n in lengths]


def greedy_reference(state_or_model, prompts, max_new_tokens):
    """Greedy continuations by the unsharded model (`gathered_model` of a state, or a model):
    every step runs the full forward over the whole right-padded sequence (causal, so padding
    after a row's end is never seen)."""
    model = (state_or_model if isinstance(state_or_model, nnx.Module)
             else zeroxla.gathered_model(state_or_model))
    total = max(p.size for p in prompts) + max_new_tokens
    seqs = np.zeros((len(prompts), total), np.int32)
    lengths = np.array([p.size for p in prompts])
    for i, p in enumerate(prompts):
        seqs[i, :p.size] = p
    forward = nnx.jit(lambda m, t: m(t))
    for _ in range(max_new_tokens):
        logits = np.asarray(forward(model, jnp.asarray(seqs)))             # [B, T, V]
        seqs[np.arange(len(prompts)), lengths] = logits[np.arange(len(prompts)),
                                                        lengths - 1].argmax(-1)
        lengths = lengths + 1
    return [seqs[i, :p.size + max_new_tokens] for i, p in enumerate(prompts)]
