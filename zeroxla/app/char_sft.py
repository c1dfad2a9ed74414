"""Supervised fine-tuning before the character-level PPO demo (`examples/rlhf_ppo.py`): next-token
training of a preset on tiny-shakespeare under ZeRO-3, so that PPO starts from a model that
writes Shakespeare-like text rather than uniform noise. (DeepSpeed-Chat's step 1 on a pretrained
checkpoint is `zeroxla train --init-from HF_DIR --data sft.jsonl`.)"""

from __future__ import annotations

import jax
import optax
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.app import data


def supervised_finetune(model: str = "gpt-tiny", *, mesh, steps: int = 200,
                        batch_size: int = 32, seq_len: int = 64, lr: float = 3e-3,
                        seed: int = 0) -> tuple[nnx.Module, float]:
    """Trains the preset `model` for `steps` AdamW steps on the bundled corpus; returns the
    gathered model (plain, full weights) and its last training loss."""
    corpus = data.load_corpus()
    step = zeroxla.make_step(lambda: models.build(model, seed=seed), mesh,
                             optimizer=optax.adamw(lr), config=zeroxla.ZeroConfig(stage=3))
    plan = data.BatchPlan(len(corpus.train), batch_size, seq_len, seed=seed)
    state, loss = step.init(seed), float("nan")
    for k in range(steps):
        state, metrics = step(state, data.host_batch(corpus.train, plan, k))
        # One step in flight at a time: on a loaded CPU, queued programs whose collectives
        # interleave have stalled XLA:CPU's rendezvous past its 40 s timeout.
        jax.block_until_ready(metrics)
    if steps:
        loss = float(metrics["loss"])
    return zeroxla.gathered_model(state), loss
