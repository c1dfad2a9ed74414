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
# # RLHF with PPO: DeepSpeed-Chat's step 3 on zeroxla
#
# DeepSpeed-Chat's third step trains a language model (the *actor*) with PPO against a reward,
# with a *critic* estimating values, a frozen *reference* model whose KL divergence from the
# actor is penalised, and DeepSpeed's Hybrid Engine generating the rollouts from the ZeRO-3
# training state. `zeroxla.rlhf` is that loop on JAX. Each iteration:
#
# 1. **generate**: prompts cut from tiny-shakespeare are continued by the Hybrid Engine (the
#    actor's ZeRO-3 partitions resharded once to tensor parallelism, KV-cached sampling);
# 2. **experience**: log-probs under actor and reference, critic values, a programmatic reward
#    (the fraction of vowels in the continuation), per-token rewards
#    `-kl_ctl * (logprobs - ref_logprobs)` plus the clipped score on the last token, and GAE
#    advantages and returns (DeepSpeed-Chat's `compute_rewards`, `get_advantages_and_returns`);
# 3. **train**: `make_step` ZeRO-3 steps of the actor (clipped policy loss) and the critic
#    (clipped value loss), each a custom `loss_fn`.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for a 2-node x 4-device mesh.
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import matplotlib.pyplot as plt
import numpy as np

import zeroxla
from zeroxla import rlhf
from zeroxla.app import data

corpus = data.load_corpus()
mesh = zeroxla.make_mesh(nodes=2, local=4)

# %% [markdown]
# PPO starts from a supervised model (DeepSpeed-Chat's step 1, shortened to 60 ZeRO-3 steps
# here), so that the actor writes Shakespeare-like characters before the reward pulls it.

# %%
actor, sft_loss = rlhf.supervised_finetune(mesh=mesh, steps=60)
config = rlhf.PPOConfig.vowels_demo()
print(f"supervised loss {sft_loss:.3f}\n{config}")

# %% [markdown]
# The reward is a program, not a model: `vowel_fraction` of the generated text.

# %%
for text in ("To be, or not to be", "xyz", "aeiou"):
    print(f"{text!r}: {rlhf.vowel_fraction(text):.3f}")

# %%
run = rlhf.run_ppo(config, 12, actor, mesh=mesh, tokenizer=corpus.tokenizer,
                   prompt_tokens=corpus.val, inference_tp_size=2, seed=0,
                   on_iteration=lambda r: print(
                       f"iter {r['iteration']:2d}  reward {r['reward']:.3f}  kl {r['kl']:.3f}  "
                       f"gen {r['generation_s']:.2f}s  train {r['training_s']:.2f}s"))

# %% [markdown]
# The mean reward of each rollout and the actor's KL from the reference (per answer token):
# the reward rises while the KL penalty keeps the actor near the reference.

# %%
records = run.records
rlhf.plot_records(records)
plt.show()

# %% [markdown]
# Where the time goes (iteration 0 compiles everything and is left out), and a sample before
# and after PPO (same prompt position in the first and last rollout).

# %%
split = rlhf.time_split(records)
print(f"generation {split['generation_s']:.1f}s ({split['generation_share']:.0%}), "
      f"experience {split['experience_s']:.1f}s ({split['experience_share']:.0%}), "
      f"training {split['training_s']:.1f}s ({split['training_share']:.0%})")
print(f"reward: first 3 iterations {np.mean([r['reward'] for r in records[:3]]):.3f}, "
      f"last 3 {np.mean([r['reward'] for r in records[-3:]]):.3f}")
first, last = run.rollouts[0], run.rollouts[-1]
for name, r in (("before", first), ("after", last)):
    print(f"{name}: {r.texts[0]!r}  (reward {r.scores[0]:.2f})")
