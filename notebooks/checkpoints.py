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
# # Checkpoints: save on 8 devices, restore on 4, load the weights, export to Hugging Face
#
# A zeroxla checkpoint stores every array in its *logical* form: each parameter and optimizer
# moment at its model shape, without the ZeRO padding and whatever the mesh. So a run saved on
# 8 devices at ZeRO-3 restores onto 4 devices at ZeRO-2 (or any other mesh and stage), the
# weights load without the optimizer, and the model exports to the safetensors files
# `transformers` reads. Saves are sharded (each device writes its part), checksummed and
# crash-safe: a step directory counts only once its commit marker is written.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for a 2-node x 4-device mesh.
import os

from zeroxla.app.launch import set_host_threads   # starts no JAX backend

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
set_host_threads(os.environ, 8)   # the CPU threads 8 devices need on a machine with few cores
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib
import tempfile

import jax
import numpy as np
import optax

from zeroxla import models
import zeroxla
from zeroxla.app import data
from zeroxla.app.tokenizers.pretrained import save_hf_tokenizer

corpus = data.load_corpus()
plan = data.BatchPlan(len(corpus.train), batch_size=32, seq_len=64, seed=0)
workdir = pathlib.Path(tempfile.mkdtemp(prefix="zeroxla-checkpoints-"))


def train(step, state, first, last):
    """Steps `first` .. `last - 1` of the run, each on its own batch; returns state, losses."""
    losses = []
    for k in range(first, last):
        state, metrics = step(state, data.device_batch(corpus.train, plan, k,
                                                       step.layout.batch_sharding))
        losses.append(float(metrics["loss"]))
    return state, losses


# %% [markdown]
# ## Train on 8 devices and save
#
# Twenty steps of the tiny GPT at ZeRO-3 over 2 nodes x 4 devices, then `zeroxla.save`. The
# model's config dataclass is recorded with the arrays, so later readers can rebuild the model
# without this notebook's code.

# %%
mesh8 = zeroxla.make_mesh(nodes=2, local=4)
optimizer = optax.adamw(3e-3)
step8 = zeroxla.make_step(lambda: models.build("gpt-tiny", seed=0), mesh8, optimizer=optimizer,
                          config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500))
state8, losses = train(step8, step8.init(), 0, 20)
print(f"8 devices, ZeRO-3: loss {losses[0]:.3f} -> {losses[-1]:.3f} in 20 steps")

checkpoint_dir = workdir / "checkpoint"
path = zeroxla.save(checkpoint_dir, state8, layout=step8.layout)
print(f"saved {path}: {sorted(p.name for p in path.iterdir())}")
tokens = np.asarray(corpus.tokenizer.encode("ROMEO:\nWhat light through yonder window?"),
                    np.int32)[None]                                    # [1, T]
saved_logits = np.asarray(zeroxla.gathered_model(state8)(tokens))     # [1, T, V]

# %% [markdown]
# ## Restore onto 4 devices at ZeRO-2, and continue
#
# The same checkpoint restores into a step on another mesh and stage: here the first 4 devices,
# ZeRO-2 (parameters replicated, gradients and optimizer state partitioned). Both continue the
# run for ten more steps on the same batches; the losses agree up to float32 summation order
# (the 8-device and the 4-device programs add the gradient contributions in different orders).

# %%
state8, continued8 = train(step8, state8, 20, 30)

mesh4 = zeroxla.make_mesh(nodes=1, local=4, devices=jax.devices()[:4])
step4 = zeroxla.make_step(lambda: models.build("gpt-tiny", seed=0), mesh4, optimizer=optimizer,
                          config=zeroxla.ZeroConfig(stage=2))
restored = zeroxla.restore(checkpoint_dir, step4)
print(f"restored checkpoint step {restored.checkpoint_step} onto {mesh4.devices.size} devices, "
      f"ZeRO stage {restored.zero_config.stage}")
state4, continued4 = train(step4, restored.state, 20, 30)

print(f"{'step':>4}{'8 devices':>11}{'4 devices':>11}")
for k in (0, 5, 9):
    print(f"{20 + k:>4}{continued8[k]:>11.5f}{continued4[k]:>11.5f}")
np.testing.assert_allclose(continued4, continued8, rtol=1e-4)

# %% [markdown]
# ## Weights only: `zeroxla.load_params`
#
# For evaluation or generation the optimizer state is dead weight. `load_params` reads only
# the parameters (as numpy, checksums verified) into the model its recorded config describes,
# on one device; no optimizer, no mesh. Its logits are those of the state that was saved.

# %%
model = zeroxla.load_params(checkpoint_dir)
np.testing.assert_array_equal(np.asarray(model(tokens)), saved_logits)
print(f"{type(model).__name__} with {sum(x.size for x in jax.tree.leaves(model)):,} parameters; "
      "logits equal the saved state's")

# %% [markdown]
# ## Export to Hugging Face and generate with `transformers`
#
# `export_checkpoint` streams the parameters into `model.safetensors` with GPT-2's names and
# writes its `config.json`; `save_hf_tokenizer` writes the character vocabulary as a
# `tokenizers` JSON. `transformers` then loads both like any Hub model.

# %%
import torch
import transformers

hf_dir = workdir / "hf"
files = zeroxla.export_checkpoint(checkpoint_dir, hf_dir)
save_hf_tokenizer(corpus.tokenizer, hf_dir, model_max_length=model.config.max_seq_len)
print(sorted(p.name for p in hf_dir.iterdir()))

hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
prompt = "ROMEO:\nWhat light through yonder window?"
ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
assert ids[0].tolist() == tokens[0].tolist()                          # the same vocabulary
with torch.no_grad():
    hf_logits = hf_model(ids).logits.numpy()
np.testing.assert_allclose(hf_logits, saved_logits, atol=1e-4)
with torch.no_grad():
    generated = hf_model.generate(ids, max_new_tokens=80, do_sample=False)
print(hf_tokenizer.decode(generated[0]))
