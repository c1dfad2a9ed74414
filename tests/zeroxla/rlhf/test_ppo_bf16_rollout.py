"""PPO with a bf16 rollout (`PPOConfig.rollout_dtype="bfloat16"`, `--rollout-dtype bfloat16`)
and verl's token importance weights (`--rollout-is token`) on a tiny Llama actor at tensor
parallelism 1, static batching: the engine's recorded log-probs are an independent bf16
reference's (the starting actor with every parameter cast to bfloat16, a plain full forward,
log-softmax in float32) within 1e-4, far further from the float32 training forward's; the
record's train/rollout gap is that difference (> 0, the numpy maximum), and the correction's
metrics are the float64 numpy ones of the actor's float32 log-probs against those bf16 ones;
the iteration completes with finite losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.app.tokenizers.basic import CharTokenizer
from zeroxla.rlhf import PPOConfig, PPOTrainer
from zeroxla.rlhf.grpo import arithmetic_task as task
from zeroxla.rlhf.rollout_correction import RolloutCorrection

TOKENIZER = CharTokenizer.from_text(task.ALPHABET)
CONFIG = PPOConfig(prompts_per_iteration=16, prompt_length=8, answer_length=12,
                   rollout_dtype="bfloat16", rollout_corr=RolloutCorrection(is_level="token"))


def bf16_logprobs(model, tokens, prompt_length):
    """float64 [B, G] log-probs of `tokens`' answers under `model` with its parameters cast to
    bfloat16: one full forward of tokens[:, :-1], the logits' log-softmax in float32."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    bf16 = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), rest)
    logits = nnx.jit(lambda m, t: m(t).astype(jnp.float32))(bf16, jnp.asarray(tokens[:, :-1]))
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)[:, prompt_length - 1:]
    return np.take_along_axis(logp, tokens[:, prompt_length:, None], -1)[..., 0]


@pytest.mark.slow
def test_a_bf16_ppo_rollout_is_corrected_against_the_bf16_log_probs():
    actor = models.build("llama-tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=24, seed=3)
    prompts = np.random.default_rng(0).integers(1, TOKENIZER.vocab_size, (32, 8))
    trainer = PPOTrainer(CONFIG, actor, mesh=zeroxla.make_mesh(2, 4), tokenizer=TOKENIZER,
                         prompt_tokens=prompts.astype(np.int32), inference_tp_size=1,
                         reward_fn=lambda text: len(set(text)) / 6, seed=0)
    assert trainer.engine.batching == "static"
    start = zeroxla.gathered_model(trainer.actor_state)       # the weights the rollout draws
    record, rollout = trainer.iteration(0)
    real = rollout.action_mask > 0
    assert int(real.sum()) == 16 * 12
    drawn = rollout.rollout_logprobs.astype(np.float64)
    want = bf16_logprobs(start, rollout.tokens, CONFIG.prompt_length)
    gap_bf16 = np.abs(drawn - want)[real].max()
    gap = np.abs(rollout.logprobs.astype(np.float64) - drawn)[real]
    # 4.8e-7 and 2.5e-3 measured (XLA:CPU)
    assert gap_bf16 <= 1e-4 and gap.max() > 5e-4, (gap_bf16, gap.max())
    assert record["gap/max"] == pytest.approx(gap.max(), rel=1e-6)
    assert record["gap/mean_abs"] == pytest.approx(gap.mean(), rel=1e-5)
    log_ratio = (rollout.logprobs.astype(np.float64) - drawn)[real]     # log pi_train / pi_roll
    assert record["rollout_corr/kl"] == pytest.approx(np.mean(-log_ratio), rel=1e-4, abs=1e-7)
    assert record["rollout_corr/rollout_is_mean"] == pytest.approx(np.mean(np.exp(log_ratio)),
                                                                  rel=1e-6)
    assert record["rollout_corr/rollout_is_max"] == pytest.approx(np.exp(log_ratio).max(),
                                                                 rel=1e-6)
    assert np.isfinite(record["actor_loss"]) and np.isfinite(record["critic_loss"])
