# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Hybrid Engine: generating from a ZeRO-3 training state
#
# RLHF alternates training with generation: PPO samples answers from the policy it is training
# (the rollout), scores them, and takes optimizer steps on them. Under ZeRO-3 every parameter is
# partitioned over the data devices, so generating naively means re-gathering every layer for
# every new token, the whole model's bytes per token. DeepSpeed-Chat's **Hybrid Engine** avoids
# this: before a rollout it regroups the ZeRO-3 partitions once into a tensor-parallel
# (Megatron) layout, generates with a KV cache from that copy, and frees it before training
# resumes.
#
# `zeroxla.HybridEngine` does the same for any model whose parameters name their logical axes:
# one compiled **reshard** program takes the training state's partitions to a layout chosen by
# the logical-axis rules (`heads`, `kv_heads`, `mlp`, `vocab` split over a `tensor` axis), then
# one compiled decode program runs prefill and a `lax.while_loop` over new tokens with the KV
# cache. This notebook trains a tiny GPT for a few ZeRO-3 steps, reshards it, generates, checks
# the tokens against the unsharded model, samples, and measures the engine against ZeRO-3
# re-gather generation.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for a 2-node x 4-device mesh.
import os

from zeroxla.app.launch import set_host_threads   # starts no JAX backend

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
set_host_threads(os.environ, 8)   # the CPU threads 8 devices need on a machine with few cores
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time

import jax
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.app import data
from zeroxla.inference.baseline import Zero3Generator

print(jax.devices())

# %% [markdown]
# ## A few ZeRO-3 steps on tiny-shakespeare
#
# The tiny GPT (2 layers, d_model 60, 4 heads, 65 characters) on 2 nodes x 4 devices, every
# parameter partitioned (persistence threshold 0, as a large model would be).

# %%
corpus = data.load_corpus()
tokenizer = corpus.tokenizer
mesh = zeroxla.make_mesh(nodes=2, local=4)
step = zeroxla.make_step(lambda: models.build("gpt-tiny"), mesh, optimizer=optax.adamw(1e-2),
                         config=zeroxla.ZeroConfig(stage=3, persistence_threshold=0))
plan = data.BatchPlan(len(corpus.train), batch_size=32, seq_len=64, seed=0)
state = step.init()
for k in range(40):
    state, metrics = step(state, data.device_batch(corpus.train, plan, k,
                                                   step.layout.batch_sharding))
    if k % 10 == 9:
        print(f"step {k + 1}: loss {float(metrics['loss']):.3f}")

# %% [markdown]
# ## The engine and its reshard
#
# `HybridEngineConfig` carries DeepSpeed's `hybrid_engine` keys: `inference_tp_size` (the
# tensor-parallel degree of generation; the other 8 / tp ways split the prompts) and
# `max_out_tokens` (prompt + generated tokens, the KV cache's length). `batching="static"` keeps
# the padded batch's decode loop, the one the re-gather baseline below runs too (by default the
# engine batches continuously over a paged KV cache: docs/hybrid_engine.md). The layout lists
# each parameter's inference shape and spec: attention heads and MLP columns over `tensor`.

# %%
MAX_OUT = 64                                 # longest prompt (28) + 32 new tokens fit
engine = zeroxla.HybridEngine(step.layout, zeroxla.HybridEngineConfig(inference_tp_size=2,
                                                                      max_out_tokens=MAX_OUT,
                                                                      batching="static"))
print(engine.layout.describe())

# %% [markdown]
# The reshard is one program (`zeroxla/inference/reshard.py`). ZeRO storage splits each weight
# along the dim tensor parallelism splits (where the 8 devices divide it), and the inference mesh is
# tensor-major, so each device's ZeRO partition already lies inside the slice it will hold: per
# leaf one `all_gather` within the tensor group's data row brings the rest, 4Ψ/T·(1 − T/N) float32
# bytes per device, the floor (verl's 3D-HybridEngine bound). A leaf whose tensor dim the devices
# do not divide takes an `all_to_all`, and one tensor parallelism replicates is gathered whole
# (`reshard_account` lists each leaf's route and why). No device ever assembles the whole model.
# `comm_report` reads the bytes from the compiled program; the training state is only read (never
# donated), so training continues from it unchanged.

# %%
reshard = engine.reshard_program(state)
report = zeroxla.comm_report(reshard, mesh=engine.mesh)
model_bytes = sum(x.size * 4 for x in jax.tree.leaves(zeroxla.gather_params(state)))
print(report.table())
print(f"reshard: {report.total_bytes / 1024:.1f} KiB per device, {report.total_bytes / model_bytes:.2f}"
      f" of the {model_bytes / 1024:.1f} KiB float32 model (tp=2: a device keeps about half)")

# %% [markdown]
# ## Greedy generation, checked against the unsharded model
#
# Prompts of different lengths go in one batch (a list of 1-D int arrays; the engine pads and
# buckets them). The reference is independent of the engine: the whole trained model
# (`step.gathered_model(state)`, on one device) runs a full forward over the sequence for every
# new token, no cache, and takes the argmax.

# %%
NEW = 32
texts = ["ROMEO:\n", "First Citizen:\nWe", "O", "KING RICHARD III:\nNow is the"]
prompts = [tokenizer.encode(t) for t in texts]
outs = engine.generate(state, prompts, max_new_tokens=NEW, temperature=0.0)
for out in outs:
    print(repr(tokenizer.decode(out)))


def greedy_without_cache(model, prompt, new_tokens):
    """A full forward over a fixed-length buffer per new token (one compile; causal, so the
    zero padding after the last real token is never seen)."""
    forward = nnx.jit(lambda m, t: m(t))
    seq = np.zeros((1, MAX_OUT), np.int32)
    seq[0, :len(prompt)] = prompt
    for pos in range(len(prompt), len(prompt) + new_tokens):
        seq[0, pos] = int(np.asarray(forward(model, seq))[0, pos - 1].argmax())
    return seq[0, :len(prompt) + new_tokens]


reference_model = step.gathered_model(state)
for prompt, out in zip(prompts, outs):
    np.testing.assert_array_equal(out, greedy_without_cache(reference_model, prompt, NEW))
print("greedy tokens equal the unsharded model's, every prompt")

# %% [markdown]
# ## Sampling
#
# `temperature` > 0 draws from the softmax of logits / temperature; `top_k` keeps the k most
# likely tokens, `top_p` the smallest set whose probability reaches p (nucleus sampling). `seed`
# fixes every draw, so a rollout can be reproduced.

# %%
for kwargs in ({"temperature": 0.8}, {"temperature": 0.8, "top_k": 5},
               {"temperature": 1.0, "top_p": 0.9}):
    out = engine.generate(state, prompts[:1], max_new_tokens=NEW, seed=0, **kwargs)[0]
    print(f"{str(kwargs):<36} {tokenizer.decode(out)!r}")
first, second = (engine.generate(state, prompts[:1], max_new_tokens=NEW, seed=0,
                                 temperature=0.8)[0] for _ in range(2))
assert np.array_equal(first, second), "the same seed draws the same tokens"

# %% [markdown]
# ## Tokens per second against ZeRO-3 re-gather generation
#
# The baseline, `Zero3Generator`, is what generation costs without the Hybrid Engine: the same
# KV cache and decode loop, but the parameters stay partitioned and every layer is gathered again
# at every token. Both generate the same batch greedily (the first call compiles; then the best
# of two timed calls). Bytes per token come from each compiled one-token decode step. On this
# shared 2-core CPU, collectives are memory copies and times vary with the load; the bytes are
# properties of the programs.

# %%
baseline = Zero3Generator(step.layout, max_out_tokens=MAX_OUT)


def tokens_per_s(generator):
    out = generator.generate(state, prompts, max_new_tokens=NEW)          # compile
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        generator.generate(state, prompts, max_new_tokens=NEW)
        seconds.append(time.perf_counter() - start)
    return len(prompts) * NEW / min(seconds), out


for name, generator, gen_mesh in (("zero3 re-gather", baseline, step.layout.mesh),
                                  ("hybrid engine tp=2", engine, engine.mesh)):
    rate, out = tokens_per_s(generator)
    for a, b in zip(out, outs):
        np.testing.assert_array_equal(a, b)
    per_token = zeroxla.comm_report(generator.token_program(state, 8),
                                    mesh=gen_mesh).total_bytes
    print(f"{name:<20} {rate:8.1f} tokens/s   {per_token / 1024:8.1f} KiB sent per device "
          f"per token")

# %% [markdown]
# ## Release, then train on
#
# The inference copy stays pinned until the next optimizer step makes new parameters (or
# `engine.release()`), so several `generate` calls between two steps reshard once.
# `release()` frees the copy and the KV caches; the compiled programs stay, so the next rollout
# only reshards.

# %%
print("reshards so far:", engine.reshards)
engine.release()
state, metrics = step(state, data.device_batch(corpus.train, plan, 40,
                                               step.layout.batch_sharding))
engine.generate(state, prompts[:1], max_new_tokens=4)
print("after a training step, reshards:", engine.reshards)
engine.release()

# %% [markdown]
# `notebooks/rlhf.ipynb` uses the engine for what it is for: PPO, with the Hybrid Engine
# generating the rollouts between ZeRO-3 training steps and the reward curve it produces.
