"""PPO at inference_tp_size=1 with `PPOConfig.batch_invariant`: a plain tiny Llama actor is
rebuilt in the batch-invariant mode (`roles.batch_invariant_policy`), and the Hybrid Engine's
log-probs (KV-cached decode, [B, 1] rows per step) equal the actor's training forward's ([B,
P + G - 1] rows at once, in the ZeRO-3 step's layout) bit for bit over every answer token:
the record's `gap/max` and `gap/mean_abs` are 0.0. The critic, built from the plain model
given, stays in the default mode. As GRPO's test (test_grpo_batch_invariant.py), the equality
holds with XLA:CPU's fusion emitters, so the test runs in a fusion-emitters child."""

import numpy as np
import pytest

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import PPOConfig, PPOTrainer
from zeroxla.rlhf.grpo import arithmetic_task as task

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
# 32 prompts x 32 tokens = 1,024 answer places; no EOS, so every one is real.
CONFIG = PPOConfig(prompts_per_iteration=32, prompt_length=8, answer_length=32,
                   batch_invariant=True)


@pytest.mark.slow
@pytest.mark.fusion_emitters      # bit-identity across shapes: XLA:CPU's fusion emitters only
def test_batch_invariant_ppo_rollout_logprobs_equal_the_training_forward():
    actor = models.build("llama-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=48, seed=3)
    prompts = np.random.default_rng(0).integers(1, TOKENIZER.vocab_size, (64, 8))
    trainer = PPOTrainer(CONFIG, actor, mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                         prompt_tokens=prompts.astype(np.int32), inference_tp_size=1,
                         reward_fn=lambda text: len(set(text)) / 6, seed=0)
    assert trainer.engine.batching == "static"
    assert zeroxla.gathered_model(trainer.actor_state).config.batch_invariant
    assert not zeroxla.gathered_model(trainer.critic_state).base.config.batch_invariant
    record, rollout = trainer.iteration(0)
    real = rollout.action_mask > 0
    assert int(real.sum()) == 32 * 32
    assert np.array_equal(rollout.logprobs[real], rollout.rollout_logprobs[real])
    assert record["gap/max"] == 0.0 and record["gap/mean_abs"] == 0.0
    assert np.isfinite(record["actor_loss"]) and np.isfinite(record["critic_loss"])
