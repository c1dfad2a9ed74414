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
# # GRPO with a verifiable reward: SFT, then GRPO on the bundled arithmetic task
#
# The GRPO family (TRL's `GRPOTrainer`, DAPO's token-level loss by default) needs no critic and
# no reward model when the answer can be checked: for each prompt the Hybrid Engine samples a
# group of answers from the actor's ZeRO-3 partitions, each answer's reward is whether it
# states the right number after `####`, and an answer's advantage is its reward against its
# group's mean. This notebook
#
# 1. SFTs a tiny GPT on part of the bundled task (`zeroxla.rlhf.grpo.arithmetic_task`: arithmetic
#    word problems generated locally, no download), half of its answers written without the
#    `####` marker, so it answers in the checked form only part of the time;
# 2. measures its greedy exact-answer accuracy on held-out problems;
# 3. runs GRPO with the exact-answer reward (`zeroxla grpo` runs the same loop from the command
#    line), logging each iteration's train/rollout log-prob gap, with truncated importance
#    sampling (`rollout_correction="tis"`);
# 4. measures the held-out accuracy again.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for a 2-node x 4-device mesh.
import os

from zeroxla.app.launch import set_host_threads   # starts no JAX backend

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
set_host_threads(os.environ, 8)   # the CPU threads 8 devices need on a machine with few cores
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import matplotlib.pyplot as plt

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.eval import exact_accuracy
from zeroxla.rlhf.grpo.run import run_grpo
from zeroxla.rlhf.grpo.reward_funcs import accuracy_reward
from zeroxla.rlhf.grpo.task_sft import supervised_finetune_rows

mesh = zeroxla.make_mesh(nodes=2, local=4)

# %% [markdown]
# ## The task
#
# Problems with one-digit operands, split by seed into training and held-out sets with no
# prompt in both. Every prompt is padded to the same width (our models take no attention mask).

# %%
tokenizer = CharTokenizer.from_text(task.ALPHABET)
eos = int(tokenizer.encode(task.END)[0])
train, held_out = task.split_problems(1000, 128, seed=0, digits=1)
width = task.prompt_width(1)
for p in train[:2]:
    print(repr(p["prompt"]), "->", repr(p["completion"]))

# %% [markdown]
# ## SFT
#
# 600 training problems, half with the answer alone (no `####`): the model learns both forms.

# %%
sft_rows = [dict(p, completion=p["completion"] if i % 2 else p["answer"] + task.END)
            for i, p in enumerate(train[:600])]
actor = models.build("gpt-tiny", vocab_size=tokenizer.vocab_size, max_seq_len=64)
sft, _ = supervised_finetune_rows(actor, sft_rows, tokenizer, mesh=mesh, prompt_length=width,
                                  completion_length=8, steps=200, batch_size=32, lr=3e-3)
config = GRPOConfig(num_generations=8, prompts_per_iteration=16, prompt_length=width,
                    max_completion_length=8, num_iterations=2, learning_rate=1e-3,
                    rollout_correction="tis", tis_cap=2.0)
before = exact_accuracy(sft, held_out, tokenizer, config, mesh=mesh, eos_id=eos)
print(f"held-out exact-answer accuracy after SFT: {before:.3f}")

# %% [markdown]
# ## GRPO
#
# Twelve iterations on the other 400 training problems: 16 prompts x 8 answers each, two policy
# updates per rollout (`num_iterations`, where the clip binds), the rollouts generated
# tensor-parallel over 2 devices. Each record holds the rollout's mean reward, the clipped
# fraction of the ratio, and the gap between the log-probs the engine drew each token with and
# the training forward's (`gap/max`, `gap/mean_abs`, `gap/frac_over_1e-3`): the two programs
# compute the same softmax, but float32 sums over other shapes round differently, so they agree
# to a few float32 ulps, not bit for bit. Truncated importance sampling multiplies each token's
# loss by min(exp(train - rollout), 2): here within 1e-5 of 1.

# %%
run = run_grpo(config, 12, sft, mesh=mesh, tokenizer=tokenizer, prompts=train[600:],
               reward_funcs=[accuracy_reward], eos_id=eos, inference_tp_size=2)
print(f"{'it':>2} {'reward':>6} {'clip':>5} {'gap max':>8} {'gap mean':>8} {'>1e-3':>5} "
      f"{'tis>cap':>7}")
for r in run.records:
    print(f"{r['iteration']:>2} {r['reward']:>6.3f} {r['clip_fraction']:>5.3f} "
          f"{r['gap/max']:>8.1e} {r['gap/mean_abs']:>8.1e} {r['gap/frac_over_1e-3']:>5.2f} "
          f"{r['tis_clipped_fraction']:>7.2f}")

# %%
after = exact_accuracy(run.trainer.actor_model(), held_out, tokenizer, config, mesh=mesh,
                       eos_id=eos)
print(f"held-out exact-answer accuracy: {before:.3f} (SFT) -> {after:.3f} (GRPO), "
      f"{round(before * len(held_out))} -> {round(after * len(held_out))} of {len(held_out)}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
its = [r["iteration"] for r in run.records]
ax1.plot(its, [r["reward"] for r in run.records], marker="o")
ax1.set(xlabel="GRPO iteration", ylabel="mean exact-answer reward", title="rollout reward")
ax2.plot(its, [r["gap/max"] for r in run.records], marker="o", color="tab:red")
ax2.set(xlabel="GRPO iteration", ylabel="max |train - rollout| log-prob",
        title="train/rollout log-prob gap")
fig.tight_layout()
