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
# # zeroxla quickstart: ZeRO-3 on 8 simulated devices
#
# ZeRO (Rajbhandari et al. 2020) removes the redundancy of data parallelism: instead of every
# device holding the full parameters, gradients and optimizer state, each of the N data-parallel
# devices stores 1/N of them. ZeRO-3 partitions all three. This notebook trains a tiny GPT with
# ZeRO-3 on a simulated 2-node x 4-device cluster, shows where every parameter lives, how much
# memory and communication that costs, and samples text from the result.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for a 2-node x 4-device mesh.
import os

from zeroxla.app.launch import set_host_threads   # starts no JAX backend

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
set_host_threads(os.environ, 8)   # the CPU threads 8 devices need on a machine with few cores
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import matplotlib.pyplot as plt
import optax

from zeroxla import models
import zeroxla
from zeroxla.app import data
from zeroxla.app.sampling import sample_text

print(jax.devices())

# %% [markdown]
# ## The mesh
#
# zeroxla's mesh has two axes: `node` (devices connected by the slow network) and `local` (the
# devices inside one node, on fast links). Plain ZeRO uses them together as one data-parallel
# axis of 8 devices; ZeRO++ (see `zeropp.ipynb`) exploits the split.

# %%
mesh = zeroxla.make_mesh(nodes=2, local=4)
mesh

# %% [markdown]
# ## Model, step and sharding plan
#
# `models.build("gpt-tiny")` is an ordinary Flax NNX model (2 layers, d_model 60, 65-character
# vocabulary); it names logical axes but knows nothing of meshes. `make_step` decides, for every
# parameter, its **storage** layout (flat, padded and split into 8 partitions, or replicated) and
# its **compute** layout (the whole tensor, assembled only while a layer runs). The difference
# between the two *is* ZeRO-3, and `plan.describe()` prints it.
#
# Parameters with fewer elements than the persistence threshold stay replicated: gathering a
# 60-element LayerNorm scale costs more in latency than it saves in memory. DeepSpeed's default of
# 100,000 elements is sized for real models and would replicate all of this tiny one, so we
# lower it to 500.

# %%
model = models.build("gpt-tiny")
config = zeroxla.ZeroConfig(stage=3, persistence_threshold=500)
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=10, decay_steps=100,
                                              end_value=3e-4)
step = zeroxla.make_step(model, mesh, optimizer=optax.adamw(schedule), config=config)
print(step.layout.plan.describe())

# %% [markdown]
# ## What one ZeRO-3 step does
#
# The whole step is one compiled `shard_map` over the 8 devices; every collective in it is
# explicit.
#
# - **Gather before use.** Just before a layer runs, each device `all_gather`s the layer's
#   partitions into the full weights. With prefetch on, the gather for layer i+1 is issued
#   before layer i computes, so XLA can overlap communication with compute.
# - **Release.** After the layer's forward, the gathered weights are dropped; only the
#   activations are kept. At most a layer or two of full weights is alive at any moment.
# - **Re-gather in backward.** The backward pass needs the weights again, so it gathers them a
#   second time (instead of keeping them from the forward: that would undo the memory saving).
# - **`psum_scatter` the gradients.** Each layer's full gradient is reduce-scattered: summed over
#   the 8 devices, and each device keeps only the slice matching its own partition. The
#   optimizer then updates that slice in place; the parameters never exist whole between steps.
#
# ## Training on tiny-shakespeare
#
# `zeroxla.data` loads the bundled corpus with a character tokenizer (65 symbols) and cuts it into
# windows; `device_batch` places global batch k on the mesh, split over the 8 devices.

# %%
corpus = data.load_corpus()
print(f"{corpus.source}: {len(corpus.train):,} training characters, vocabulary "
      f"{corpus.vocab_size}")
batches = data.BatchPlan(len(corpus.train), batch_size=32, seq_len=64, seed=0)

state = step.init()
losses = []
for k in range(100):
    batch = data.device_batch(corpus.train, batches, k, step.layout.batch_sharding)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    if k % 20 == 0 or k == 99:
        print(f"step {k:3d}  loss {losses[-1]:.3f}  grad norm {float(metrics['grad_norm']):.2f}")

val_batches = data.BatchPlan(len(corpus.val), batch_size=64, seq_len=64, seed=0)
val_loss = float(step.eval_loss(state, data.device_batch(corpus.val, val_batches, 0,
                                                         step.layout.batch_sharding)))
print(f"validation loss {val_loss:.3f}")
assert losses[-1] < losses[0] - 1.0, "the loss should fall by more than 1 nat in 100 steps"

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(losses)
ax.set_xlabel("step")
ax.set_ylabel("training loss (nats / char)")
ax.set_title("gpt-tiny, ZeRO-3 on 2 x 4 devices")
plt.show()

# %% [markdown]
# ## Memory per device, stages 0-3
#
# With AdamW and float32 master weights, a parameter costs 4 bytes of weight and 8 bytes of
# optimizer state (two moments) between steps, plus 4 bytes of gradient during the step. Stage 1
# partitions the optimizer state over the N = 8 devices, stage 2 also the gradients (so the state
# between steps is the same as stage 1), stage 3 also the weights: 12 bytes per parameter
# become 12/8, except the weights of the small persistent leaves, which every device keeps.
#
# `estimate_memory` predicts this from the model config alone, before anything is allocated;
# `memory_report` measures the shards each device really holds (and reads XLA's own accounting of
# the compiled step).

# %%
print(f"{'stage':<6}{'estimated':>13}{'measured':>13}{'XLA step peak':>16}   (per device)")
for stage in range(4):
    stage_config = config.replace(stage=stage)
    estimate = zeroxla.estimate_memory(model.config, mesh, stage_config)
    if stage == 3:
        stage_step, stage_state = step, state
    else:
        stage_step = zeroxla.make_step(model, mesh, optimizer=optax.adamw(schedule),
                                       config=stage_config)
        stage_state = stage_step.init()
    measured = zeroxla.memory_report(stage_step.compile(stage_state, batch), stage_state,
                                     layout=stage_step.layout)
    print(f"{stage:<6}{estimate.training_state / 2**10:>9.1f} KiB"
          f"{measured.training_state / 2**10:>9.1f} KiB{measured.peak_estimate / 2**10:>12.1f} KiB")
    assert abs(measured.training_state - estimate.training_state) < 0.01 * estimate.training_state

# %% [markdown]
# ## Communication of one ZeRO-3 step
#
# `comm_report` compiles the step, finds every collective in the optimized program and charges
# its bytes to the devices that send them, split by the mesh's `node` coordinate into intra-node
# and cross-node traffic. The rows follow the list above: a forward gather and a backward gather
# per partitioned parameter (per layer, inside the layer scan), a reduce-scatter per gradient,
# and one all-reduce for the gradients of the replicated (persistent) leaves; their optimizer
# state is still partitioned, so their updated values are all-gathered after the update. On a
# real cluster the cross-node column is the expensive one; that is what ZeRO++ attacks.

# %%
print(zeroxla.comm_report(step, state, batch).table())

# %% [markdown]
# ## Your own model
#
# `make_step` takes any Flax NNX module, written the way you would write it for one device. Here
# is one with the patterns real models use: blocks in a plain Python list (`nnx.data` marks a
# list attribute as holding modules), the output projection
# tied to the input embedding (one `nnx.Embed`, used again through `attend`), and dropout whose
# RNG stream the model holds. With `persistence_threshold=0` every parameter is partitioned.
#
# - The tied embedding is one parameter: `describe()` lists `unembed/embedding` as an alias of
#   `embed/embedding`; it is gathered where it is used and its gradient is the sum of both uses.
# - Dropout draws from the run's seed (`step.init(seed=...)`), folded with the step, the device
#   and the micro-batch: each device masks its share of the batch differently, and the run is
#   reproducible.
#
# The check at the end trains the same model with dropout off for three steps, once with
# zeroxla on 8 devices and once with plain `jax.grad` and optax on one device: the losses agree.

# %%
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d, rate, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):                                    # x: [B, T, d]
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.norm(x)))))


class TiedCharLM(nnx.Module):
    """A small causal model: a causal convolution over 3 characters, then residual MLPs."""

    def __init__(self, vocab, d=64, layers=3, rate=0.1, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.mix = nnx.Conv(d, d, kernel_size=(3,), padding="CAUSAL", rngs=rngs)
        self.blocks = nnx.data([Block(d, rate, rngs) for _ in range(layers)])  # a plain list
        self.unembed = self.embed                              # tied weights

    def __call__(self, tokens):                                # tokens: int32[B, T]
        x = self.mix(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        return self.unembed.attend(x)                          # [B, T, vocab]


own_config = zeroxla.ZeroConfig(stage=3, persistence_threshold=0)
own_step = zeroxla.make_step(lambda: TiedCharLM(corpus.vocab_size, rngs=nnx.Rngs(0)), mesh,
                             optimizer=optax.adamw(3e-3), config=own_config)
print("\n".join(own_step.layout.plan.describe().splitlines()[-2:]))
own_state = own_step.init(seed=0)
for k in range(60):
    own_state, metrics = own_step(own_state, data.device_batch(corpus.train, batches, k,
                                                               own_step.layout.batch_sharding))
    if k % 20 == 0 or k == 59:
        print(f"step {k:3d}  loss {float(metrics['loss']):.3f}")


# %%
# Dropout off: zeroxla on 8 devices against plain single-device training, same batches.
def plain_loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def fresh():
    return TiedCharLM(corpus.vocab_size, rate=0.0, rngs=nnx.Rngs(0))


host_batches = [jax.device_get(data.device_batch(corpus.train, batches, k,
                                                  step.layout.batch_sharding))
                for k in range(3)]
zero_step = zeroxla.make_step(fresh(), mesh, optimizer=optax.sgd(0.05), config=own_config)
zero_state, zero_losses = zero_step.init(), []
for batch in host_batches:
    zero_state, metrics = zero_step(zero_state, batch)
    zero_losses.append(float(metrics["loss"]))

graphdef, params, rng_streams = nnx.split(fresh(), nnx.Param, ...)
sgd = optax.sgd(0.05)
opt_state, plain_losses = sgd.init(params), []
for batch in host_batches:
    loss, grads = jax.value_and_grad(
        lambda p: plain_loss(nnx.merge(graphdef, p, rng_streams), batch))(params)
    updates, opt_state = sgd.update(grads, opt_state)
    params = optax.apply_updates(params, updates)
    plain_losses.append(float(loss))
print("zeroxla, 8 devices:", [f"{x:.6f}" for x in zero_losses])
print("one device, plain: ", [f"{x:.6f}" for x in plain_losses])
assert max(abs(a - b) / b for a, b in zip(zero_losses, plain_losses)) < 1e-5

# %% [markdown]
# ## Sampling
#
# `gathered_model(state)` reassembles the partitions into a plain NNX model with full
# parameters, for evaluation, export or generation. After 100 steps the model has learned which
# characters follow which, roughly how long words are, and where lines break; not yet
# Shakespeare.

# %%
trained = zeroxla.gathered_model(state)
print(sample_text(trained, corpus.tokenizer, "ROMEO:\n", num_tokens=120, context=64,
                  temperature=0.8, seed=0))
