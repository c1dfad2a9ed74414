"""GRPO at inference_tp_size=1 with a batch-invariant actor (`LlamaConfig.batch_invariant`):
the rollout engine's log-probs (KV-cached decode, [B, 1] rows per step, softmax over the
cache's slots) equal the training forward's ([B, P + T - 1] rows at once) exactly, max |gap| =
0.0 over every answer token. Without the mode the same rollout differs by float32 ulps
(`test_grpo_rollout_gap`: XLA:CPU's dots and reductions sum in an order the row count picks).
The equality holds with XLA:CPU's fusion emitters (what users run), not with the older emitters
the suite compiles with (4.8e-7 apart there), so the test runs in a fusion-emitters child.
A Qwen3-MoE actor rebuilt in the mode by `GRPOConfig.batch_invariant`, under
`routing_replay="measure"` (the record compared, not replayed), routes every fed token at every
layer as its rollout did: 0 mismatches, gap 0.0."""

import numpy as np
import pytest

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import GRPOConfig
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.grpo.trainer import GRPOTrainer, iteration_record
from job_runs import distinct_chars

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)


# 16 prompts x 8 answers x 32 tokens = 4,096 answer places; no EOS, so every one is real.
CONFIG = GRPOConfig(num_generations=8, prompts_per_iteration=16, prompt_length=8,
                    max_completion_length=32, learning_rate=1e-2)


def _iteration(config, actor):
    """One GRPO iteration at tp 1 -> (the rollout, its record); the rollout engine batches
    statically (a batch-invariant model has no paged attention)."""
    trainer = GRPOTrainer(config, actor, mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                          prompts=task.split_problems(64, 0)[0], reward_funcs=[distinct_chars],
                          inference_tp_size=1, seed=0)
    assert trainer.engine.batching == "static"
    rollout, _, _ = trainer.generate_experience(0)
    return rollout, iteration_record(0, rollout, trainer.train_grpo(rollout), {})


def _assert_exact(rollout, record):
    real = rollout.action_mask > 0
    assert int(real.sum()) >= 4096
    assert np.array_equal(rollout.logprobs[real], rollout.rollout_logprobs[real])
    assert record["gap/max"] == 0.0 and record["gap/mean_abs"] == 0.0


@pytest.mark.slow
@pytest.mark.fusion_emitters      # bit-identity across shapes: XLA:CPU's fusion emitters only
def test_batch_invariant_rollout_logprobs_equal_the_training_forward():
    actor = models.build("llama-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=48,
                         batch_invariant=True, seed=3)
    _assert_exact(*_iteration(CONFIG, actor))


@pytest.mark.slow
@pytest.mark.fusion_emitters      # bit-identity across shapes: XLA:CPU's fusion emitters only
def test_batch_invariant_moe_rollout_routes_as_the_training_forward():
    """Qwen3-MoE (8 experts, top 2) built in the default mode and rebuilt in the mode by
    `GRPOConfig.batch_invariant`; the rollout's routing recorded and compared with the
    training forward's live routing at every fed (token, layer): no pair differs."""
    actor = models.build("qwen3-moe-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=48,
                         seed=3)
    rollout, record = _iteration(
        CONFIG.replace(routing_replay="measure", batch_invariant=True), actor)
    _assert_exact(rollout, record)
    differ, compared = (int(n) for n in rollout.routing_mismatch)
    assert compared >= 4096 * actor.config.moe_layers and differ == 0
    assert record["routing/mismatch"] == 0 and record["routing/mismatch_fraction"] == 0.0
