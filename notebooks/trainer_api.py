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
# # The jobs from Python: TRL's trainers on a `datasets` dataset, logged to TensorBoard
#
# `zeroxla.app.trainers` holds the jobs as a TRL user calls them: `SFTTrainer`, `RewardTrainer`,
# `DPOTrainer` and `GRPOTrainer`, each with its args (`SFTConfig`, ...) under TRL's names. A
# trainer builds the same config tree the command line builds and runs the same job under the
# same runner, so `GRPOTrainer(...).train()` gives the records `zeroxla grpo` gives with the
# same settings (tests/zeroxla/app/test_trainers.py checks it record for record). This notebook
#
# 1. writes a tiny random GPT-2 as a Hugging Face checkpoint (no download);
# 2. SFTs it on a `datasets.Dataset` of prompt/completion rows with `report_to=["tensorboard"]`;
# 3. runs GRPO from that run with a reward function written here, on a dataset of prompts;
# 4. reads the TensorBoard event files back and checks they hold every metrics.jsonl record.

# %%
# JAX fixes its device list when it first initialises a backend, so the flag must be set before
# `import jax`: it splits the CPU into 8 host devices, enough for a 2-node x 4-device mesh.
import os

from zeroxla.app.launch import set_host_threads   # starts no JAX backend

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # keeps flags you set
                           " --xla_force_host_platform_device_count=8")
set_host_threads(os.environ, 8)   # the CPU threads 8 devices need on a machine with few cores
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile
from pathlib import Path

import datasets
import matplotlib.pyplot as plt
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from zeroxla.app import chat_data
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
from zeroxla.app.trainers import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

work = Path(tempfile.mkdtemp(prefix="zeroxla-trainers-"))
base = gpt2_checkpoint(work / "gpt2")        # GPT2LMHeadModel: 2 layers, d 64, 512 ids
print(sorted(p.name for p in base.iterdir()))

# %% [markdown]
# ## The data: a `datasets.Dataset`
#
# Any dataset TRL takes works the same way: `prompt`/`completion` (here), `messages`, or
# `text`. An in-memory dataset is written into the run directory as Parquet and read by the one
# reader every `--data` goes through, so the run records (and can resume) it as a file.

# %%
examples = chat_data.shakespeare_sft(200, seed=0)
sft_data = datasets.Dataset.from_list([{"prompt": e.prompt, "completion": e.response}
                                       for e in examples])
print(sft_data)
print(repr(sft_data[0]["prompt"]), "->", repr(sft_data[0]["completion"]))

# %% [markdown]
# ## SFT
#
# `SFTConfig` takes TRL's names where they differ from the job's tree (`max_steps`,
# `learning_rate`, `max_length`) and the tree's own names for the rest (`batch_size` is the
# global batch, `mesh` the (nodes, local) device mesh); an unknown name is refused, naming the
# accepted ones. `train()` returns metrics.jsonl's records.

# %%
sft = SFTTrainer(model=base, train_dataset=sft_data,
                 args=SFTConfig(output_dir=str(work / "sft"), max_steps=30, batch_size=16,
                                max_length=64, learning_rate=3e-3, warmup_steps=5,
                                eval_steps=10, sample_tokens=0, report_to=["tensorboard"],
                                progress=False))
sft_records = sft.train()
print([round(r["loss"], 3) for r in sft_records[::5]])

# %% [markdown]
# ## GRPO
#
# A reward function is any callable `(prompts, completions, **columns) -> list[float]`, as in
# TRL; the dataset's other columns reach it by name. This toy reward counts the distinct
# letters of an answer, so the group-relative advantages are not all zero on a barely trained
# model. The actor is the SFT run's directory, as `zeroxla grpo --actor` takes it.

# %%
def distinct_letters(prompts, completions, **columns):
    return [len({ch for ch in c if ch.isalpha()}) / 6 for c in completions]


prompts = datasets.Dataset.from_list([{"prompt": e.prompt} for e in examples[:64]])
grpo = GRPOTrainer(model=sft.run_dir, reward_funcs=[distinct_letters], train_dataset=prompts,
                   args=GRPOConfig(output_dir=str(work / "grpo"), max_steps=4,
                                   num_generations=4, prompts_per_iteration=8, prompt_length=40,
                                   max_completion_length=8, learning_rate=1e-3,
                                   report_to=["tensorboard"], progress=False))
grpo_records = grpo.train()
for r in grpo_records:
    print(f"iteration {r['iteration']}: reward {r['reward']:.3f}  KL {r['kl']:.4f}  "
          f"clipped {r['clip_fraction']:.3f}")

# %% [markdown]
# ## TensorBoard
#
# Every record went to `<run>/tensorboard/` as it went to metrics.jsonl, at the same step
# (TensorBoard keeps a scalar as float32). `tensorboard --logdir <run>/tensorboard` shows it;
# here TensorBoard's own reader loads the event files back.

# %%
def scalars(run_dir):
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def same_as_records(run_dir, records, key):
    """Whether TensorBoard holds every number of every record at its step, as float32."""
    logged = scalars(run_dir)
    return all(logged[name][r[key]] == np.float32(value) for r in records
               for name, value in r.items() if name != key and isinstance(value, float))


sft_logged, grpo_logged = scalars(sft.run_dir), scalars(grpo.run_dir)
print(f"SFT: {len(sft_logged)} TensorBoard tags, loss at steps "
      f"{min(sft_logged['loss'])}..{max(sft_logged['loss'])}")
print(f"TensorBoard holds every metrics.jsonl record: SFT "
      f"{same_as_records(sft.run_dir, sft_records, 'step')}, GRPO "
      f"{same_as_records(grpo.run_dir, grpo_records, 'iteration')}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(*zip(*sorted(sft_logged["loss"].items())), label="train")
ax1.plot(*zip(*sorted(sft_logged["val_loss"].items())), marker="o", label="validation")
ax1.set(xlabel="SFT step", ylabel="loss", title="SFT (read back from TensorBoard)")
ax1.legend()
ax2.plot(*zip(*sorted(grpo_logged["reward"].items())), marker="o")
ax2.set(xlabel="GRPO iteration", ylabel="mean reward", title="GRPO rollout reward")
fig.tight_layout()
