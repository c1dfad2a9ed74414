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
# # Pipeline parallelism: DeepSpeed's 1F1B schedule as one SPMD program
#
# Pipeline parallelism cuts the model's layer list into S consecutive **stages**, one per group
# of devices, and feeds the global batch through them as M **micro-batches**, so that the stages
# work on different micro-batches at the same time. DeepSpeed's `PipelineModule` takes the layer
# list and its `partition_method`; its `TrainSchedule` tells every stage, step by step, which
# instructions to run: load a micro-batch, forward, send the activation on, receive a gradient,
# backward, and finally reduce the gradients and step the optimizer. Each stage runs its own
# stream on its own process (MPMD).
#
# zeroxla keeps DeepSpeed's schedules as data (`zeroxla.pipeline`, no JAX in it) and runs them
# differently: all stages' streams are lowered to one table `[step, stage]`, and **one** SPMD
# program, compiled once for every device, scans the table's steps. At each step a device looks
# up its own stage's op (idle, forward or backward of micro-batch m) and runs it; then, for each
# stage that sends at that step, one `ppermute` over the mesh's `stage` axis moves its
# activation to stage + 1 or its gradient to stage - 1: one collective-permute per DeepSpeed
# `SendActivation` / `SendGrad`. (Which stages send is fixed by the table, so the scan is cut
# into runs of steps that repeat the same sends: 1F1B's steady state alternates two steps.)
# ZeRO (stages 0-3) runs over the data axes inside each stage, in the same program.
#
# This notebook shows the schedule, its timeline and bubble, trains a tiny GPT pipelined over
# 2 stages with ZeRO-3 inside each, checks it against the same model trained on one device, and
# reads 1F1B's and GPipe's memory from the compiled programs.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for 2 stages x 4 data devices.
import os

from zeroxla.app.launch import set_host_threads   # starts no JAX backend

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
set_host_threads(os.environ, 8)   # the CPU threads 8 devices need on a machine with few cores
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.pipeline import GPipeSchedule, TrainSchedule, schedule_table
from zeroxla.pipeline.timeline import plot_timeline, render_text

print(jax.devices())

# %% [markdown]
# ## DeepSpeed's TrainSchedule, instruction by instruction
#
# `TrainSchedule(micro_batches, stages, stage_id)` is DeepSpeed's 1F1B schedule (one forward, one
# backward): after a warm-up of forwards, each stage alternates a forward of a new micro-batch
# with a backward of an old one, so at most `S - stage_id` micro-batches are in flight and the
# stage needs only `min(S, M)` activation buffers. Here: stage 0 of 2, four micro-batches.
# Steps alternate between even (forward) and odd (backward) slots, exactly as in DeepSpeed, so a
# stage is idle on some steps; the last step reduces the gradients and steps the optimizer.

# %%
schedule = TrainSchedule(4, 2, 0)            # micro_batches=4, stages=2, stage_id=0
for step_id, instructions in enumerate(schedule.steps()):
    print(f"step {step_id}: {instructions}")
print("buffers:", schedule.num_pipe_buffers())

# %% [markdown]
# ## The timeline and the bubble
#
# `schedule_table` lowers every stage's stream into one table; `render_text` and `plot_timeline`
# draw it (`F3` is the forward of micro-batch 3, `B3` its backward, `.` an idle slot). The idle
# share is the **bubble**, `(S - 1) / (M + S - 1)`: the first stage waits for the last one's
# first backward, the last one waits for the first one's first forward. It is the same for 1F1B
# and GPipe (all forwards, then all backwards); what 1F1B saves is memory (below). More
# micro-batches shrink the bubble.

# %%
tables = {name: schedule_table(cls, 4, 4) for name, cls in (("1F1B", TrainSchedule),
                                                             ("GPipe", GPipeSchedule))}
for table in tables.values():
    print(render_text(table))

fig, axes = plt.subplots(2, 1, figsize=(10, 4.5))
for ax, table in zip(axes, tables.values()):
    plot_timeline(table, ax)
fig.tight_layout()
plt.show()

for m in (1, 4, 8, 16, 32):
    t = schedule_table(TrainSchedule, m, 4)
    print(f"4 stages, M={m:2d}: bubble {t.bubble_fraction:.3f}  "
          f"(S-1)/(M+S-1) = {3 / (m + 3):.3f}")

# %% [markdown]
# ## Training pipelined, ZeRO-3 inside each stage
#
# The mesh gets a `stage` axis in front of the data axes: 2 stages x 1 node x 4 local devices.
# `make_step(..., pipeline=PipelineConfig(micro_batches=4, schedule="1f1b"))` splits the model's
# layer list (DeepSpeed's `partition_method="parameters"` by default) and runs the table above
# inside the ZeRO-3 step: every stage's devices hold 1/4 of the parameters and gather a layer
# just before using it. `step.layout.plan.describe()` prints each parameter's storage and compute
# layout, then the stage split and the schedule. The persistence threshold is lowered to 500
# elements so that every weight matrix is partitioned (DeepSpeed's default, 100,000, would keep
# all of this tiny model replicated); biases and norm scales stay replicated.

# %%
SEQ, BATCH, STEPS = 16, 32, 3
model_fn = lambda: models.build("gpt-tiny", seed=1)          # 2 layers: one per stage

mesh = zeroxla.make_mesh(1, 4, stages=2)                     # axes ("stage", "node", "local")
step = zeroxla.make_step(model_fn, mesh, optimizer=optax.adamw(3e-3),
                         config=zeroxla.ZeroConfig(stage=3, persistence_threshold=500),
                         pipeline=zeroxla.PipelineConfig(micro_batches=4, schedule="1f1b"))
print(step.layout.plan.describe())

# %% [markdown]
# Random tokens whose target is the next id (`inputs + 1`), so the loss can fall. The global batch
# of 32 is split over the 4 data devices (8 rows each), and each device's 8 rows into 4
# micro-batches of 2.

# %%
rng = np.random.default_rng(0)
batches = []
for _ in range(STEPS):
    inputs = rng.integers(0, 65, (BATCH, SEQ)).astype(np.int32)
    batches.append({"inputs": inputs, "targets": (inputs + 1) % 65})

state = step.init()
pipelined = []
for batch in batches:
    state, metrics = step(state, batch)
    pipelined.append(float(metrics["loss"]))
print("pipelined losses:", np.round(pipelined, 5))

# %% [markdown]
# ## Parity with the unpipelined model on one device
#
# The reference is written out with no zeroxla code: the same model, plain `jax.value_and_grad`
# of the mean next-token cross-entropy over the whole batch, and the same AdamW, on device 0.
# The pipeline's loss is the sum over micro-batches and devices divided by the token count, so
# the two runs see the same loss and gradients up to float32 summation order.

# %%
def cross_entropy(model, batch):
    logp = jax.nn.log_softmax(model(batch["inputs"]).astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


graphdef, params, rest = nnx.split(model_fn(), nnx.Param, ...)
optimizer = optax.adamw(3e-3)
opt_state = optimizer.init(params)


@jax.jit
def single_device_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: cross_entropy(nnx.merge(graphdef, p, rest), batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


single = []
for batch in batches:
    params, opt_state, loss = single_device_step(params, opt_state, batch)
    single.append(float(loss))
print("single-device losses:", np.round(single, 5))
rel = np.max(np.abs(np.array(pipelined) - np.array(single)) / np.abs(np.array(single)))
print(f"max relative difference of the losses: {rel:.2e}")
assert rel < 1e-5, rel

# %% [markdown]
# ## Memory: 1F1B against GPipe, from the compiled programs
#
# A stage keeps each in-flight micro-batch's activations until its backward (with the default
# `ZeroConfig.remat="none"` the stage's vjp residuals; with `"full"` only the stage input, the
# rest recomputed in backward). GPipe runs every forward before the
# first backward, so it keeps all M micro-batches; 1F1B has at most `S - stage` in flight and
# needs `min(S, M)` buffers whatever M is. We compile both schedules at M = 4 and M = 16 with the
# micro-batch size fixed (so the global batch grows with M) and read XLA's temporaries from
# `compiled.memory_analysis()`; nothing runs. ZeRO is off here (stage 0, SGD), which compiles
# faster and leaves the same stash. At stage 0 the stages keep their vjp residuals
# (`remat="none"`; recomputing is a ZeRO-2/3 option), so a stash buffer holds several
# activations' worth; we count in units of one `[micro-batch, T, D]` float32 activation.

# %%
MICRO_BATCH, D_MODEL = 2, models.GPTConfig.tiny().d_model
temps = {}
for schedule_name in ("1f1b", "gpipe"):
    for m in (4, 16):
        s = zeroxla.make_step(model_fn, mesh, optimizer=optax.sgd(0.1),
                              config=zeroxla.ZeroConfig(stage=0),
                              pipeline=zeroxla.PipelineConfig(m, schedule=schedule_name))
        shape = (MICRO_BATCH * m * s.layout.data_size, SEQ)
        batch = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets")}
        compiled = s.compile(jax.eval_shape(s.init), batch)
        temps[schedule_name, m] = compiled.memory_analysis().temp_size_in_bytes

buffer = MICRO_BATCH * SEQ * D_MODEL * 4
print(f"one stash buffer [{MICRO_BATCH}, {SEQ}, {D_MODEL}] float32: {buffer / 1024:.2f} KiB")
for schedule_name in ("1f1b", "gpipe"):
    growth = temps[schedule_name, 16] - temps[schedule_name, 4]
    print(f"{schedule_name:5s}  temporaries M=4: {temps[schedule_name, 4] / 1024:8.1f} KiB  "
          f"M=16: {temps[schedule_name, 16] / 1024:8.1f} KiB  growth {growth / 1024:6.1f} KiB, "
          f"{growth / 12 / buffer:.1f} activations per extra micro-batch")
assert temps["1f1b", 16] < temps["gpipe", 16]
assert temps["gpipe", 16] - temps["gpipe", 4] >= 12 * buffer

# %% [markdown]
# GPipe's temporaries grow linearly with the micro-batches, 1F1B's stay flat: with enough
# micro-batches to shrink the bubble, only 1F1B's memory stays bounded, which is why it is
# DeepSpeed's default. `benchmarks/pipeline.py` measures the same on gpt-small with 4 stages and
# ZeRO-3, with step times and the bytes each `ppermute` sends.
