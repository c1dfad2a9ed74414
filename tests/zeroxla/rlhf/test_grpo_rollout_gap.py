"""One GRPO iteration at inference_tp_size=1 on a model whose vocabulary is padded past its
tokenizer's: the rollout draws no padded id (`vocab_limit = tokenizer.vocab_size`), the engine
reports the log-prob it drew each token with, and the record holds the train/rollout gap, with
truncated importance sampling applied.

The gap's bound: the rollout's log-probs come from the KV-cached decode (one token per step,
[B, 1] rows through every matmul, softmax over the cache's S slots), the training forward's from
one [B, P + T - 1] forward. The formulas are the same (`sampling.sampled_logprobs` at
temperature 1 is `token_logprobs`'s log-softmax), but float32 dots and reductions of other
shapes sum in another order (XLA:CPU's dot kernels block by the row count), so the two differ
by a few float32 ulps of the log-prob: 4.8e-7 at most on this model. Run through the cached
path on the same shapes (a full-sequence prefill into a cache of the sequence's length) the
log-probs equal the forward's bit for bit; exactly 0 for the decode itself would need
row-count-invariant kernels. The bound asserted is 1e-5, 20x the measured figure, far below
what a wrong distribution (an unlimited vocabulary, another temperature) gives (> 1e-2)."""

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
EOS = int(TOKENIZER.encode(task.END)[0])
PADDED = 8                                    # embedding rows past the tokenizer's ids
GAP_BOUND = 1e-5


@pytest.mark.slow
def test_rollout_gap_at_tp1_on_a_padded_vocabulary():
    config = GRPOConfig(num_generations=4, prompts_per_iteration=4, prompt_length=8,
                        max_completion_length=6, learning_rate=1e-2, rollout_correction="tis")
    actor = models.build("gpt-tiny", vocab_size=TOKENIZER.vocab_size + PADDED, max_seq_len=32,
                         seed=3)
    trainer = GRPOTrainer(config, actor, mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                          prompts=task.split_problems(32, 0)[0], reward_funcs=[distinct_chars],
                          inference_tp_size=1, eos_id=EOS, seed=0)
    rollout, _, _ = trainer.generate_experience(0)
    real = rollout.action_mask > 0
    answers = rollout.tokens[:, config.prompt_length:][real]
    assert answers.size > 40 and answers.max() < TOKENIZER.vocab_size
    drawn = rollout.rollout_logprobs[real]
    assert np.all(np.isfinite(drawn)) and np.all(drawn < 0)
    record = iteration_record(0, rollout, trainer.train_grpo(rollout), {})
    gap = np.abs(rollout.logprobs - rollout.rollout_logprobs)[real]
    assert record["gap/max"] == pytest.approx(float(gap.max()), rel=1e-6)
    assert record["gap/max"] <= GAP_BOUND and record["gap/frac_over_1e-3"] == 0.0
    assert record["tis_clipped_fraction"] == 0.0        # every ratio within 1e-5 of 1 < cap 2
    assert np.isfinite(record["loss"])
